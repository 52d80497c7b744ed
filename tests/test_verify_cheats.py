"""Adversarial suite: every fixture in tests/cheats/ goes through the real spawned worker and must get the failure
class its header names (`# expect: <class> [<class> ...]`; `# gpu` marks GPU-only fixtures; `# timeout_s: N`;
`# options: <verify option> ...`, each set to True, e.g. rehearse_timing: the timed calls run on the CPU too;
`# behind_static`: the static gate refuses its route, and with the gate lifted the runtime layer behind it still
gets the class named)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from llm4llm.verify import VerifierPool
from test_verify import CHEATS, shared_pool, shared_task_dir, static_gate_lifted


def _header(path: Path) -> dict:
    text = path.read_text()
    expect = re.search(r"^# expect: (.+)$", text, re.M).group(1).split()
    timeout = re.search(r"^# timeout_s: (\d+)$", text, re.M)
    options = re.search(r"^# options: (.+)$", text, re.M)
    return {"expect": expect, "gpu": bool(re.search(r"^# gpu$", text, re.M)),
            "timeout_s": float(timeout.group(1)) if timeout else None,
            "options": dict.fromkeys(options.group(1).split(), True) if options else {},
            "behind_static": bool(re.search(r"^# behind_static$", text, re.M))}


FIXTURES = sorted(p for p in CHEATS.glob("*.py") if _header(p)["expect"] != ["pass"])


def _params():
    for p in FIXTURES:
        marks = [pytest.mark.gpu] if _header(p)["gpu"] else []
        yield pytest.param(p, id=p.stem, marks=marks)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    return shared_task_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def pool() -> VerifierPool:
    return shared_pool()


def test_every_fixture_names_a_known_failure_class():
    from llm4llm.outcomes import FailureClass

    assert len(FIXTURES) >= 20
    for p in FIXTURES:
        assert set(_header(p)["expect"]) <= {c.value for c in FailureClass}, p.name


@pytest.mark.parametrize("path", list(_params()))
def test_cheat_is_rejected_for_the_right_reason(pool, task_dir, path):
    h = _header(path)
    if h["behind_static"]:
        assert pool.verify(task_dir, path.read_text()).failure_class == "static"
        with static_gate_lifted():
            v = pool.verify(task_dir, path.read_text(), timeout_s=h["timeout_s"], **h["options"])
    else:
        v = pool.verify(task_dir, path.read_text(), timeout_s=h["timeout_s"], **h["options"])
    assert not v.passed and v.utility == 0.0
    assert v.failure_class in h["expect"], f"{path.stem}: got {v.failure_class}: {v.message[-800:]}"
    assert v.gates and not v.gates[-1].passed and v.gates[-1].detail == v.message
    assert all(g.passed for g in v.gates[:-1])


def test_compile_failure_keeps_tritons_diagnostic(pool, task_dir):
    v = pool.verify(task_dir, (CHEATS / "compile_error.py").read_text())
    assert v.failure_class == "compile"
    assert "power of 2" in v.message and "_bad_kernel" in v.message


def test_static_rejections_say_why(pool, task_dir):
    reasons = {name: pool.verify(task_dir, (CHEATS / f"{name}.py").read_text()).message
               for name in ("calls_f_rms_norm", "imports_transformers", "reads_file", "opens_socket", "uses_eval",
                            "uses_subprocess", "no_triton_static", "calls_reference_class")}
    assert "torch.nn" in reasons["calls_f_rms_norm"]
    assert "transformers" in reasons["imports_transformers"]
    assert "'open'" in reasons["reads_file"]
    assert "'socket'" in reasons["opens_socket"]
    assert "'eval'" in reasons["uses_eval"]
    assert "'subprocess'" in reasons["uses_subprocess"]
    assert "no Triton kernel" in reasons["no_triton_static"]
    assert "LlamaRMSNorm" in reasons["calls_reference_class"]


def test_input_mutation_names_the_tensor(pool, task_dir):
    v = pool.verify(task_dir, (CHEATS / "mutates_input.py").read_text())
    assert v.failure_class == "input_mutated" and "inputs.hidden_states" in v.message
