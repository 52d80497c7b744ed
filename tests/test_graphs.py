"""kernels_runtime.graphs on the CPU: the decode-step graph wrapper's logic (signatures, static buffers, cache binding,
validation, refusals) with the emulating backend, whose "replay" re-runs the recorded closure on the static buffers
and copies into the recorded outputs. A real CUDA graph replays kernels only: what a step does on the host after
capture is lost there, which the emulation cannot show; the GPU runs (docs/results) are the evidence for that."""
from __future__ import annotations

import functools
import inspect as _inspect

import pytest
import torch

import kernels_runtime
from kernels_runtime.bundle import PatchBundle, load_bundle, save_bundle
from kernels_runtime.graphs import (
    _EmulatedBackend,
    decode_graphs_of,
    disable_decode_graphs,
    enable_decode_graphs,
    state_slots,
)
from kernels_runtime.patch import PatchError
from kernels_runtime.tolerances import assert_close
from tests.test_runtime_stateful import (
    MAMBA2_TRITON,
    MAMBA_TRITON,
    NEW_TOKENS,
    assert_same_state,
    class_path,
    generate,
    snapshot,
    stateful_bundle,
    tiny,
)


@pytest.fixture
def prompt():
    return torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(5))


def _graphed_like_eager(model, prompt, run=None, times: int = 1, inspect=None, **enable) -> dict:
    """Generate eagerly, then `times` more with emulated decode graphs: the same tokens and logits each time.
    `run()` generates (default: the tests' `generate`); `inspect(graphs)` looks at them before they are freed.
    Returns the graphs' stats."""
    run = run or (lambda: generate(model, prompt))
    ref = run()
    graphs = enable_decode_graphs(model, backend="emulate", **enable)
    try:
        for _ in range(times):
            _same_generation(run(), ref)
        if inspect is not None:
            inspect(graphs)
        return graphs.stats()
    finally:
        disable_decode_graphs(model)


def _same_generation(got, ref):
    assert torch.equal(got.sequences, ref.sequences)
    for step, (g, r) in enumerate(zip(got.logits, ref.logits)):
        assert_close(g, r, name=f"logits step {step}")


@pytest.mark.parametrize("model_type", ["mamba", "mamba2"])
def test_decode_steps_replay_and_match_eager(prompt, model_type):
    model = tiny(model_type)
    ref = generate(model, prompt)
    ref_state = snapshot(ref.past_key_values)
    graphs = enable_decode_graphs(model, backend="emulate")
    assert enable_decode_graphs(model, backend="emulate") is graphs  # idempotent
    try:
        first = generate(model, prompt)
        _same_generation(first, ref)
        assert_same_state(snapshot(first.past_key_values), ref_state)
        first_state = snapshot(first.past_key_values)
        second = generate(model, prompt)  # a new cache: bound to the graph's buffers, no new capture
        _same_generation(second, ref)
        stats = graphs.stats()
        assert stats["graphs"] == 1 and stats["refused"] == []
        steps = NEW_TOKENS - 1  # decode calls per generate
        assert stats["calls"]["captured"] == 1
        assert stats["replays"] == 2 * steps - 1  # every decode step but the one that captured
        assert stats["calls"]["bound a cache"] == 1
        # the first generate's cache was handed back its own copy when the second one took the buffers
        assert_same_state(snapshot(first.past_key_values), first_state)
        old = [s.get().data_ptr() for s in state_slots(first.past_key_values)]
        new = [s.get().data_ptr() for s in state_slots(second.past_key_values)]
        assert not set(old) & set(new)
    finally:
        disable_decode_graphs(model)
    assert "forward" not in model.__dict__ and decode_graphs_of(model) is None
    _same_generation(generate(model, prompt), ref)


def test_outputs_are_fresh_tensors(prompt):
    """A caller may keep a step's logits: the next replay must not overwrite them."""
    model = tiny("mamba")
    enable_decode_graphs(model, backend="emulate")
    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True)
        cache = out.cache_params
        steps = [model(input_ids=prompt[:, i:i + 1], cache_params=cache, use_cache=True).logits for i in range(4)]
    kept = [s.clone() for s in steps]
    assert decode_graphs_of(model).stats()["replays"] == 3
    for s, k in zip(steps, kept):
        assert torch.equal(s, k)
    assert len({s.data_ptr() for s in steps}) == 4


def test_patched_model_replays_its_kernels(prompt):
    model = tiny("mamba2")
    ref = generate(model, prompt)
    bundle = stateful_bundle(class_path(model, "Mamba2Mixer"), MAMBA2_TRITON)
    kernels_runtime.apply(model, bundle, strict=True)
    # Triton under the interpreter computes on NumPy copies, not ATen ops: the op-replaying emulation cannot hold
    # it (it refuses: the replay differs), the closure re-run can
    graphs = enable_decode_graphs(model, backend="rerun")
    try:
        _same_generation(generate(model, prompt), ref)
        assert graphs.stats()["replays"] == NEW_TOKENS - 2
    finally:
        disable_decode_graphs(model)
        kernels_runtime.revert(model)


