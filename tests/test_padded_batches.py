"""Padded batches (issue 38, item 1): a workload asks for left-padded batches (`[regime] padding = "left"`), the
reference script builds them as `generate` serving code does, and the decode attention on transformers' static
cache honours the padding mask. tiny-qwen3-padded / tiny-llama-padded (3 rows of 16, 12 and 15 tokens, left-padded
to 16), extracted on the static cache, fp32, Triton interpreter."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels_runtime.boundary import STATE_OUT
from kernels_runtime.tolerances import assert_close
from llm4llm.taskspec import load_task

WORKLOADS = Path(__file__).resolve().parents[1] / "examples" / "workloads"


def _template(name):
    from llm4llm.search.templates import TEMPLATES

    return next(t for t in TEMPLATES if t.name == name)


@pytest.fixture(scope="module")
def padded_task(tiny_extracted):
    """(workload, family) -> (the decode task dir, its Task) of `<workload>+static`."""
    def get(workload, family):
        d = next(d for d in tiny_extracted(workload + "+static") if d.name.startswith(f"{family}-decode-"))
        return d, load_task(d)

    return get


def test_padded_workload_builds_left_padded_rows():
    """Rows of different prompt lengths (the first full, the others shorter and distinct), left-padded: pad id 0
    and mask 0 before each prompt; the same batch on every call (seeded); a workload without the regime key keeps
    one length for every row."""
    from llm4llm.workload import call_script, load_script, load_workload

    wl = load_workload(WORKLOADS / "tiny-qwen3-padded.toml")
    assert wl.regime.padding == "left"
    script = load_script(wl)
    batch = call_script(script.inputs, wl)
    mask, ids = batch["attention_mask"], batch["input_ids"]
    lens = mask.sum(1).tolist()
    assert mask.shape == ids.shape == (3, 16) and lens[0] == 16 and len(set(lens)) == 3 and min(lens) >= 6
    for row, n in zip(mask, lens):  # zeros, then ones: left padding
        assert torch.equal(row, (torch.arange(16) >= 16 - n).long())
    assert torch.equal(ids[mask == 0], torch.zeros_like(ids[mask == 0]))
    again = call_script(script.inputs, wl)
    assert torch.equal(again["input_ids"], ids) and torch.equal(again["attention_mask"], mask)
    plain = load_workload(WORKLOADS / "tiny-qwen3.toml")
    assert bool(call_script(load_script(plain).inputs, plain)["attention_mask"].all())
    assert wl.regime.model_copy(update={"padding": "none"}).row_prompt_lens(3, 16, 0) == [16, 16, 16]


@pytest.mark.parametrize("workload,family,template", [
    ("tiny-qwen3-padded", "attention", "attention.decode_static"),
    ("tiny-qwen3-padded", "decoder_layer", "decoder_layer.decode_static"),
    ("tiny-llama-padded", "decoder_layer", "decoder_layer.decode_static"),
])
def test_static_templates_pass_the_verifier_on_a_padded_capture(padded_task, workload, family, template, tmp_path):
    """The task captured from the padded batch carries HF's [3, 1, 1, S_max] bool mask with the pad keys masked;
    the template takes it, its default rendering matches the module on the captured call (each row's output, the
    cache written at the device-side length) and passes the verifier's gates."""
    from llm4llm.verify.candidate import load_candidate, unload_candidate
    from llm4llm.verify.gates import run_gates

    task_dir, task = padded_task(workload, family)
    case = task.cases[0]
    mask = case.inputs["attention_mask"]
    assert mask.dtype == torch.bool and tuple(mask.shape) == (3, 1, 1, 19)
    assert (~mask[:, 0, 0, :16]).sum(1).tolist() == [0, 4, 1]  # the pad keys of rows 1 and 2
    tpl = _template(template)
    assert tpl.why_not(task.spec) is None
    source = tpl.render(task.spec, tpl.default(task.spec))
    mod = load_candidate(source, tmp_path, "padded_candidate")
    try:
        state = {n: t.clone() for n, t in case.state.items()}
        out = mod.entry(dict(case.inputs), dict(case.weights), state, dict(task.spec.static))
    finally:
        unload_candidate("padded_candidate")
    assert_close(out["out"], case.ref["out"])
    assert_close(out[STATE_OUT + "key_cache"], case.ref[STATE_OUT + "key_cache"], name="key cache")
    v, _ = run_gates(str(task_dir), source, device="cpu", draws=1, timing=False)
    assert v.passed, f"{v.failure_class}: {v.message}"


