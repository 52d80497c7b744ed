"""Decode attention over transformers' static KV cache: extraction on the static cache, the StaticLayer state
adapter, the attention.decode_static template, and the patched model generating on the static cache eagerly and
under (emulated) decode graphs without falling back. tiny-qwen3 (GQA 4/2, q/k norms), fp32, Triton interpreter."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels_runtime.boundary import (CACHE_LAYER_ADAPTERS, STATE_OUT, UnsupportedBoundary, adapter_by_name,
                                      call_reference)
from kernels_runtime.tolerances import assert_close
from llm4llm.taskspec import load_task

WORKLOAD = Path(__file__).resolve().parents[1] / "examples" / "workloads" / "tiny-qwen3.toml"


@pytest.fixture(scope="module")
def static_run(tiny_extracted):
    """tiny-qwen3 profiled and extracted with static_cache=True (conftest's `tiny-qwen3+static`): (index path,
    {(family, phase): task})."""
    dirs = tiny_extracted("tiny-qwen3+static")
    tasks = {}
    for d in dirs:
        t = load_task(d)
        tasks.setdefault((t.spec.family, t.spec.phase), t)
    return str(next(dirs[0].parent.parent.rglob("tasks.json"))), tasks


def _template(name):
    from llm4llm.search.templates import TEMPLATES

    return next(t for t in TEMPLATES if t.name == name)


def test_kv_decode_tasks_are_extracted_on_the_static_cache(static_run):
    """Decode attention comes from the static-cache run (preallocated K/V of the cache's full size, the length as a
    device tensor: the prompt's 16 positions); prefill attention stays on the dynamic cache; the plan asks for the
    static cache; only the static template takes the decode task."""
    from llm4llm.graph_plan import decode_graphs_plan

    index, tasks = static_run
    dec, pre = tasks[("attention", "decode")], tasks[("attention", "prefill")]
    state = dec.spec.recipe["state"]
    assert state["adapter"] == "StaticLayer" and state["max_cache_len"] == 19, state
    assert dec.spec.state_names == ["key_cache", "value_cache", "cache_len"] and dec.spec.deployable
    case = dec.cases[0]
    assert tuple(case.state["key_cache"].shape) == (1, 2, 19, 16) and int(case.state["cache_len"]) == 16
    assert case.state["cache_len"].dtype == torch.int64 and case.state["cache_len"].dim() == 0
    assert pre.spec.recipe["state"]["adapter"] == "DynamicLayer"
    assert decode_graphs_plan(index, "cuda", "auto")[:2] == (True, True)
    assert _template("attention.decode_static").why_not(dec.spec) is None
    assert "static KV cache task" in _template("attention.decode_splitkv").why_not(dec.spec)
    assert "expected a static KV cache task" in _template("attention.decode_static").applies_fn(pre.spec)


def test_static_layer_adapter_builds_reads_and_writes_back(static_run):
    """The adapter's one-layer cache reproduces the captured call (HF's update writes at the length and advances
    it); write_state copies a kernel's out-of-place result into the layer's own tensors (addresses kept for
    graphs) and the length in place; a sliding layer whose window is full is not adapted (it would roll)."""
    from transformers.cache_utils import DynamicCache, StaticSlidingWindowLayer

    task = static_run[1][("attention", "decode")]
    case, spec = task.cases[0], task.spec
    module = task.load_module("cpu").eval()
    got = call_reference(module, case.weights, case.inputs, case.state, spec.static, spec.recipe)
    for name, ref in case.ref.items():
        assert torch.equal(got[name], ref), name
    k_in, k_out = case.state["key_cache"], got[STATE_OUT + "key_cache"]
    assert int(got[STATE_OUT + "cache_len"]) == 17 and not torch.equal(k_out[:, :, 16], k_in[:, :, 16])
    assert torch.equal(k_out[:, :, :16], k_in[:, :, :16]) and torch.equal(k_out[:, :, 17:], k_in[:, :, 17:])

    adapter = adapter_by_name("StaticLayer")
    cache, _ = adapter.build(module, case.state, spec.recipe["state"])
    layer = cache.layers[module.layer_idx]
    ptrs = (layer.keys.data_ptr(), layer.values.data_ptr(), layer.cumulative_length.data_ptr())
    adapter.write_state(module, cache, {n[len(STATE_OUT):]: t.clone() for n, t in got.items()
                                        if n.startswith(STATE_OUT)}, spec.recipe["state"], case.inputs)
    assert (layer.keys.data_ptr(), layer.values.data_ptr(), layer.cumulative_length.data_ptr()) == ptrs
    assert torch.equal(layer.keys, k_out) and int(layer.cumulative_length) == 17
    with pytest.raises(ValueError, match="of \(1, 2, 19, 16\)"):
        adapter.write_state(module, cache, {"key_cache": k_out[:, :, :5], "value_cache": k_out[:, :, :5],
                                            "cache_len": torch.tensor(5)}, spec.recipe["state"], case.inputs)

    sliding = StaticSlidingWindowLayer(max_cache_len=4, sliding_window=4)
    sliding.cumulative_length_int = 4
    full = DynamicCache()
    full.layers = [sliding] * (module.layer_idx + 1)
    with pytest.raises(UnsupportedBoundary, match="window is full"):
        CACHE_LAYER_ADAPTERS["StaticSlidingWindowLayer"].describe(module, full)


def test_static_template_matches_the_module_on_the_captured_call(static_run, tmp_path):
    """The rendered candidate on the captured case: output and the mutated cache (written in place: state_out is
    the state-in tensors themselves) as the module's own forward, the length advanced on the device."""
    from llm4llm.verify.candidate import load_candidate, unload_candidate

    task = static_run[1][("attention", "decode")]
    tpl = _template("attention.decode_static")
    source = tpl.render(task.spec, tpl.default(task.spec))
    mod = load_candidate(source, tmp_path, "static_attention_candidate")
    try:
        case = task.cases[0]
        state = {n: t.clone() for n, t in case.state.items()}
        out = mod.entry(dict(case.inputs), dict(case.weights), state, dict(task.spec.static))
    finally:
        unload_candidate("static_attention_candidate")
    for name in ("key_cache", "value_cache", "cache_len"):
        assert out[STATE_OUT + name] is state[name]
    assert_close(out["out"], case.ref["out"])
    assert_close(out[STATE_OUT + "key_cache"], case.ref[STATE_OUT + "key_cache"], name="key cache")
    assert_close(out[STATE_OUT + "value_cache"], case.ref[STATE_OUT + "value_cache"], name="value cache")
    assert int(out[STATE_OUT + "cache_len"]) == 17


