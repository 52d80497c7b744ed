"""The per-phase profiler on tiny Llama and Mamba: phases, shares, plausible hotspots, hook removal."""
from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from rich.console import Console
from rich.table import Table

from kernels_runtime.families import is_container
from llm4llm.errors import ScriptError
from llm4llm.profiler import format_hotspots, hardware_info, profile_model, signature
from llm4llm.workload import call_script, load_script, load_workload

WORKLOADS = Path(__file__).resolve().parents[1] / "examples" / "workloads"


def _setup(name: str):
    w = load_workload(WORKLOADS / f"{name}.toml")
    script = load_script(w)
    model = call_script(script.build, w)
    batch = call_script(script.inputs, w)
    return w, model, lambda: call_script(script.run, model, w, batch)


def _hook_counts(model):
    return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-mamba"])
def profiled(request):
    w, model, run = _setup(request.param)
    hooks_before = _hook_counts(model)
    # One thread's CPU time, median of 3 runs: the structure asserted below holds on a busy, shared CI host.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = profile_model(model, run, device=w.device, repeats=3, cpu_clock=time.thread_time)
    finally:
        torch.set_num_threads(threads)
    assert _hook_counts(model) == hooks_before
    return request.param, w, model, result


def test_phases(profiled):
    _, w, _, result = profiled
    assert set(result.phases) == {"prefill", "decode"}
    assert result.phases["prefill"].forwards == 1
    assert result.phases["decode"].forwards == w.decode_len - 1
    assert sum(p.weight for p in result.phases.values()) == pytest.approx(1.0)
    assert all(p.time_ms > 0 for p in result.phases.values())
    assert result.timer == "thread_time" and result.hardware["device"] == "cpu"


def test_shares(profiled):
    _, w, model, result = profiled
    by_phase = defaultdict(dict)
    for r in result.records:
        by_phase[r.phase][r.module_path] = r
        assert 0.0 <= r.share <= 1.0 + 1e-6
        assert r.hotspot_score == pytest.approx(r.share * result.phases[r.phase].weight)
    for phase, records in by_phase.items():
        root = records[""]
        assert root.share == pytest.approx(1.0) and root.family == "model" and root.depth == 0
        assert root.time_ms == pytest.approx(result.phases[phase].time_ms)
        layers = [r for r in records.values() if r.family in ("decoder_layer", "ssm_block")]
        assert len(layers) == 2 and 0.3 < sum(r.share for r in layers) <= 1.0 + 1e-6
        for r in layers:
            assert r.calls == (1 if phase == "prefill" else w.decode_len - 1)
        for path, r in records.items():  # inclusive: a child never costs more than its parent
            if path:
                parent = records.get(path.rsplit(".", 1)[0] if "." in path else "")
                if parent is not None and parent.calls == r.calls:
                    assert r.time_ms <= parent.time_ms + 1e-6, path


def test_signatures(profiled):
    _, w, _, result = profiled
    root = {r.phase: r for r in result.records if r.module_path == ""}
    assert f"[1, {w.prompt_len}]:int64" in root["prefill"].in_shapes[0]
    assert root["decode"].in_shapes[0].startswith("[1, 1]:int64")
    assert root["prefill"].out_shapes[0].startswith("[1, 1, 256]:float32")  # generate keeps the last logits only


def test_hotspots_are_plausible(profiled):
    name, _, _, result = profiled
    ranked = result.ranked()
    leafish = [r for r in ranked if not is_container(r.family)]
    expected = {"ssm_mixer"} if name == "tiny-mamba" else {"attention", "mlp"}
    assert leafish[0].family in expected
    first = {family: next(i for i, r in enumerate(ranked) if r.family == family) for family in {r.family for r in ranked}}
    layer = "ssm_block" if name == "tiny-mamba" else "decoder_layer"  # Mamba's residual block is a kernel target
    assert first[layer] < first["norm"] and min(first[f] for f in expected) < first["norm"]
    for phase in result.phases:
        share = defaultdict(float)
        for r in result.records:
            if r.phase == phase:
                share[r.family] += r.share
        main = share["ssm_mixer"] if name == "tiny-mamba" else share["attention"] + share["mlp"]
        assert main > share["norm"] + share["embedding"] + share["lm_head"]
    families = {r.family for r in result.records}
    assert {"embedding", "lm_head", "norm", "linear", layer, "model"} <= families


def test_format_hotspots(profiled):
    _, _, _, result = profiled
    table = format_hotspots(result, top=5)
    assert isinstance(table, Table) and table.row_count == 5
    console = Console(record=True, width=200)
    console.print(table)
    text = console.export_text()
    assert "layers.0" in text and "(model)" not in text
    assert format_hotspots(result, top=1000, include_model=True).row_count == len(result.records)


def test_user_phase_weights():
    w, model, run = _setup("tiny-mamba")
    result = profile_model(model, run, device="cpu", phase_weights={"prefill": 1, "decode": 3}, warmup=0)
    assert result.phases["prefill"].weight == pytest.approx(0.25)
    assert result.phases["decode"].weight == pytest.approx(0.75)
    assert all(r.in_shapes for r in result.records)  # warmup=0: signatures come from the timed run
    assert result.timer == "perf_counter"


def test_hooks_removed_on_error():
    w, model, run = _setup("tiny-llama")
    hooks_before = _hook_counts(model)
    calls = []

    def failing():
        calls.append(1)
        if len(calls) == 2:  # the timed run, after the warm-up
            model(torch.zeros(1, 3, dtype=torch.long))
            raise RuntimeError("user run failed")
        run()

    with pytest.raises(RuntimeError, match="user run failed"):
        profile_model(model, failing, device="cpu")
    assert _hook_counts(model) == hooks_before


def test_run_that_never_calls_the_model():
    _, model, _ = _setup("tiny-llama")
    with pytest.raises(ScriptError, match="no forward calls"):
        profile_model(model, lambda: None, device="cpu", warmup=0)


def test_signature_and_hardware():
    assert signature(((torch.zeros(2, 3), 5), {"m": torch.ones(4, dtype=torch.int64)})) == "[2, 3]:float32|[4]:int64"
    hw = hardware_info("cpu")
    assert hw["device"] == "cpu" and hw["torch"] == torch.__version__ and hw["transformers"]
    assert {"gpu_name", "capability", "triton"} <= set(hw)
