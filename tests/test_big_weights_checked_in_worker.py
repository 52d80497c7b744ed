"""Weights over WEIGHT_BUFFER_LIMIT (an lm_head's tied embedding: 778 MB on qwen3-4b) are not sent back to the
parent; the worker checks their canaries and bits itself. That path crashed the worker on every lm_head candidate on
the H200 (2026-12-02, docs/results/2026-12-02-h200-b): here it runs with the limit at 0, so every weight takes it."""
from __future__ import annotations

import os

import pytest

from llm4llm.verify import gates
from test_verify import build_rmsnorm_task, cheat_source


def _write_weight_kernel_source() -> str:
    """The correct RMSNorm, plus a second launch that writes the output into the weight (a mutated weight)."""
    src = cheat_source("correct_rmsnorm")
    assert 'return {"out": out}' in src
    return src.replace('return {"out": out}', 'weights["weight"].mul_(1.0)\n    weights["weight"].add_(1.0)\n'
                                                '    return {"out": out}')


@pytest.mark.parametrize("name, expect", [("correct_rmsnorm", None), ("weight_written", "input_mutated")])
def test_big_weights_are_checked_in_the_worker(tmp_path, monkeypatch, name, expect):
    monkeypatch.setattr(gates, "WEIGHT_BUFFER_LIMIT", 0)
    task_dir = build_rmsnorm_task(tmp_path)
    src = cheat_source(name) if name != "weight_written" else _write_weight_kernel_source()
    s = gates.CandidateSession(str(task_dir), src, "cpu", draws=2, seed=1, canary_seed=2)
    assert "ok" in s.load(), "the candidate must load"
    d = s.draws[0]
    x = d.inputs["hidden_states"]
    meta = gates.out_meta({"out": x})  # the RMSNorm's output has its input's shape and dtype
    reply = s.call(list(d.key), poison=float("nan"), meta=meta, path=os.fspath(tmp_path / "out.safetensors"))
    if expect is None:
        assert reply.get("ok"), reply
    else:
        assert reply.get("fail") and reply["fail"][1] == expect, reply
