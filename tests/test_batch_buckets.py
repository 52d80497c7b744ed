"""Decode batch buckets (kernels_runtime.buckets): the buckets a regime verifies, a batch padded to the next one and
handed back unpadded, the guard that admits verified buckets only, and, in a tiny Qwen3 with a decode kernel over a
regime of batches 1..4, a batch of 3 run at bucket 4 through the kernel with the unpatched logits, and a batch past
the buckets (or unpadded) run by the original forwards and counted."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kernels_runtime.buckets import (BucketedGenerate, bucket_for, buckets_within, disable_batch_buckets,
                                     enable_batch_buckets, pad_batch, unpad)
from kernels_runtime.bundle import Guard
from kernels_runtime.guards import is_supported
from llm4llm.regime import Regime

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_buckets_within_a_regime_and_the_bucket_of_a_batch():
    assert buckets_within(1, 32) == (1, 2, 4, 8, 16, 32)
    assert buckets_within(1, 24) == (1, 2, 4, 8, 16, 24)  # the regime's max is the last bucket
    assert buckets_within(3, 5) == (4, 5)
    assert bucket_for(3, buckets_within(1, 32)) == 4 and bucket_for(32, (1, 2, 4, 8, 16, 32)) == 32
    assert bucket_for(33, (1, 2, 4, 8, 16, 32)) is None and bucket_for(0, (1, 2)) is None
    with pytest.raises(ValueError, match=r"expected 1 <= lo <= hi, got 4\.\.2"):
        buckets_within(4, 2)
    span = Regime(batch_sizes={"min": 1, "max": 8}, prompt_lens=[16, 64])
    assert span.batch_buckets() == (1, 2, 4, 8)
    # the corners first, then every bucket no corner runs, at the shortest prompt
    assert span.points(4) == [(1, 16, 4), (1, 64, 4), (8, 16, 4), (8, 64, 4), (2, 16, 4), (4, 16, 4)]
    listed = Regime(batch_sizes=[1, 3, 6], prompt_lens=[16])
    assert listed.batch_buckets() == (1, 3, 6) and [b for b, _, _ in listed.points(4)] == [1, 6, 3]


def test_pad_batch_repeats_the_last_sequence_and_unpad_returns_the_real_rows():
    ids = torch.arange(6).view(3, 2)
    padded = pad_batch({"input_ids": ids, "attention_mask": torch.ones(3, 2), "max_new_tokens": 4}, 3, 4)
    assert padded["input_ids"].tolist() == [[0, 1], [2, 3], [4, 5], [4, 5]] and padded["max_new_tokens"] == 4
    assert padded["attention_mask"].shape == (4, 2)
    out = {"sequences": torch.arange(8).view(4, 2), "logits": (torch.zeros(4, 5), torch.ones(4, 5))}
    back = unpad(out, 3, 4)
    assert back["sequences"].shape == (3, 2) and [t.shape for t in back["logits"]] == [(3, 5), (3, 5)]


class _FakeModel(torch.nn.Module):
    """generate: each row's ids plus its row sum (a row depends on its own row only, as in a decoder)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def generate(self, input_ids, attention_mask=None, **kw):
        self.seen.append(tuple(input_ids.shape))
        return torch.cat([input_ids, input_ids.sum(1, keepdim=True)], dim=1)


def test_generate_pads_to_the_bucket_and_counts_a_batch_past_the_buckets():
    model = _FakeModel()
    want = model.generate(torch.arange(9).view(3, 3))
    wrapper = enable_batch_buckets(model, [4, 1, 2])
    assert isinstance(model.generate, BucketedGenerate) and wrapper.buckets == (1, 2, 4)
    assert enable_batch_buckets(model, (1, 2, 4)) is wrapper  # idempotent
    got = model.generate(torch.arange(9).view(3, 3), attention_mask=torch.ones(3, 3))
    assert torch.equal(got, want) and model.seen[-1] == (4, 3)
    model.generate(input_ids=torch.zeros(2, 3, dtype=torch.long))
    model.generate(torch.zeros(5, 3, dtype=torch.long))
    assert model.seen[-2:] == [(2, 3), (5, 3)]  # a bucket as it is; past the largest, as it came
    assert wrapper.counts == {"padded 3 -> 4": 1, "bucket 2": 1,
                              "batch: expected at most 4 (verified buckets [1, 2, 4]), got 5": 1}
    assert disable_batch_buckets(model) == dict(wrapper.counts) and "generate" not in model.__dict__