@pytest.mark.parametrize("model_type, reason", [
    ("llama", "does not keep static addresses"),
    ("recurrent_gemma", "does not keep static addresses"),
])
def test_growing_caches_run_eagerly_and_say_why(prompt, model_type, reason):
    model = tiny(model_type)
    stats = _graphed_like_eager(model, prompt)
    assert stats["graphs"] == 0 and stats["replays"] == 0
    assert any(reason in k for k in stats["calls"]), stats


def _count_steps(mixer, grow: bool = False):
    """Give `mixer` state of its own, assigned anew each step (as RecurrentGemma's blocks do): a step counter, or
    with `grow` a record that gets one element longer each step."""
    mixer.step_count = torch.zeros(1)
    original = mixer.forward

    def counting(*args, **kwargs):
        mixer.step_count = torch.cat([mixer.step_count, mixer.step_count[-1:] + 1]) if grow else mixer.step_count + 1
        return original(*args, **kwargs)

    mixer.forward = counting


def test_state_kept_on_a_module_is_adopted(prompt):
    """A module that assigns a new tensor attribute per step keeps state outside the cache: the graph takes it
    into a buffer of its own and ends each replayed step by copying the module's new value there. Generation and
    the module's state end as in eager runs (the capture's extra steps are undone)."""
    model = tiny("mamba")
    mixer = model.backbone.layers[0].mixer
    _count_steps(mixer)
    ref = generate(model, prompt)
    eager_count = mixer.step_count.item()
    mixer.step_count = torch.zeros(1)
    graphs = enable_decode_graphs(model, backend="emulate")
    try:
        _same_generation(generate(model, prompt), ref)
        assert mixer.step_count.item() == eager_count == NEW_TOKENS  # prefill + every decode step, counted once
        mixer.step_count = torch.zeros(1)  # a new run resets it, as a prefill would: bound again, not recaptured
        _same_generation(generate(model, prompt), ref)
        assert mixer.step_count.item() == eager_count
        stats = graphs.stats()
    finally:
        disable_decode_graphs(model)
    assert stats["graphs"] == 1 and stats["replays"] == 2 * (NEW_TOKENS - 1) - 1, stats
    assert stats["calls"]["bound a cache"] == 1, stats


def test_module_state_cleared_between_runs_runs_eagerly(prompt):
    """A module's adopted state set to None (RecurrentGemma's blocks do so on a call without a cache) is not a
    buffer to copy from: that call runs eagerly and says why, and the module makes its state anew."""
    model = tiny("mamba")
    mixer = model.backbone.layers[0].mixer
    _count_steps(mixer)
    graphs = enable_decode_graphs(model, backend="emulate")
    try:
        generate(model, prompt)  # captures: step_count adopted
        assert graphs.stats()["graphs"] == 1
        mixer.step_count = None
        original = mixer.forward

        def revive(*args, **kwargs):
            if mixer.step_count is None:
                mixer.step_count = torch.zeros(1)
            return original(*args, **kwargs)

        mixer.forward = revive
        # prefill revives it (a new tensor, bound as usual); cleared again right before a decode step: eager
        seen = {"n": 0}
        forward = model.forward

        @functools.wraps(forward)  # generate reads the signature: the same one as the graphs' (the original's)
        def clear_before_decode(**kw):
            if kw["input_ids"].shape[1] == 1 and seen["n"] == 0:
                seen["n"] += 1
                mixer.step_count = None
            return forward(**kw)

        model.__dict__["forward"] = clear_before_decode
        generate(model, prompt)
        stats = graphs.stats()
        model.__dict__["forward"] = forward
    finally:
        disable_decode_graphs(model)
    assert stats["calls"]["eager: module state MambaMixer.step_count missing or reshaped"] == 1, stats


def test_module_state_that_grows_is_refused(prompt):
    model = tiny("mamba")
    _count_steps(model.backbone.layers[0].mixer, grow=True)
    stats = _graphed_like_eager(model, prompt)
    assert stats["graphs"] == 0 and any("changes shape" in r for r in stats["refused"]), stats


def test_a_replay_that_differs_is_refused_and_the_step_stays_eager(prompt, monkeypatch):
    model = tiny("mamba")

    replay = _EmulatedBackend.replay

    def corrupt(graph, fn, out):
        replay(graph, fn, out)
        out.logits.add_(1.0)

    monkeypatch.setattr(_EmulatedBackend, "replay", staticmethod(corrupt))
    stats = _graphed_like_eager(model, prompt)
    assert stats["graphs"] == 0 and any("replay differs from the eager step" in r for r in stats["refused"]), stats


