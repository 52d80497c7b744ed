"""Timed calls run on fresh inputs, and a random sample of them is judged against the reference (issue 19).

Timing is CUDA-only; on the CPU the same timed calls are rehearsed (host clocks, numbers discarded) for their outputs.
The cheats that go wrong only while timed are tests/cheats/timed_*.py (run by test_verify_cheats.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm4llm.taskspec import load_task
from llm4llm.verify import timing
from llm4llm.verify.gates import GateFailure, check_timed_samples, samples_payload
from llm4llm.verify.timing import TimedSample, fill_fresh, fresh_draw, fresh_stds, time_call
from test_verify import CHEATS, cheat_source, shared_pool, shared_task_dir

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    return shared_task_dir(tmp_path_factory)


def _entry(name: str):
    ns: dict = {}
    exec(compile((CHEATS / f"{name}.py").read_text(), f"{name}.py", "exec"), ns)  # noqa: S102 - our own fixture
    return ns["entry"]


def _args(task, k: int = 0):
    c = task.cases[k]
    return [(c.inputs, c.weights, c.state, task.spec.static)]


def test_every_timed_call_gets_fresh_inputs_that_the_parent_can_rebuild(task_dir, monkeypatch):
    """No two timed calls (cold or in_context, warm-up included) see the same data, and the seed each sample
    carries rebuilds its inputs bit for bit; masks, positions and integers stay as captured."""
    monkeypatch.setattr(timing, "MIN_REPS", 12)
    monkeypatch.setattr(timing, "MIN_TIME_MS", 0.0)
    task = load_task(task_dir)
    seen = []

    def spy(inputs, weights, state, static):
        seen.append(inputs["hidden_states"].clone())
        return {"out": inputs["hidden_states"] * 2}

    for mode in ("cold", "in_context"):
        seen.clear()
        sampler = TimedSample(0, mode, "entry", k=100)
        time_call(spy, _args(task), mode, CPU, fresh_seed=1000, sampler=sampler)
        assert len(seen) == timing.WARMUP + 12 and len({t.sum().item() for t in seen}) == len(seen)
        captured = task.cases[0].inputs["hidden_states"]
        assert not any(torch.equal(t, captured) for t in seen)
        for call, seed, outs in sampler.kept:
            rebuilt, _ = fresh_draw(task.cases[0].inputs, task.cases[0].state, seed)
            assert torch.equal(rebuilt["hidden_states"], seen[timing.WARMUP + call])
            assert torch.equal(outs["out"], 2 * seen[timing.WARMUP + call])
    keep = {"position_ids": torch.arange(4), "attention_mask": torch.ones(4), "x": torch.randn(4)}
    dst = {n: torch.zeros_like(t) for n, t in keep.items()}
    fill_fresh(dst, {}, keep, {}, fresh_stds(keep, {}), 7)
    assert torch.equal(dst["position_ids"], keep["position_ids"]) and torch.equal(dst["attention_mask"],
                                                                                  keep["attention_mask"])
    assert not torch.equal(dst["x"], keep["x"])


def test_the_sample_is_a_random_choice_over_all_timed_calls():
    """A reservoir of k over every offered call, drawn from the OS after each call returned: late calls are kept as
    often as early ones, and two runs keep different calls."""
    picks, choices = [], set()
    for _ in range(200):
        s = TimedSample(0, "cold", "entry", k=4)
        for i in range(40):
            s.offer(i, {"out": torch.tensor([float(i)])})
        assert len(s.kept) == 4 and s.seen == 40
        assert all(out["out"].item() == seed == call for call, seed, out in s.kept)
        picks += [call for call, _, _ in s.kept]
        choices.add(tuple(sorted(call for call, _, _ in s.kept)))
    late = sum(c >= 20 for c in picks) / len(picks)
    assert 0.4 < late < 0.6 and len(choices) > 150


def test_large_outputs_keep_fewer_samples(monkeypatch):
    monkeypatch.setattr(timing, "SAMPLE_BYTES", 3 * 4096)
    s = TimedSample(0, "cold", "entry")
    for i in range(20):
        s.offer(i, {"out": torch.zeros(1024)})  # 4 KiB each: three fit
    assert s.k == 3 and len(s.kept) == 3
    small = TimedSample(0, "cold", "entry")
    small.offer(0, {"out": torch.zeros(1 << 20)})  # over the budget alone: still one
    assert small.k == 1 and len(small.kept) == 1


def test_parent_check_passes_the_correct_entry_and_names_the_bad_call(task_dir, monkeypatch):
    """The bare entry's sampled timed calls, judged in the parent against the reference on their rebuilt inputs:
    the correct candidate passes; one that goes wrong after its 24th call fails with timed_output_mismatch."""
    monkeypatch.setattr(timing, "MIN_REPS", 30)
    monkeypatch.setattr(timing, "MIN_TIME_MS", 0.0)
    task = load_task(task_dir)
    for name, ok in (("correct_rmsnorm", True), ("timed_call_count", False)):
        entry = _entry(name)
        samples = []
        for k in range(len(task.cases)):
            s = TimedSample(k, "cold", "entry", k=30)  # every timed call: the outcome does not hang on the draw
            time_call(entry, _args(task, k), "cold", CPU, fresh_seed=50 + 1000 * k, sampler=s)
            samples.append(s)
        meta, tensors = samples_payload(samples)
        assert len(meta) == 60 and {m["via"] for m in meta} == {"entry"}
        if ok:
            assert "60 timed calls" in check_timed_samples(task, CPU, meta, tensors)
        else:
            with pytest.raises(GateFailure) as e:
                check_timed_samples(task, CPU, meta, tensors)
            assert e.value.failure_class == "timed_output_mismatch" and e.value.gate == "timed_outputs"
            assert "cold timing of case 0" in e.value.message and "max abs err" in e.value.message
    meta[0]["names"] = []
    with pytest.raises(GateFailure, match="missing"):
        check_timed_samples(task, CPU, meta[:1], {})
    with pytest.raises(GateFailure, match="no sampled timed call"):
        check_timed_samples(task, CPU, [], {})


def test_rehearsal_on_the_cpu_checks_timed_outputs_and_never_times(task_dir):
    """Through the worker: the correct candidate passes with its sampled timed outputs checked, and a CPU
    rehearsal reports no latency and no speedup."""
    if torch.cuda.is_available():
        pytest.skip("on the GPU the timed calls are timed for real: test_on_the_gpu_timed_outputs_are_judged")
    v = shared_pool().verify(task_dir, cheat_source("correct_rmsnorm"), rehearse_timing=True)
    assert v.passed, v.message
    gate = next(g for g in v.gates if g.name == "timed_outputs")
    assert "match the reference" in gate.detail and "via" not in gate.detail
    assert v.candidate_cold is None and v.speedup_in_context is None and v.utility == 0.0
    assert all("rehearsed" in g.detail for g in v.gates if g.name.startswith("timing_"))


def test_the_operators_switch_turns_the_check_off_loudly(task_dir, monkeypatch):
    """LLM4LLM_TIMED_CHECK=off (read in the parent, for debugging the check on a new GPU): a timing-only cheat is
    then not caught by it, and the gate says in the verdict that it was off."""
    if torch.cuda.is_available():
        pytest.skip("CPU rehearsal only")
    monkeypatch.setenv("LLM4LLM_TIMED_CHECK", "off")
    v = shared_pool().verify(task_dir, cheat_source("timed_call_count"), rehearse_timing=True)
    gate = next(g for g in v.gates if g.name == "timed_outputs")
    assert gate.detail.startswith("off (LLM4LLM_TIMED_CHECK=off)"), gate.detail
    assert v.failure_class != "timed_output_mismatch"


def test_graph_replays_on_the_cpu_get_fresh_inputs_and_a_capture_only_shortcut_is_caught(monkeypatch):
    """time_graphs with kernels_runtime's CPU graph emulation (ATen ops recorded at capture, re-executed on replay
    into the captured outputs): each replay's inputs are rewritten, the sampled call's outputs are those of its
    fresh inputs, and a candidate that records a do-nothing call when it sees the capture is caught. The GPU test
    below does the same under real CUDA graphs."""
    import contextlib

    from kernels_runtime.graphs import _EmulatedBackend

    capturing = [False]

    class _Graph:
        def __init__(self, ops, fn, out):
            self.ops, self.fn, self.out = ops, fn, out

        def replay(self):
            _EmulatedBackend.replay(self.ops, self.fn, self.out)

    class _Backend:
        def __init__(self, *a, **k):
            self.inner = _EmulatedBackend()

        def warmup(self, fn):
            fn()

        def record(self, fn):
            capturing[0] = True
            try:
                ops, out = self.inner.record(fn)
            finally:
                capturing[0] = False
            return _Graph(ops, fn, out), out

    monkeypatch.setattr("kernels_runtime.graphs.CudaGraphBackend", _Backend)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", lambda **k: timing._HostEvent())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    for name, value in (("GRAPH_CALLS", 3), ("GRAPH_REPLAYS", 8), ("MIN_TIME_MS", 0.0), ("GRAPH_WARM_MS", 0.0)):
        monkeypatch.setattr(timing, name, value)
    x = torch.randn(4, 16)
    args = [({"x": x}, {}, {}, {})]

    def honest(inputs, weights, state, static):
        return {"out": inputs["x"] * 2}

    def lazy(inputs, weights, state, static):
        return {"out": torch.zeros_like(inputs["x"]) if capturing[0] else inputs["x"] * 2}

    for fn, ok in ((honest, True), (lazy, False)):
        s = TimedSample(0, "in_context (graph replay)", "entry")
        timing.time_graphs([([fn], [None]), ([honest], [None])], args, CPU, fresh_seed=123, samplers=[s, None])
        assert len(s.kept) == timing.SAMPLES_PER_RUN and s.seen >= 8
        assert len({seed for _, seed, _ in s.kept}) == len(s.kept)
        for _, seed, outs in s.kept:
            fresh, _ = fresh_draw({"x": x}, {}, seed)
            assert torch.equal(outs["out"], 2 * fresh["x"]) == ok


@pytest.mark.gpu
def test_graph_replays_get_fresh_inputs_and_a_capture_only_shortcut_is_caught():
    """Under CUDA-graph timing no candidate code runs at replay: a candidate that records a do-nothing call when
    it sees a capture is right on every eager call. Each replay rewrites the inputs, and a sampled call's outputs
    must be those of its fresh inputs."""
    dev = torch.device("cuda")
    x = torch.randn(4, 64, device=dev)
    args = [({"x": x}, {}, {}, {})]

    def honest(inputs, weights, state, static):
        return {"out": inputs["x"] * 2}

    def lazy(inputs, weights, state, static):
        if torch.cuda.is_current_stream_capturing():
            return {"out": torch.zeros_like(inputs["x"])}
        return {"out": inputs["x"] * 2}

    for fn, ok in ((honest, True), (lazy, False)):
        s = TimedSample(0, "in_context (graph replay)", "entry")
        timing.time_graphs([([fn], [None]), ([honest], [None])], args, dev, fresh_seed=123, samplers=[s, None])
        assert len(s.kept) == timing.SAMPLES_PER_RUN and s.seen >= timing.GRAPH_REPLAYS
        assert len({seed for _, seed, _ in s.kept}) == len(s.kept)
        for _, seed, outs in s.kept:
            fresh, _ = fresh_draw({"x": x}, {}, seed)
            assert torch.equal(outs["out"], 2 * fresh["x"]) == ok


@pytest.mark.gpu
@pytest.mark.parametrize("decode_timing", ["launch", "graph_prefill"])
def test_on_the_gpu_timed_outputs_are_judged(task_dir, decode_timing):
    """Timed on the GPU (back to back; graph replay for this prefill task with graph_prefill): the correct
    candidate passes with its sampled timed outputs matching; the timing-only cheats fail with
    timed_output_mismatch."""
    from llm4llm.verify import VerifierPool

    with VerifierPool("cuda", timeout_s=300.0, draws=5, decode_timing=decode_timing) as pool:
        v = pool.verify(task_dir, cheat_source("correct_rmsnorm"))
        assert v.passed and v.speedup_in_context, v.message
        gates = {g.name: g.detail for g in v.gates}
        assert "match the reference" in gates["timed_outputs"], gates
        if decode_timing != "launch":
            assert "CUDA-graph replay" in gates["timing_in_context"], gates
        for name in ("timed_call_count", "timed_plain_tensors"):
            bad = pool.verify(task_dir, cheat_source(name))
            assert bad.failure_class == "timed_output_mismatch", (name, bad.failure_class, bad.message)
