"""The KernelBench built-in proposer explores a seeded sample over (fusion scope x tile configuration): the same seed
gives the same list, two seeds different ones, every scope is reached, and at the same budget sample-k and iter-k
draw different candidates (the verifier here is a stand-in that passes everything: no kernel runs)."""
from __future__ import annotations

from pathlib import Path

import pytest

GEMM_SCALE = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super(Model, self).__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        return torch.relu(self.linear(x) * self.scale)

def get_inputs():
    return [torch.rand(4, 16)]

def get_init_inputs():
    return [16, 8, 0.5]
'''


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    from llm4llm.kernelbench.problem import make_task

    d = tmp_path_factory.mktemp("kbprop")
    (d / "1_Gemm_Scale_ReLU.py").write_text(GEMM_SCALE)
    return make_task(d / "1_Gemm_Scale_ReLU.py", d)


def _list(task_dir, seed: int):
    from llm4llm.kernelbench.run import kb_proposer
    from llm4llm.taskspec import load_spec

    prop = kb_proposer("library", seed)
    spec = load_spec(task_dir)
    return prop, spec, prop.candidate_list(spec)


def test_the_list_is_seeded_and_spans_the_scopes(task_dir):
    from llm4llm.kernelbench.proposer import TILES_PER_SCOPE

    prop, spec, first = _list(task_dir, 0)
    _, _, again = _list(task_dir, 0)
    _, _, other = _list(task_dir, 1)
    assert first == again and first != other
    templates = prop.templates_for(spec)
    assert [t.name for t in templates] == ["kb.fused_tail", "kb.gemm_epilogue"]
    # every seed starts where the library's first template starts
    assert first[0] == other[0] == (templates[0].name, templates[0].default(spec))
    scopes = {(name, c["epilogue"]) for name, c in first}
    assert scopes == {(t.name, e) for t in templates for e in (True, False)}
    for scope in scopes:
        points = [c for name, c in first if (name, c["epilogue"]) == scope]
        assert 1 < len(points) <= TILES_PER_SCOPE and len({repr(sorted(c.items())) for c in points}) == len(points)
    # breadth first: every template's default fusion choice before any scope's second tile configuration
    home = {t.name: t.default(spec)["epilogue"] for t in templates}
    assert {name for name, c in first[:len(templates)]} == set(home)
    assert all(c["epilogue"] == home[name] for name, c in first[:len(templates)])


def test_sample_and_iter_draw_different_candidates(task_dir):
    """Same seed, same budget: sample-2 takes the list's first two points (two scopes); iter-2 exploits the first
    one's nearest tile configuration once it passes (explore 0: always exploit)."""
    from llm4llm.kernelbench.proposer import KBProposer
    from llm4llm.kernelbench.templates import TEMPLATES
    from llm4llm.config import SearchSettings
    from llm4llm.search.episode import run_search

    def verify(_task_dir, source):
        return {"passed": True, "failure_class": None, "message": "", "max_abs_err": 0.0,
                "speedup_cold": 1.5, "speedup_in_context": 1.5, "utility": 1.5}

    drawn = {}
    for mode in ("sample", "iter"):
        res = run_search(task_dir, KBProposer(seed=0, explore=0.0, templates=TEMPLATES), verify,
                         SearchSettings(mode=mode, budget=2), archive_dir=task_dir / f"archive-{mode}")
        drawn[mode] = [(t.candidate.template, t.candidate.config) for t in res.trials]
    assert drawn["sample"][0] == drawn["iter"][0] and drawn["sample"][1] != drawn["iter"][1]
    assert drawn["sample"][1][0] != drawn["sample"][0][0]  # the next scope
    assert drawn["iter"][1][0] == drawn["iter"][0][0]  # a tile configuration of the same scope