def test_patched_model_decodes_on_the_static_cache_without_falling_back(static_run):
    """In the model: generate on the static cache with the candidate installed (the verifier's patch spec for the
    task): every decode call of both layers takes the kernel, none falls back, and the teacher-forced logits match
    the unpatched model's, eagerly and with the decode steps replayed from (emulated: closure re-run) graphs."""
    from static_patched import check_static_decode_in_model

    task = static_run[1][("attention", "decode")]
    tpl = _template("attention.decode_static")
    check_static_decode_in_model(str(WORKLOAD), task.spec, tpl.render(task.spec, tpl.default(task.spec)),
                                 "static-attention")


def test_graph_timing_of_a_static_cache_task_stays_inside_the_cache(static_run, monkeypatch):
    """Graph timing of a static-cache decode task: GRAPH_CALLS (20) calls and every replay advance the cache's
    length, and the workload's cache holds only its decode steps past the prompt (3 here, 7 on the 2-layer
    qwen3-4b: on the H200 HF's StaticLayer.update then hit its index_copy_ bound: a device-side assert, 2026-12-01).
    Each call gets its own copy of the captured state and the lengths are put back before every replay, so every
    call writes at the captured position. A closure re-run stands in for the CUDA graph (update's bound check is
    an IndexError on the CPU)."""
    import contextlib

    from llm4llm.verify import timing
    from llm4llm.verify.gates import make_draws, reference_fn
    from llm4llm.verify.verdict import Verdict
    from tests.test_timing_reference import _CpuEvent

    class _Rerun:
        def warmup(self, fn):
            fn()

        def record(self, fn):
            fn()
            return _Replay(fn), None

    class _Replay:
        def __init__(self, fn):
            self.fn = fn

        def replay(self):
            self.fn()

    for name, value in (("Event", _CpuEvent), ("synchronize", lambda device=None: None),
                        ("current_stream", lambda device=None: None), ("device", lambda d: contextlib.nullcontext())):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr("kernels_runtime.graphs.CudaGraphBackend", _Rerun)
    monkeypatch.setattr(timing, "l2_bytes", lambda d: 1)
    monkeypatch.setattr(timing, "MIN_REPS", 3)
    monkeypatch.setattr(timing, "MIN_TIME_MS", 0.0)
    monkeypatch.setattr(timing, "GRAPH_REPLAYS", 4)
    monkeypatch.setattr(timing, "GRAPH_WARM_MS", 0.0)
    timing._REFERENCE_CACHE.clear()
    task = static_run[1][("attention", "decode")]
    dev = torch.device("cpu")
    seen = []
    real = timing.counters_of
    monkeypatch.setattr(timing, "counters_of", lambda reads: seen.append(real(reads)) or seen[-1])
    v = Verdict(source_hash="x", task_id=task.spec.task_id)
    timing.time_task(v, task, reference_fn(task, dev), make_draws(task, dev, 0, 0), dev, decode_graph=True)
    timing._REFERENCE_CACHE.clear()
    detail = next(g.detail for g in v.gates if g.name == "timing_in_context")
    assert "GPU time under CUDA-graph replay" in detail, detail
    lengths = [int(start) for reset in seen for t, start in reset if t.dim() == 0]
    assert len(lengths) >= timing.GRAPH_CALLS and set(lengths) == {16}, lengths  # one cache a call, each at 16


def test_extraction_goes_to_the_static_cache_only_where_decode_graphs_may_run():
    from llm4llm.graph_plan import extract_on_static_cache

    assert extract_on_static_cache("cuda", "auto") and extract_on_static_cache("cuda:1", True)
    assert not extract_on_static_cache("cuda", "off") and not extract_on_static_cache("cuda", False)
    assert not extract_on_static_cache("cpu", "on")