def test_static_templates_refuse_a_mask_they_cannot_read(padded_task):
    """An additive float mask (eager attention) or a 2-D one is refused with the reason, never attended causally."""
    from llm4llm.taskspec import TensorSig

    _, task = padded_task("tiny-qwen3-padded", "decoder_layer")
    for dtype, shape in (("float32", [3, 1, 1, 19]), ("bool", [3, 19])):
        case = task.spec.cases[0].model_copy(deep=True)
        case.inputs["attention_mask"] = TensorSig(shape=shape, dtype=dtype)
        odd = task.spec.model_copy(update={"cases": [case]})
        assert "bool mask (SDPA)" in _template("decoder_layer.decode_static").why_not(odd)


def test_patched_model_on_a_padded_batch_matches_eager(padded_task):
    """In the model: generate on the static cache over the padded batch with the layer kernel installed: every
    decode call of both layers takes the kernel and the teacher-forced logits of every row equal the unpatched
    model's, eagerly and replayed from (emulated) decode graphs."""
    from static_patched import check_static_decode_in_model

    _, task = padded_task("tiny-qwen3-padded", "decoder_layer")
    tpl = _template("decoder_layer.decode_static")
    check_static_decode_in_model(str(WORKLOADS / "tiny-qwen3-padded.toml"), task.spec,
                                 tpl.render(task.spec, tpl.default(task.spec)), "padded-layer")


class _Stop(Exception):
    pass