def test_capture_failure_is_refused(prompt, monkeypatch):
    model = tiny("mamba")

    def fail(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(_EmulatedBackend, "record", fail)
    assert any("capture failed: RuntimeError" in r for r in _graphed_like_eager(model, prompt)["refused"])


def test_cuda_backend_needs_cuda_and_bad_backend_is_one_error():
    model = tiny("mamba")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="need a CUDA device"):
            enable_decode_graphs(model)
    with pytest.raises(ValueError, match="backend: expected"):
        enable_decode_graphs(model, backend="tpu")
    assert decode_graphs_of(model) is None


def test_apply_decode_graphs_on_cpu(tmp_path):
    model = tiny("mamba")
    bundle = stateful_bundle(class_path(model, "MambaMixer"), MAMBA_TRITON)
    with pytest.raises(PatchError, match="decode_graphs: skipped: the model is on cpu"):
        kernels_runtime.apply(model, bundle, decode_graphs=True)
    kernels_runtime.revert(model)
    bundle.decode_graphs = True
    back = load_bundle(save_bundle(bundle, tmp_path / "b"))
    assert back.decode_graphs is True
    assert PatchBundle.model_validate({"patches": []}).decode_graphs is False  # older manifests: off
    report = kernels_runtime.apply(model, back)
    try:
        assert report.decode_graphs.startswith("skipped: the model is on cpu")
        assert "decode graphs skipped" in str(report)
        assert decode_graphs_of(model) is None
    finally:
        kernels_runtime.revert(model)


def test_a_bundle_of_graphs_alone(tmp_path, monkeypatch):
    """Acceptance keeps graphs with no kernel patch (Llama, Qwen3 under the static cache): the bundle has no
    patches, saves, loads and applies: the graphs and the static cache, nothing else."""
    model = tiny("llama")
    back = load_bundle(save_bundle(PatchBundle(name="graphs", decode_graphs=True, static_cache=True), tmp_path / "g"))
    assert back.patches == [] and back.decode_graphs and back.static_cache
    report = kernels_runtime.apply(model, back)  # on the CPU the graphs say why they are skipped
    assert report.decode_graphs.startswith("skipped") and report.applied == []
    assert kernels_runtime.revert(model) == 0
    import kernels_runtime.patch as patch_mod

    monkeypatch.setattr(patch_mod, "_enable_graphs", lambda m, explicit, static_cache=False, buckets=():
                        f"on{' (static KV cache)' if static_cache else ''}")
    assert kernels_runtime.apply(model, back).decode_graphs == "on (static KV cache)"
    kernels_runtime.revert(model)


def test_decode_graphs_are_gated_like_a_patch():
    """decide_graphs: logits first, then the end-to-end gain against delta; each outcome names its numbers."""
    from llm4llm.accept import GRAPHS_TASK, LogitsCheck, decide_graphs
    from llm4llm.config import AcceptSettings

    cfg = AcceptSettings(delta=0.02)
    ok = LogitsCheck(True, 0.01, "rel-L2 0.01 vs floor 0.02 x 2", "logits_rel_l2_floor", summary="rel-L2 0.01")
    bad = LogitsCheck(False, 0.9, "rel-L2 0.9 vs floor 0.02 x 2", "logits_rel_l2_floor", summary="rel-L2 0.9")
    d = decide_graphs(ok, 2000.0, 500.0, "1 captured, 251 replays", cfg, static_cache=True)
    assert (d.task_id, d.candidate_id, d.decision) == (GRAPHS_TASK, "cuda-graphs+static-cache", "accepted")
    assert d.gain == pytest.approx(0.75) and "2000.0 ms without, 500.0 ms with (1 captured" in d.reason
    d = decide_graphs(ok, 2000.0, 1990.0, "0 captured, 0 replays", cfg)
    assert d.decision == "rejected" and "below delta 2%" in d.reason and d.candidate_id == "cuda-graphs"
    d = decide_graphs(bad, 2000.0, 500.0, "1 captured, 251 replays", cfg)
    assert d.decision == "rejected" and d.reason.startswith("in-model correctness with graphs: rel-L2 0.9")
    d = decide_graphs(None, 2000.0, None, "runtime: RuntimeError: CUDA error", cfg)
    assert d.decision == "rejected" and d.reason == "runtime: RuntimeError: CUDA error"