def _call(batch: int):
    t = SimpleNamespace(shape=(batch, 1, 8), dtype=torch.float32, device=torch.device("cpu"),
                        is_floating_point=lambda: True, is_contiguous=lambda: True)
    return {"hidden_states": t}


def test_the_guard_admits_verified_buckets_only():
    guard = Guard(shapes={"hidden_states": [[1, 8], 1, 8]}, batch_buckets=[1, 2, 4, 8])
    assert is_supported(guard, _call(4)) == (True, "")
    assert is_supported(guard, _call(3)) == (False, "batch: expected one of the verified buckets [1, 2, 4, 8], got "
                                                    "3 (pad to 4)")
    assert is_supported(Guard(), _call(3)) == (True, "")


def test_guard_for_a_regime_decode_task_holds_its_captured_batches():
    from llm4llm.patchspec import guard_for
    from llm4llm.taskspec import CaseSig, TaskSpec, TensorSig

    cases = [CaseSig(inputs={"hidden_states": TensorSig(shape=[b, 1, 8], dtype="float32")}) for b in (1, 4, 2, 4)]
    spec = TaskSpec(family="mlp", module_class="x.MLP", instances=["m"], phase="decode",
                    input_names=["hidden_states"], weight_names=[], output_names=["out"], cases=cases, dtype="float32",
                    regime=True)
    assert guard_for(spec, "cpu").batch_buckets == [1, 2, 4]
    assert guard_for(spec.model_copy(update={"regime": False}), "cpu").batch_buckets == []
    assert guard_for(spec.model_copy(update={"phase": "prefill"}), "cpu").batch_buckets == []


@pytest.fixture(scope="module")
def bucket_workload(tmp_path_factory):
    """A tiny-qwen3 workload over a regime of batches 1..4 (buckets 1, 2, 4), and its extracted task dirs."""
    from llm4llm.stages.extract import run_extract
    from llm4llm.stages.profile import run_profile

    tmp = tmp_path_factory.mktemp("buckets")
    text = (EXAMPLES / "workloads" / "tiny-qwen3.toml").read_text()
    text = text.replace('"../scripts/hf_generate.py"', f'"{EXAMPLES / "scripts" / "hf_generate.py"}"')
    text = text.replace("prompt_len = 16", "prompt_len = 8").replace("decode_len = 4", "decode_len = 3")
    wl = tmp / "w.toml"
    wl.write_text(text + "\n[regime]\nbatch_sizes = {min = 1, max = 4}\nprompt_lens = [8]\n")
    data = tmp / "data"
    run_extract(str(wl), run_profile(str(wl), str(data)), str(data))
    return wl, sorted(d for d in (data / "tasks").iterdir() if (d / "spec.json").exists())


def test_a_batch_runs_at_its_bucket_through_the_kernel_and_outside_falls_back_counted(bucket_workload):
    import kernels_runtime
    from kernels_runtime.bundle import PatchBundle
    from kernels_runtime.patch import report_of
    from llm4llm.accept import teacher_forced_logits
    from llm4llm.patchspec import task_patch_spec
    from llm4llm.search.templates import TEMPLATES
    from llm4llm.taskspec import load_spec
    from llm4llm.workload import call_script, load_script, load_workload
    from kernels_runtime.tolerances import assert_close

    wpath, dirs = bucket_workload
    spec = load_spec(next(d for d in dirs if d.name.startswith("mlp-decode-")))
    tpl = next(t for t in TEMPLATES if t.name == "mlp.decode_gemv")
    patch = task_patch_spec(spec, "c", 1.0, "cpu")
    assert patch.guard.batch_buckets == [1, 2, 4]  # every bucket of the regime was captured
    bundle = PatchBundle(name="buckets", batch_buckets=[1, 2, 4])
    bundle.add_patch(patch, source=tpl.render(spec, tpl.default(spec)))

    wl = load_workload(wpath)
    script = load_script(wl)
    model = call_script(script.build, wl)
    three = call_script(script.inputs, wl.model_copy(update={"batch_size": 3}))
    tokens = torch.randint(0, 256, (3, wl.decode_len), generator=torch.Generator().manual_seed(1))
    ref = teacher_forced_logits(model, three, tokens, wl.decode_len)
    report = kernels_runtime.apply(model, bundle, strict=True)
    try:
        got = teacher_forced_logits(model, three, tokens, wl.decode_len)
        for step, (g, r) in enumerate(zip(got, ref)):
            assert g.shape == r.shape == (3, 256)
            assert_close(g, r, name=f"logits step {step}")
        counters = report_of(model)
        assert all(c["kernel"] == {"decode": wl.decode_len - 1} for c in counters.values()), counters
        assert not any(r.startswith("batch") for c in counters.values() for r in c["fallback"]), counters
        assert report.batch_buckets.counts == {"padded 3 -> 4": 1} and "batch buckets [1, 2, 4]" in str(report)

        five = call_script(script.inputs, wl.model_copy(update={"batch_size": 5}))
        call_script(script.run, model, wl, five)  # past the largest bucket: the original forwards, counted
        assert report.batch_buckets.counts["batch: expected at most 4 (verified buckets [1, 2, 4]), got 5"] == 1
        assert all(c["kernel"] == {"decode": wl.decode_len - 1} for c in report_of(model).values())
        disable_batch_buckets(model)  # unpadded, batch 3 is inside the shape box yet not a verified bucket
        call_script(script.run, model, wl, three)
        reasons = {r for c in report_of(model).values() for r in c["fallback"]}
        assert "batch: expected one of the verified buckets [1, 2, 4], got 3 (pad to 4)" in reasons, reasons
    finally:
        kernels_runtime.revert(model)