def _padded_attention_call(phase):
    """One call of layer 0's attention in tiny-qwen3-padded's `generate` on the dynamic cache (the prompt's, or the
    first decode step's), captured with its state-in and the module's own outputs: HF's [3, 1, S, L] bool mask with
    rows 1 and 2 left-padded."""
    from kernels_runtime.boundary import capture_call
    from llm4llm.workload import call_script, load_script, load_workload

    wl = load_workload(WORKLOADS / "tiny-qwen3-padded.toml")
    script = load_script(wl)
    model, batch = call_script(script.build, wl), call_script(script.inputs, wl)
    attn, seen = model.model.layers[0].self_attn, {}

    def pre(module, args, kwargs):
        if (kwargs["hidden_states"].shape[1] > 1) == (phase == "prefill"):
            seen.update(args=args, kwargs=kwargs)
            raise _Stop

    handle = attn.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with pytest.raises(_Stop), torch.inference_mode():
            model.generate(**batch, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
    finally:
        handle.remove()
    call = capture_call(attn, *seen["args"], **seen["kwargs"])
    return call, {n: p.detach() for n, p in attn.named_parameters()}


@pytest.mark.parametrize("phase,template", [("prefill", "attention.prefill_flash"),
                                            ("prefill", "attention.prefill_tilemix"),
                                            ("decode", "attention.decode_splitkv"),
                                            ("decode", "attention.decode_fused_qkv")])
def test_dynamic_cache_templates_honour_a_padded_call(tiny_extracted, phase, template, tmp_path):
    """The prefill and dynamic-cache decode templates (rendered for tiny-qwen3's tasks: the same module) on a padded
    call: the output of every row, the pad queries' own rows included, equals the module's own forward (TileMix,
    whose routing is for unpadded prompts, takes the exact kernel for a padded batch)."""
    from llm4llm.verify.candidate import load_candidate, unload_candidate

    d = next(d for d in tiny_extracted("tiny-qwen3") if d.name.startswith(f"attention-{phase}-"))
    spec = load_task(d).spec
    call, weights = _padded_attention_call(phase)
    mask = call.inputs["attention_mask"]
    assert mask.dtype == torch.bool and mask.shape[:2] == (3, 1) and not bool(mask[:, 0, -1].all())
    tpl = _template(template)
    source = tpl.render(spec, tpl.default(spec))
    mod = load_candidate(source, tmp_path, "padded_dynamic_candidate")
    try:
        out = mod.entry(dict(call.inputs), weights, {n: t.clone() for n, t in call.state.items()}, dict(call.static))
    finally:
        unload_candidate("padded_dynamic_candidate")
    assert torch.isfinite(out["out"]).all()
    assert_close(out["out"], call.outputs["out"])
    if call.state_out:
        assert_close(out[STATE_OUT + "key_cache"], call.state_out["key_cache"], name="key cache")


def test_prefill_template_refuses_an_eager_mask(tiny_extracted):
    """An additive float mask (eager attention: its fully masked rows average every value) is refused by name."""
    from llm4llm.taskspec import TensorSig

    d = next(d for d in tiny_extracted("tiny-qwen3") if d.name.startswith("attention-prefill-"))
    spec = load_task(d).spec
    case = spec.cases[0].model_copy(deep=True)
    case.inputs["attention_mask"] = TensorSig(shape=[1, 1, 16, 16], dtype="float32")
    odd = spec.model_copy(update={"cases": [case], "input_names": [*spec.input_names, "attention_mask"]})
    for name in ("attention.prefill_flash", "attention.decode_splitkv", "attention.decode_fused_qkv"):
        assert "bool mask (SDPA)" in _template(name).applies_fn(odd), name


# ------------------------------------------------------------------------------------- the dynamic cache's tasks
# The regime's shortest prompt gives an unpadded batch, for which HF passes no attention mask (None); its padded
# batches pass a bool one. Both kinds of call are one task, the mask an optional input.

def _dynamic_task(tiny_extracted, workload, phase):
    d = next((d for d in tiny_extracted(workload) if d.name.startswith(f"attention-{phase}-")), None)
    assert d is not None, f"no deployable attention {phase} task from {workload}"
    return d, load_task(d)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_padded_workload_yields_deployable_dynamic_cache_attention_tasks(tiny_extracted, phase):
    """tiny-llama-padded on the dynamic cache: the prefill and decode attention tasks are deployable, their cases
    hold padded calls (a bool mask) and unpadded ones (no mask), the recipe rebuilds a case without the mask as
    mask=None, and the guard admits both."""
    from kernels_runtime.boundary import rebuild_call
    from llm4llm.patchspec import guard_for

    _, task = _dynamic_task(tiny_extracted, "tiny-llama-padded", phase)
    assert task.spec.deployable and "attention_mask" in task.spec.input_names
    masked = [c for c in task.cases if "attention_mask" in c.inputs]
    plain = [c for c in task.cases if "attention_mask" not in c.inputs]
    assert masked and plain
    assert all(c.inputs["attention_mask"].dtype == torch.bool and not bool(c.inputs["attention_mask"].all())
               for c in masked)
    _, kwargs = rebuild_call(task.spec.recipe, plain[0].inputs, task.spec.static)
    assert kwargs["attention_mask"] is None
    _, kwargs = rebuild_call(task.spec.recipe, masked[0].inputs, task.spec.static)
    assert kwargs["attention_mask"] is masked[0].inputs["attention_mask"]
    assert guard_for(task.spec, "cpu").optional == ["attention_mask"]


def test_verifier_passes_prefill_attention_on_padded_and_unpadded_cases(tiny_extracted, tmp_path):
    """The reference of each case is the module's own forward (mask=None where the batch had no padding), and
    attention.prefill_flash matches it on every case and passes the verifier's gates."""
    from llm4llm.verify.candidate import load_candidate, unload_candidate
    from llm4llm.verify.gates import run_gates

    task_dir, task = _dynamic_task(tiny_extracted, "tiny-llama-padded", "prefill")
    module, ref = task.load_module(), task.reference()
    tpl = _template("attention.prefill_flash")
    assert tpl.why_not(task.spec) is None
    source = tpl.render(task.spec, tpl.default(task.spec))
    mod = load_candidate(source, tmp_path, "padded_prefill_candidate")
    try:
        for case in task.cases:
            mask = case.inputs.get("attention_mask")
            kwargs = {n: case.inputs[n] for n in ("hidden_states", "position_ids")}
            with torch.inference_mode():
                own = torch.func.functional_call(module, case.weights, (), {
                    **kwargs, "attention_mask": mask,
                    "position_embeddings": (case.inputs["position_embeddings.0"],
                                            case.inputs["position_embeddings.1"])})
            assert_close(own[0], case.ref["out"])
            assert_close(ref(dict(case.inputs), dict(case.weights), {}, dict(task.spec.static))["out"],
                         case.ref["out"])
            out = mod.entry(dict(case.inputs), dict(case.weights), {}, dict(task.spec.static))
            assert_close(out["out"], case.ref["out"], name=f"prefill ({'padded' if mask is not None else 'no mask'})")
    finally:
        unload_candidate("padded_prefill_candidate")
    v, _ = run_gates(str(task_dir), source, device="cpu", draws=1, timing=False)
    assert v.passed, f"{v.failure_class}: {v.message}"


def test_patched_prefill_and_decode_attention_on_padded_and_unpadded_batches_match_eager(tiny_extracted):
    """In the model: a bundle with the prefill and dynamic-cache decode attention patches, generate over the padded
    batch and over an unpadded one (the regime's shortest prompt): every attention call takes a kernel (none falls
    back), and the teacher-forced logits of every row equal the unpatched model's."""
    import kernels_runtime
    from kernels_runtime.bundle import PatchBundle
    from kernels_runtime.patch import report_of
    from llm4llm.accept import reference_tokens, teacher_forced_logits
    from llm4llm.patchspec import task_patch_spec
    from llm4llm.workload import call_script, load_script, load_workload

    bundle = PatchBundle(name="padded-attention")
    for phase, name in (("prefill", "attention.prefill_flash"), ("decode", "attention.decode_splitkv")):
        _, task = _dynamic_task(tiny_extracted, "tiny-llama-padded", phase)
        tpl = _template(name)
        bundle.add_patch(task_patch_spec(task.spec, phase, 1.0, "cpu"), source=tpl.render(task.spec,
                                                                                         tpl.default(task.spec)))
    wl = load_workload(WORKLOADS / "tiny-llama-padded.toml")
    script = load_script(wl)
    model = call_script(script.build, wl)
    steps = wl.decode_len
    batches = [call_script(script.inputs, w) for w in (wl, wl.model_copy(update={"prompt_len": 6}))]
    assert not bool(batches[0]["attention_mask"].all()) and bool(batches[1]["attention_mask"].all())
    tokens = [reference_tokens(model, b, steps)[0] for b in batches]
    refs = [teacher_forced_logits(model, b, t, steps) for b, t in zip(batches, tokens)]
    kernels_runtime.apply(model, bundle, strict=True)
    try:
        for batch, toks, ref, kind in zip(batches, tokens, refs, ("padded", "unpadded")):
            got = teacher_forced_logits(model, batch, toks, steps)
            for step, (g, r) in enumerate(zip(got, ref)):
                assert_close(g, r, name=f"{kind} logits step {step}")
        counters = report_of(model)
    finally:
        kernels_runtime.revert(model)
    assert sorted(counters) == [f"model.layers.{i}.self_attn" for i in range(2)], counters
    for c in counters.values():
        assert c == {"kernel": {"prefill": 2, "decode": 2 * (steps - 1)}, "fallback": {}}, c


def test_a_serving_regime_on_the_static_cache_is_one_decode_task_across_cache_sizes(tmp_path):
    """A regime of batches 1-4 and prompts 6-16 around a point of 8 tokens: `generate` allocates a static cache per
    point (11 positions at the point, 19 past the longest prompt), so the decode calls of one layer come on caches of
    two sizes. They are one boundary (the size is the state's, not the recipe's), every layer keeps its own first call
    only, and the decode-layer template passes the verifier on every case (each batch and cache size). Before, the
    sizes split the layer's decode calls into two argument structures and the task was not deployable."""
    from llm4llm.stages.extract import run_extract
    from llm4llm.stages.profile import run_profile
    from llm4llm.verify.gates import run_gates

    text = (WORKLOADS / "tiny-qwen3-padded.toml").read_text()
    text = text.replace("batch_sizes = [3]", "batch_sizes = {min = 1, max = 4}").replace("prompt_len = 16",
                                                                                          "prompt_len = 8")
    text = text.replace('script = "../scripts/', f'script = "{WORKLOADS.parent / "scripts"}/')
    wl = tmp_path / "tiny-serving.toml"
    wl.write_text(text)
    data = tmp_path / "data"
    run_extract(str(wl), run_profile(str(wl), str(data)), str(data), static_cache=True)
    dirs = {d.name.rsplit("-", 1)[0]: d for d in (data / "tasks").iterdir() if (d / "spec.json").exists()}
    for family in ("attention", "decoder_layer"):
        assert f"{family}-decode" in dirs, sorted(dirs)
    task_dir = dirs["decoder_layer-decode"]
    task = load_task(task_dir)
    sizes = {tuple(c.state["key_cache"].shape)[::2] for c in task.cases}  # (batch, cache positions)
    assert {b for b, _ in sizes} == {1, 2, 3, 4} and len({s for _, s in sizes}) == 2, sizes
    tpl = _template("decoder_layer.decode_static")
    assert tpl.why_not(task.spec) is None
    v, _ = run_gates(str(task_dir), tpl.render(task.spec, tpl.default(task.spec)), device="cpu", draws=1,
                     timing=False)
    assert v.passed, f"{v.failure_class}: {v.message}"


def test_a_regime_bundle_replays_one_graph_per_bucket_across_script_runs(padded_task):
    """Acceptance times a trial as the workload's script runs it, run after run (two warm-ups each side, then the
    rounds): with the layer kernel, the regime's batch buckets and decode graphs on the static cache, the first run
    captures the bucket's step once and every later decode step of every run replays it (on the serving regime an
    H100's trial runs took 30-60 s each where the unpatched graphed run took 0.9 s: a step captured again per call
    would do that). Graphs re-run their closure here (Triton under the interpreter)."""
    import kernels_runtime
    from kernels_runtime.bundle import PatchBundle
    from kernels_runtime.graphs import disable_decode_graphs, enable_decode_graphs
    from llm4llm.patchspec import task_patch_spec
    from llm4llm.workload import call_script, load_script, load_workload

    _, task = padded_task("tiny-qwen3-padded", "decoder_layer")
    tpl = _template("decoder_layer.decode_static")
    wl = load_workload(str(WORKLOADS / "tiny-qwen3-padded.toml"))
    script = load_script(wl)
    model, batch = call_script(script.build, wl), call_script(script.inputs, wl)
    buckets = list(wl.regime.batch_buckets())
    bundle = PatchBundle(name="regime-graphs", batch_buckets=buckets)
    bundle.add_patch(task_patch_spec(task.spec, "c", 1.0, "cpu"), source=tpl.render(task.spec, tpl.default(task.spec)))
    report = kernels_runtime.apply(model, bundle, strict=True)
    graphs = enable_decode_graphs(model, backend="rerun", static_cache=True, buckets=tuple(buckets))
    try:
        runs = 3
        for _ in range(runs):
            call_script(script.run, model, wl, batch)
        stats = graphs.stats()
    finally:
        disable_decode_graphs(model)
        kernels_runtime.revert(model)
    assert stats["graphs"] == 1 and stats["refused"] == [], stats
    assert stats["replays"] >= runs * (wl.decode_len - 1) - 2, stats
    assert report.calls_of(bundle.patches[0].patch_id) > 0
