"""Templates as modules (issue 41 item 5) for the SSM, Mamba2, RG-LRU, block and MLP templates: the rendered source
imports its host code from kernels_runtime.hosts and defines no function but the contract's `entry`; a config that
chooses `state_inplace` still declares STATE_IN_PLACE at module level (kernels_runtime.patch reads it from the
entry's globals). Synthetic specs, no kernel runs: the templates' numerics are tests/test_templates_real.py's."""
from __future__ import annotations

import ast

import pytest

from llm4llm.search.templates import TEMPLATES
from llm4llm.search.templates.mamba2 import MAMBA2_WEIGHTS
from llm4llm.search.templates.recurrent import RG_WEIGHTS
from llm4llm.search.templates.ssm import MAMBA_WEIGHTS
from llm4llm.taskspec import TaskSpec

BY_NAME = {t.name: t for t in TEMPLATES}
MAMBA2_STATIC = {"head_dim": 8, "n_groups": 1, "ssm_state_size": 16, "intermediate_size": 64}
BLOCK_STATIC = {"norm.variance_epsilon": 1e-5, "residual_in_fp32": True}


def _spec(family, phase, inputs, weights, static=None, states=()) -> TaskSpec:
    return TaskSpec(task_id="t", workload="w", run_id="r", family=family, module_class="m.Module", instances=["a"],
                    phase=phase, input_names=list(inputs), weight_names=sorted(weights), output_names=["out"],
                    state_names=list(states), static=dict(static or {}), dtype="float32", cases=[])


def _mixer(phase, weights, static=None):
    states = ("conv_state", "ssm_state") if phase == "decode" else ()
    return _spec("ssm_mixer", phase, ["hidden_states", "attention_mask"], weights, static, states)


def _block(phase, weights, static=None):
    states = ("conv_state", "ssm_state") if phase == "decode" else ()
    return _spec("ssm_block", phase, ["hidden_states", "attention_mask"],
                 ["norm.weight", *(f"mixer.{w}" for w in weights)],
                 {**BLOCK_STATIC, **{f"mixer.{k}": v for k, v in (static or {}).items()}}, states)


def _rglru(phase):
    states = ("conv_state", "rg_lru_state") if phase == "decode" else ()
    return _spec("recurrent_block", phase, ["input_states", "position_ids"], RG_WEIGHTS,
                 {"act_fn.__class__": "GELUTanh"}, states)


CASES = [
    ("ssm_mixer.mamba", _mixer("prefill", MAMBA_WEIGHTS)),
    ("ssm_mixer.mamba_decode", _mixer("decode", MAMBA_WEIGHTS)),
    ("ssm_mixer.mamba_decode_fused", _mixer("decode", MAMBA_WEIGHTS)),
    ("ssm_block.mamba", _block("prefill", MAMBA_WEIGHTS)),
    ("ssm_block.mamba_decode_fused", _block("decode", MAMBA_WEIGHTS)),
    ("ssm_mixer.mamba2", _mixer("prefill", MAMBA2_WEIGHTS, MAMBA2_STATIC)),
    ("ssm_mixer.mamba2_decode", _mixer("decode", MAMBA2_WEIGHTS, MAMBA2_STATIC)),
    ("ssm_mixer.mamba2_decode_fused", _mixer("decode", MAMBA2_WEIGHTS, MAMBA2_STATIC)),
    ("ssm_block.mamba2", _block("prefill", MAMBA2_WEIGHTS, MAMBA2_STATIC)),
    ("ssm_block.mamba2_decode_fused", _block("decode", MAMBA2_WEIGHTS, MAMBA2_STATIC)),
    ("recurrent_block.rglru", _rglru("prefill")),
    ("recurrent_block.rglru_decode", _rglru("decode")),
    ("mlp.swiglu", _spec("mlp", "prefill", ["x"], ["gate_proj.weight", "up_proj.weight", "down_proj.weight"])),
    ("mlp.swiglu", _spec("mlp", "decode", ["x"], ["gate_up_proj.weight", "down_proj.weight"])),
    ("mlp.gelu", _spec("mlp", "prefill", ["x"], ["c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"],
                       {"act.__class__": "NewGELUActivation", "c_fc.nf": 64, "c_proj.nf": 16})),
]


def _configs(template, spec):
    """The default and every value of each key one at a time (the fusion scopes, state_inplace, xproj_rms...)."""
    default, space = template.default(spec), template.space(spec)
    return [default, *({**default, k: v} for k, vals in space.items() for v in vals if not isinstance(v, int)
                       or isinstance(v, bool))]


@pytest.mark.parametrize("name,spec", CASES, ids=[f"{n}-{s.phase}" for n, s in CASES])
def test_rendered_source_imports_its_host_and_defines_only_entry(name, spec):
    template = BY_NAME[name]
    assert template.why_not(spec) is None
    for config in _configs(template, spec):
        src = template.render(spec, config)
        tree = ast.parse(src)
        functions = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert functions == ["entry"], (name, functions)
        assert len(imports) == 1 and isinstance(imports[0], ast.ImportFrom), (name, ast.dump(imports[0]))
        assert imports[0].module.startswith("kernels_runtime.hosts."), (name, imports[0].module)
        ns: dict = {}
        exec(compile(src, f"<{name}>", "exec"), ns)  # the factory takes the config and the names it is given
        assert callable(ns["entry"]) and ns["CONFIG"] == config
        if "state_inplace" in config:
            assert ns["STATE_IN_PLACE"] is config["state_inplace"]
        else:
            assert "STATE_IN_PLACE" not in ns
        if name.startswith("ssm_block."):
            assert "prefix='mixer.'" in src