def test_decode_graphs_are_captured_per_bucket_and_a_batch_past_them_gets_its_own():
    """Emulated graphs (the CPU's stand-in for CUDA capture) on a tiny Llama on the static cache, generate padded to
    the buckets: a batch of 3 and a batch of 4 share bucket 4's one graph and generate what the eager model does; a
    batch of 5 (past the buckets: counted by generate's wrapper) replays a graph of its own, not eager steps (a bundle
    at batch 32 with buckets up to 8 once decoded at 0.92x eager while eager with graphs ran 1.25x)."""
    from kernels_runtime.graphs import OUTSIDE_GRAPHS, disable_decode_graphs, enable_decode_graphs
    from tests.test_runtime_stateful import tiny

    model = tiny("llama")
    prompts = {b: torch.randint(1, 256, (b, 5), generator=torch.Generator().manual_seed(b)) for b in (3, 4, 5)}

    def generate(b):
        with torch.inference_mode():
            return model.generate(prompts[b], attention_mask=torch.ones_like(prompts[b]), max_new_tokens=3,
                                  do_sample=False, pad_token_id=0, cache_implementation="static",
                                  disable_compile=True)

    want = {b: generate(b) for b in prompts}
    graphs = enable_decode_graphs(model, backend="emulate", static_cache=True, buckets=(1, 2, 4))
    wrapper = enable_batch_buckets(model, (1, 2, 4))
    try:
        for b in prompts:
            assert torch.equal(generate(b), want[b]), b
        stats = graphs.stats()
    finally:
        disable_batch_buckets(model)
        disable_decode_graphs(model)
    assert stats["graphs"] == 2 and stats["refused"] == [], stats
    assert [k for k in stats["calls"] if k.startswith("eager") and "prefill" not in k] == [], stats
    assert graphs.max_graphs >= 3 + OUTSIDE_GRAPHS
    assert wrapper.counts == {"padded 3 -> 4": 1, "bucket 4": 1,
                              "batch: expected at most 4 (verified buckets [1, 2, 4]), got 5": 1}


def test_a_bundle_slower_at_the_regimes_largest_batch_keeps_only_the_smaller_buckets():
    """Acceptance's second gain check (llm4llm.accept.regime_decision): from the interleaved totals at the regime's
    largest bucket, a bundle no slower than its model without kernels (within delta) ships as it is; one slower
    past delta keeps the buckets up to the workload's batch, in the bundle and in every patch guard that has
    buckets, so a batch of 32 falls back there; on the CPU (nothing timed) there is no check."""
    from kernels_runtime.bundle import PatchBundle, PatchSpec
    from llm4llm.accept import REGIME_TASK, _regime_gate, regime_decision

    bundle = PatchBundle(name="serving", batch_buckets=[1, 2, 4, 8, 16, 32])
    bundle.add_patch(PatchSpec(patch_id="layer", module_class="m.Layer", phase="decode", instances=["l.0"],
                               kernel="", guard=Guard(batch_buckets=[1, 2, 4, 8, 16, 32])))
    bundle.add_patch(PatchSpec(patch_id="norm", module_class="m.Norm", phase="prefill", instances=["n.0"], kernel=""))
    kept, same = regime_decision(bundle, 32, 8, [101.0, 99.0, 100.5], [100.0, 100.0, 100.0], 0.02)
    assert kept.task_id == REGIME_TASK and kept.decision == "accepted" and same is bundle
    slow, narrowed = regime_decision(bundle, 32, 8, [120.0, 118.0, 125.0], [100.0, 101.0, 99.0], 0.02)
    assert slow.decision == "rejected" and "batch 32" in slow.reason and slow.gain < -0.02
    assert narrowed.batch_buckets == [1, 2, 4, 8]
    assert narrowed.patches[0].guard.batch_buckets == [1, 2, 4, 8] and narrowed.patches[1].guard.batch_buckets == []
    assert bundle.batch_buckets[-1] == 32  # the accepted bundle itself is left as it was
    cpu = SimpleNamespace(on_gpu=False, wl=SimpleNamespace(regime=object(), batch_size=8))
    assert _regime_gate(cpu, bundle, object()) is None