def test_a_state_tensor_replaced_by_the_caller_is_rebound(prompt):
    """The fast path trusts the last binding only while every state tensor is still the graph's buffer: a caller that
    swaps one in (as reorder_cache does) gets its values copied in, and the steps stay exact."""
    model = tiny("mamba")
    ids = [prompt[:, i:i + 1] for i in range(prompt.shape[1])]

    def run(graphed: bool):
        if graphed:
            enable_decode_graphs(model, backend="emulate")
        try:
            with torch.inference_mode():
                cache = model(input_ids=prompt, use_cache=True).cache_params
                logits = []
                for i, x in enumerate(ids):
                    if i == 3:
                        layer = cache.layers[1]
                        layer.recurrent_states[0] = layer.recurrent_states[0].clone() * 0.5
                    logits.append(model(input_ids=x, cache_params=cache, use_cache=True).logits)
                return logits, decode_graphs_of(model)
        finally:
            if graphed:
                stats = decode_graphs_of(model).stats()
                disable_decode_graphs(model)
                assert stats["calls"]["bound a cache"] == 1 and stats["replays"] == len(ids) - 1, stats

    want, _ = run(False)
    got, _ = run(True)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, name=f"step {step}")


# ------------------------------------------------------------------------------------------- the run's graph choice


def _index(tmp_path, adapters):
    import json

    tasks = [{"task_id": f"t{i}", "recipe": {"state": {"adapter": a}} if a else {}} for i, a in enumerate(adapters)]
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(tasks))
    return str(path)


@pytest.mark.parametrize("adapters, device, requested, on, static, why", [
    (["LinearAttentionLayer", None], "cuda", "auto", True, False,
     "on (auto): decode state only in ['LinearAttentionLayer']"),
    (["DynamicLayer", None], "cuda", "auto", True, True, "generate with the static KV cache"),
    (["DynamicSlidingWindowLayer", "RecurrentGemmaRecurrentBlock"], "cuda", "auto", True, True,
     "generate with the static KV cache"),
    (["LinearAttentionLayer", "RecurrentGemmaRecurrentBlock"], "cuda", "auto", True, False,
     "on (auto): decode state only in ['LinearAttentionLayer', 'RecurrentGemmaRecurrentBlock']"),
    (["OffloadedLayer", "DynamicLayer"], "cuda", "auto", False, False, "decode state in ['OffloadedLayer']"),
    ([None], "cuda", "auto", False, False, "no extracted module keeps decode state"),
    (["RecurrentGemmaRecurrentBlock"], "cuda", "on", True, False, "on (asked for)"),
    (["LinearAttentionLayer"], "cuda", False, False, False, "off"),
    (["LinearAttentionLayer"], "cpu", "auto", False, False, "CUDA graphs need a CUDA device"),
    (["LinearAttentionLayer"], "cpu", True, False, False, "CUDA graphs need a CUDA device"),
])
def test_decode_graphs_plan(tmp_path, adapters, device, requested, on, static, why):
    from llm4llm.graph_plan import decode_graphs_plan

    got, got_static, reason = decode_graphs_plan(_index(tmp_path, adapters), device, requested)
    assert got is on and got_static is static and why in reason, reason


@pytest.mark.parametrize("adapters, graphed", [
    (["LinearAttentionLayer", None], True),  # Mamba, Mamba2: the prompt forward is graphed too
    (["LinearAttentionLayer", "DynamicLayer"], False),  # a hybrid's KV layers: prefill graphs refuse the cache
    (["LinearAttentionLayer", "RecurrentGemmaRecurrentBlock"], False),  # state on modules: refused too
    (["DynamicLayer"], False), ([None], False), ([], False),
])
def test_prefill_graphed(tmp_path, adapters, graphed):
    """Prefill candidates are timed under graph replay only where kernels_runtime graphs the prompt forward: every
    task that keeps state keeps it in a PREFILL_LAYERS cache layer."""
    from llm4llm.graph_plan import prefill_graphed

    assert prefill_graphed(_index(tmp_path, adapters)) is graphed


def test_decode_graphs_choice_is_one_error(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app
    from llm4llm.graph_plan import decode_graphs_plan

    with pytest.raises(ValueError, match="decode_graphs: expected one of"):
        decode_graphs_plan(_index(tmp_path, []), "cuda", "sometimes")
    wl = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / "workloads" / "tiny-mamba.toml")
    res = CliRunner().invoke(app, ["optimize", wl, "--db", str(tmp_path / "db.duckdb"), "--decode-graphs", "maybe"])
    assert res.exit_code == 2 and "--decode-graphs: expected one of auto, on, off" in res.output, res.output
    res = CliRunner().invoke(app, ["optimize", wl, "--db", str(tmp_path / "db.duckdb"), "--e2e-variants",
                                   "eager,warp_speed"])
    assert res.exit_code == 2 and "--e2e-variants: expected names from" in res.output, res.output
    assert not (tmp_path / "db.duckdb").exists()  # nothing ran


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["mamba", "mamba2"])
def test_real_cuda_graphs_match_eager(prompt, model_type):
    """On a GPU: the real backend (torch.cuda.CUDAGraph) replays decode steps and generation matches eager."""
    model = tiny(model_type).cuda()
    ids = prompt.cuda()
    other = torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(9)).cuda()
    ref, ref_other = generate(model, ids), generate(model, other)
    enable_decode_graphs(model)
    try:
        _same_generation(generate(model, ids), ref)
        _same_generation(generate(model, ids), ref)  # its prefill captured
        _same_generation(generate(model, ids), ref)  # replayed
        kept = generate(model, ids)
        _same_generation(generate(model, other), ref_other)  # the same prefill graph, other values
        assert_same_state(snapshot(kept.past_key_values), snapshot(ref.past_key_values))
    finally:
        stats = disable_decode_graphs(model)  # the stats before the graphs are freed
    assert stats["graphs"] == 1 and stats["refused"] == [] and stats["replays"] == 5 * (NEW_TOKENS - 1) - 1, stats
    assert stats["prefill_graphs"] == 1 and stats["prefill_replays"] == 3, stats