def test_the_regime_check_decides_a_far_slower_bundle_on_its_warm_up_runs(monkeypatch, capsys):
    """At the regime's largest batch, a bundle whose warm-up runs are far slower than its model's without kernels
    (interleave raises SlowTrial) is decided on those runs, its fastest against the baseline's slowest: rejected
    past delta, the larger buckets dropped, the reason in the log. Scripted timings: the gate's arithmetic."""
    import kernels_runtime
    from kernels_runtime.bundle import PatchBundle, PatchSpec
    from llm4llm import accept as acc

    bundle = PatchBundle(name="serving", batch_buckets=[1, 2, 4, 8, 16, 32])
    bundle.add_patch(PatchSpec(patch_id="layer", module_class="m.Layer", phase="decode", instances=["l.0"],
                               kernel="", guard=Guard(batch_buckets=[1, 2, 4, 8, 16, 32])))
    for name in ("apply", "revert", "disable_decode_graphs"):
        monkeypatch.setattr(kernels_runtime, name, lambda *a, **k: None)

    def slow(*a, **k):
        raise acc.SlowTrial([40e3, 35e3], [900.0, 1100.0])

    monkeypatch.setattr(acc, "interleave", slow)
    wl = SimpleNamespace(regime=object(), batch_size=8, model_copy=lambda update: SimpleNamespace(**update))
    script = SimpleNamespace(inputs=lambda w: {}, run=None)
    r = SimpleNamespace(on_gpu=True, wl=wl, model=object(), script=script,
                        cfg=SimpleNamespace(interleave_rounds=7, delta=0.02), deadline=None,
                        out_of_time=lambda need_s=0.0: False, bundle_out_of_time=lambda need_s: False)
    monkeypatch.setattr("llm4llm.workload.call_script", lambda fn, w: {})
    decision, narrowed = acc._regime_gate(r, bundle, object())
    assert decision.decision == "rejected" and decision.e2e_after_ms == 35e3 and decision.e2e_before_ms == 1100.0
    assert narrowed.batch_buckets == [1, 2, 4, 8]
    assert "at batch 32: the trial's warm-up runs took 40.0 s, 35.0 s" in capsys.readouterr().out


def test_decode_graphs_keep_generates_per_row_positions_of_a_left_padded_batch():
    """generate derives each row's positions from the attention mask only when the model's forward takes
    `position_ids` (it inspects the signature). The graphs' wrapper must show the original's signature: behind a
    bare (*args, **kwargs) the layers got one row of positions ([1, 1, D] rotary tables) instead of the per-row
    [B, 1, D] that extraction captured, so a decode-layer kernel guarded on extraction's shapes never ran in the
    graphs (a serving regime's README run rejected it: "expected [8, 1, 128], got [1, 1, 128]"). Rotary is
    shift-invariant, so the tokens agree either way; the shapes did not."""
    import inspect

    from kernels_runtime.graphs import disable_decode_graphs, enable_decode_graphs
    from tests.test_runtime_stateful import tiny

    model = tiny("llama")
    ids = torch.randint(1, 256, (3, 6), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, :3], mask[1, :1] = 0, 0  # rows of 3, 5 and 6 tokens, left-padded
    ids = ids * mask

    def generate():
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                 cache_implementation="static", disable_compile=True, output_scores=True,
                                 return_dict_in_generate=True)
        return torch.stack(out.scores)

    seen = []
    model.model.layers[0].register_forward_hook(
        lambda m, args, kwargs, out: seen.append(tuple(kwargs["position_embeddings"][0].shape)), with_kwargs=True)
    want = generate()
    eager_rows = {s[0] for s in seen}
    seen.clear()
    graphs = enable_decode_graphs(model, backend="emulate", static_cache=True)
    try:
        assert "position_ids" in inspect.signature(model.forward).parameters
        got = generate()
        stats = graphs.stats()
    finally:
        disable_decode_graphs(model)
    assert stats["graphs"] == 1 and stats["replays"] >= 1, stats
    assert eager_rows == {3} and {s[0] for s in seen} == {3}, seen
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