@pytest.mark.gpu
@pytest.mark.parametrize("model_type, dtype", [("llama", torch.float32), ("qwen3", torch.float32),
                                               ("recurrent_gemma", torch.float32), ("llama", torch.bfloat16),
                                               ("qwen3", torch.bfloat16), ("recurrent_gemma", torch.bfloat16)])
def test_real_cuda_graphs_under_the_static_cache(prompt, model_type, dtype):
    """On a GPU: KV-cache models (and RecurrentGemma's module-held state, sliding-window counter and host-counted
    positions) replay under the static cache with a real graph, and the teacher-forced logits match eager (bf16:
    within the acceptance metric's fixed rel-L2 limit; the capture check's rel-L2 passes show in stats notes)."""
    from llm4llm.accept import teacher_forced_logits
    from kernels_runtime.tolerances import rel_l2

    kw = {"attention_window_size": 64} if model_type == "recurrent_gemma" else {}
    model = tiny(model_type, **kw).to("cuda", dtype)
    batch = {"input_ids": prompt.cuda(), "attention_mask": torch.ones_like(prompt).cuda()}
    steps = 8
    model.generation_config.cache_implementation, model.generation_config.disable_compile = "static", True
    with torch.inference_mode():
        tokens = model.generate(**batch, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                pad_token_id=0)[:, prompt.shape[1]:]
    ref = teacher_forced_logits(model, batch, tokens, steps)
    enable_decode_graphs(model, static_cache=True)
    try:
        got = teacher_forced_logits(model, batch, tokens, steps)
        again = teacher_forced_logits(model, batch, tokens, steps)
    finally:
        stats = disable_decode_graphs(model)
    assert stats["graphs"] == 1 and stats["refused"] == [], stats
    assert stats["replays"] == 2 * (steps - 1) - 1, stats
    limit = 1e-4 if dtype == torch.float32 else 0.03
    for run in (got, again):
        worst = max(rel_l2(g, r) for g, r in zip(run, ref))
        assert worst <= limit, (worst, stats.get("notes"))


def test_a_host_value_frozen_at_capture_is_refused(prompt):
    """A step that uses a value counted on the host (a Python int, here one the capture's own runs advanced) replays
    it as it was at capture: the replay differs from the eager step and the signature is refused. The emulating
    backend replays the captured ATen ops with their Python arguments as recorded, so the value freezes here as in a
    CUDA graph. (A value restored with the state, which only the second replay shows: RecurrentGemma's positions,
    test_recurrent_gemma_without_host_counted_positions_is_refused.)"""
    model = tiny("mamba")
    mixer = model.backbone.layers[0].mixer
    original, seen = mixer.forward, {"n": 0}

    def counting(*args, **kwargs):
        seen["n"] += 1
        return original(*args, **kwargs) + 1e-2 * seen["n"]

    mixer.forward = counting
    graphs = enable_decode_graphs(model, backend="emulate")
    try:
        generate(model, prompt)
        stats = graphs.stats()
    finally:
        disable_decode_graphs(model)
    assert stats["graphs"] == 0 and any("replay differs from the eager step: output 0" in r
                                        for r in stats["refused"]), stats


def test_a_second_replay_that_differs_is_refused(prompt, monkeypatch):
    """The second replay's own check, reported as such (a replay made to go wrong only the second time)."""
    model = tiny("mamba")
    replay, calls = _EmulatedBackend.replay, {"n": 0}

    def second_differs(graph, fn, out):
        replay(graph, fn, out)
        calls["n"] += 1
        if calls["n"] == 2:
            out.logits.add_(1.0)

    monkeypatch.setattr(_EmulatedBackend, "replay", staticmethod(second_differs))
    stats = _graphed_like_eager(model, prompt)
    assert stats["graphs"] == 0 and any("second step's output" in r for r in stats["refused"]), stats


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_static_kv_cache_replays(prompt, model_type):
    """transformers' StaticCache (generate(cache_implementation="static"), its auto-compile off) keeps keys, values
    and the write position at static addresses: Llama's and Qwen3's decode steps replay and generation matches
    eager. With an attention mask, as the workload script passes one: Qwen3 gets it as a dict per layer type (on
    the H200 every Qwen3 step ran eagerly while the wrapper took only plain tensors)."""
    from transformers import LogitsProcessorList

    model = tiny(model_type)

    def run():
        with torch.inference_mode():
            return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                                  do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, logits_processor=LogitsProcessorList([]),
                                  pad_token_id=0, cache_implementation="static", disable_compile=True)

    stats = _graphed_like_eager(model, prompt, run, times=2)
    assert stats["graphs"] == 1 and stats["refused"] == [] and stats["replays"] == 2 * (NEW_TOKENS - 1) - 1, stats


def _hide_positions(monkeypatch):
    """A caller that passes no position_ids: generate passes them only when forward's signature shows them, and the
    wrapper shows the original's, so hide it."""
    from kernels_runtime.graphs import DecodeGraphs

    monkeypatch.setattr(DecodeGraphs, "__signature__", property(lambda self: _inspect.signature(lambda *a, **k: 0)))


@pytest.mark.parametrize("given", [True, False], ids=["positions given", "positions counted"])
def test_recurrent_gemma_replays_under_the_static_cache(prompt, monkeypatch, given):
    """RecurrentGemma under the static cache: recurrent blocks keep their state on themselves (adopted), attention
    layers use StaticSlidingWindowLayer, whose Python counter the wrapper advances after each replay. Positions are
    generate's position_ids, or, from a caller that passes none, that counter's (passed in as position_ids). Once
    the window is full the layer rolls on a host branch: those steps run eagerly. Generation matches eager
    throughout."""
    if not given:
        _hide_positions(monkeypatch)
    model = tiny("recurrent_gemma", attention_window_size=8)
    long = dict(max_new_tokens=6)  # prompt 6 + 6 > window 8: the last steps meet a full window

    def run():
        with torch.inference_mode():
            return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=0, cache_implementation="static",
                                  disable_compile=True, **long)

    def inspect(graphs):
        entry = next(iter(graphs.entries.values()))
        assert [s.attr for s in entry.module_slots] == ["conv1d_state", "recurrent_states"] * 2  # 2 recurrent blocks
        assert entry.positions is not given and "position_ids" in entry.static_inputs

    stats = _graphed_like_eager(model, prompt, run, times=2, inspect=inspect)
    assert stats["graphs"] == 1 and stats["refused"] == [], stats
    # decode steps per run: 5, at cache lengths 6..10; lengths 6 and 7 fit the window of 8 (the first captures)
    assert stats["replays"] == 3, stats
    assert stats["calls"]["eager: sliding-window cache full (it rolls its window on a host-side branch)"] == 6, stats


def test_recurrent_gemma_without_host_counted_positions_is_refused(prompt, monkeypatch):
    """What the position_ids hand-off is for: RecurrentGemma derives positions from the sliding-window layer's Python
    counter, which a replay freezes; from a caller that passes no position_ids, without them passed in, the second
    replay differs and the step stays eager."""
    from kernels_runtime.graphs import DecodeGraphs

    _hide_positions(monkeypatch)
    monkeypatch.setattr(DecodeGraphs, "pass_positions", False)
    model = tiny("recurrent_gemma", attention_window_size=8)
    graphs = enable_decode_graphs(model, backend="emulate")
    try:
        with torch.inference_mode():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                           pad_token_id=0, cache_implementation="static", disable_compile=True)
        stats = graphs.stats()
    finally:
        disable_decode_graphs(model)
    assert stats["graphs"] == 0 and any("second step's output" in r for r in stats["refused"]), stats


def test_disable_puts_back_a_forward_the_caller_had_installed():
    model = tiny("mamba")
    mine = model.forward
    model.forward = mine  # an instance attribute, as another wrapper (or kernels_runtime) would leave it
    enable_decode_graphs(model, backend="emulate")
    assert model.forward is not mine
    disable_decode_graphs(model)
    assert model.__dict__["forward"] is mine


def test_static_cache_option_sets_and_restores_generation_config(prompt):
    """enable_decode_graphs(static_cache=True): a plain generate on a KV-cache model gets the static cache (and no
    auto-compile) and its decode steps replay; disable puts generation_config back."""
    model = tiny("llama")
    ref = generate(model, prompt)
    before = (model.generation_config.cache_implementation, getattr(model.generation_config, "disable_compile", None))
    graphs = enable_decode_graphs(model, backend="emulate", static_cache=True)
    try:
        assert model.generation_config.cache_implementation == "static"
        out = generate(model, prompt)
        _same_generation(out, ref)
        assert type(out.past_key_values).__name__ == "StaticCache"
        stats = graphs.stats()
    finally:
        disable_decode_graphs(model)
    assert stats["graphs"] == 1 and stats["replays"] == NEW_TOKENS - 2, stats
    assert (model.generation_config.cache_implementation,
            getattr(model.generation_config, "disable_compile", None)) == before


def test_evaluate_rejects_an_unknown_variant_before_building_anything(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app
    from llm4llm.evaluate import evaluate_workload

    wl = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / "workloads" / "tiny-mamba.toml")
    res = CliRunner().invoke(app, ["evaluate", wl, "--db", str(tmp_path / "db.duckdb"), "--variants", "eager,bogus"])
    assert res.exit_code == 2 and "--variants: expected names from" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "db.duckdb").exists()
    with pytest.raises(ValueError, match=r"got \['bogus'\]"):
        evaluate_workload(wl, variants=("eager", "bogus"))


def test_summary_line_says_what_was_refused(prompt):
    model = tiny("llama")
    graphs = enable_decode_graphs(model, backend="emulate")
    try:
        generate(model, prompt)
        assert graphs.summary() == "0 captured, 0 replays"  # a growing cache is not a refusal: it never qualifies
    finally:
        disable_decode_graphs(model)
    model = tiny("mamba")
    graphs = enable_decode_graphs(model, backend="emulate")
    try:
        generate(model, prompt)
        assert graphs.summary() == f"1 captured, {NEW_TOKENS - 2} replays"
    finally:
        disable_decode_graphs(model)


def test_replay_check_allows_rounding_not_misplaced_writes():
    """Replay-vs-eager check (REL_L2_BOUND): 16-bit logits a few ulps off somewhere (Qwen3-4B's second step on the
    H200) pass by relative L2 and say so; a real difference does not. State is judged by what the step wrote: a
    KV row off by rounding passes, the same row written one position over fails, integers must match exactly."""
    from kernels_runtime.graphs import _mismatch
    from kernels_runtime.tolerances import rel_l2

    gen = torch.Generator().manual_seed(0)
    want = (torch.randn(4096, generator=gen) * 2).to(torch.bfloat16)
    got = want.clone()
    small = want.float().abs().argsort()[:3]  # where |x| is small, 0.04 is outside atol + rtol * |x|
    got[small] += 0.04
    notes = []
    assert _mismatch([got], [want], "output", notes) == "" and "rel-L2" in notes[0]
    off = (want.float() * 1.2).to(torch.bfloat16)
    assert "rel-L2 2.00e-01 over 0.05" in _mismatch([off], [want], "output", [])

    # a static KV cache of 2048 slots, 2000 filled: one misplaced row is rel-L2 0.04 of the whole cache (it would
    # pass against the whole), and 1.7 of what the step wrote
    before = torch.zeros(1, 2, 2048, 16, dtype=torch.bfloat16)
    before[:, :, :2000] = torch.randn(1, 2, 2000, 16, generator=gen).to(torch.bfloat16)
    row = torch.randn(1, 2, 16, generator=gen).to(torch.bfloat16)
    want = before.clone()
    want[:, :, 2000] = row
    rounded = want.clone()
    rounded[0, 0, 2000, rounded[0, 0, 2000].float().abs().argmin()] += 0.03  # one element off, as Llama's K row was
    notes = []
    assert _mismatch([rounded], [want], "state", notes, base=[before]) == "" and "step's change" in notes[0]
    misplaced = before.clone()
    misplaced[:, :, 1999] = row  # the new row over the last one: a frozen write position
    assert rel_l2(misplaced, want) < 0.05  # against the whole cache it would pass
    assert "over 0.05" in _mismatch([misplaced], [want], "state", [], base=[before])
    assert _mismatch([torch.tensor([3])], [torch.tensor([4])], "state", [], base=[torch.tensor([2])]) == \
        "state 0: values differ"


# ------------------------------------------------------------------------------------------------ prefill graphs
def _prefill(model, prompt):
    """One generate of a single token: the prompt's forward alone, on the fresh cache generate makes."""
    with torch.inference_mode():
        return model.generate(prompt, max_new_tokens=1, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)


@pytest.mark.parametrize("model_type", ["mamba", "mamba2"])
def test_prefill_replays_from_its_second_call(prompt, model_type):
    """A prompt's forward on a fresh Mamba / Mamba2 cache: eager on the first call of its signature, captured on the
    second, replayed from the third, with that prompt's logits and state each time (another prompt of the same
    length replays the same graph with its own values; another length is another signature)."""
    model = tiny(model_type)
    other = torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(9))
    longer = torch.randint(1, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    refs = {name: generate(model, p) for name, p in (("prompt", prompt), ("other", other), ("longer", longer))}
    graphs = enable_decode_graphs(model, backend="emulate")
    try:
        for name, p in (("prompt", prompt), ("prompt", prompt), ("prompt", prompt), ("other", other),
                        ("longer", longer)):
            out = generate(model, p)
            _same_generation(out, refs[name])
            assert_same_state(snapshot(out.past_key_values), snapshot(refs[name].past_key_values))
        stats, summary = graphs.stats(), graphs.summary()
    finally:
        disable_decode_graphs(model)
    calls = stats["calls"]
    assert stats["prefill_graphs"] == 1 and stats["prefill_replays"] == 2, stats  # the third prompt, then other
    assert calls["eager: prefill signature seen once (captured on its second call)"] == 2, calls  # prompt, longer
    assert calls["captured a prefill"] == 1 and "prefill: 1 captured, 2 replays" in summary


def test_a_cache_kept_from_a_replayed_prefill_keeps_its_state(prompt):
    """A replay hands the caller's cache the graph's state tensors; the next replay gives a cache still holding
    them its own copies first, and disabling the graphs does the same."""
    model = tiny("mamba")
    other = torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(9))
    want, want_other = (snapshot(_prefill(model, p).past_key_values) for p in (prompt, other))
    graphs = enable_decode_graphs(model, backend="emulate")
    try:
        _prefill(model, prompt), _prefill(model, prompt)  # seen, captured
        kept = _prefill(model, prompt).past_key_values  # replayed: holds the graph's tensors
        assert graphs.stats()["prefill_replays"] == 1
        assert_same_state(snapshot(kept), want)
        last = _prefill(model, other).past_key_values  # the same graph again, other values
        assert_same_state(snapshot(kept), want)
        assert_same_state(snapshot(last), want_other)
    finally:
        disable_decode_graphs(model)
    _prefill(model, prompt)  # the graphs are gone; the last cache kept its own copies
    assert_same_state(snapshot(last), want_other)


@pytest.mark.parametrize("model_type, reason", [
    ("llama", "eager: prefill: cache layer DynamicLayer (prefill graphs: LinearAttentionLayer)"),
    ("recurrent_gemma", "eager: prefill: cache layer DynamicSlidingWindowLayer (prefill graphs: LinearAttentionLayer)"),
])
def test_prefill_of_other_caches_runs_eagerly_and_says_why(prompt, model_type, reason):
    stats = _graphed_like_eager(tiny(model_type), prompt, times=2)
    assert stats["calls"][reason] == 2 and stats["prefill_graphs"] == 0, stats


def test_prefill_that_changes_module_state_is_refused(prompt):
    """State a module assigns in the prompt's forward would not be assigned by a replay: refused, eager."""
    model = tiny("mamba")
    _count_steps(model.backbone.layers[0].mixer)
    stats = _graphed_like_eager(model, prompt, times=3)
    assert stats["prefill_graphs"] == 0 and any(
        r == "prefill changes state kept on modules: MambaMixer.step_count" for r in stats["refused"]), stats


def test_a_prefill_replay_that_differs_is_refused(prompt, monkeypatch):
    model = tiny("mamba")
    replay = _EmulatedBackend.replay

    def corrupt_prefill_state(graph, fn, out):
        replay(graph, fn, out)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list):  # a prefill graph's outputs
            out[1][0].add_(1.0)

    monkeypatch.setattr(_EmulatedBackend, "replay", staticmethod(corrupt_prefill_state))
    stats = _graphed_like_eager(model, prompt, times=3)
    assert stats["prefill_graphs"] == 0 and any(
        r.startswith("prefill replay differs from the eager prefill: prefill state") for r in stats["refused"]), stats
    assert stats["graphs"] == 1  # the decode steps are graphed as before


def test_prefill_graphs_can_be_left_off(prompt):
    stats = _graphed_like_eager(tiny("mamba"), prompt, times=3, prefill=False)
    assert stats["prefill_graphs"] == 0 and not any("prefill" in k for k in stats["calls"]), stats


def test_patched_prefill_replays_its_kernels(prompt):
    """The prompt's forward through patched Triton kernels (the re-running stand-in: Triton under the interpreter is
    not ATen ops) replays with the prompt's own values."""
    model = tiny("mamba2")
    other = torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(9))
    refs = [generate(model, p) for p in (prompt, other)]
    kernels_runtime.apply(model, stateful_bundle(class_path(model, "Mamba2Mixer"), MAMBA2_TRITON), strict=True)
    graphs = enable_decode_graphs(model, backend="rerun")
    try:
        for p, ref in ((prompt, refs[0]), (prompt, refs[0]), (prompt, refs[0]), (other, refs[1])):
            _same_generation(generate(model, p), ref)
        stats = graphs.stats()
    finally:
        disable_decode_graphs(model)
        kernels_runtime.revert(model)
    assert stats["prefill_graphs"] == 1 and stats["prefill_replays"] == 2 and not stats["refused"], stats
