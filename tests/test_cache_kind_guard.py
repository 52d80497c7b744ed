"""A kernel runs only on the KV-cache kind it was verified on. A decode task extracted on transformers' dynamic
cache holds the past as [B, Hkv, L, D] tensors that grow; the static cache holds a zero-padded [B, Hkv, S_max, D]
buffer and a device-side length. A dynamic-cache kernel handed a static-cache call would attend over the padding
(and the reverse would read a length that is not there), with inputs that pass every shape guard. The guard records
the state adapter the task was verified with, and a call whose cache takes another adapter falls back."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels_runtime.tolerances import assert_close

WORKLOADS = Path(__file__).resolve().parents[1] / "examples" / "workloads"


def _template(name):
    from llm4llm.search.templates import TEMPLATES

    return next(t for t in TEMPLATES if t.name == name)


def _layer_task(tiny_extracted, name):
    from llm4llm.taskspec import load_task

    d = next(d for d in tiny_extracted(name) if d.name.startswith("decoder_layer-decode-"))
    return load_task(d)


def _logits(cache: str, bundle_of=None):
    import kernels_runtime
    from kernels_runtime.patch import report_of
    from llm4llm.accept import teacher_forced_logits
    from llm4llm.workload import call_script, load_script, load_workload

    wl = load_workload(str(WORKLOADS / "tiny-qwen3.toml"))
    script = load_script(wl)
    model, batch = call_script(script.build, wl), call_script(script.inputs, wl)
    steps = wl.decode_len
    model.generation_config.cache_implementation = cache
    model.generation_config.disable_compile = True
    with torch.inference_mode():
        tokens = model.generate(**batch, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                pad_token_id=0)[:, batch["input_ids"].shape[1]:]
    ref = teacher_forced_logits(model, batch, tokens, steps)
    if bundle_of is None:
        return ref, None, None
    kernels_runtime.apply(model, bundle_of(), strict=True)
    try:
        return ref, teacher_forced_logits(model, batch, tokens, steps), report_of(model)
    finally:
        kernels_runtime.revert(model)


@pytest.mark.slow
def test_a_dynamic_cache_layer_kernel_never_runs_on_the_static_cache(tiny_extracted):
    from kernels_runtime.bundle import PatchBundle
    from llm4llm.patchspec import task_patch_spec

    task = _layer_task(tiny_extracted, "tiny-qwen3")  # extracted on the dynamic cache
    tpl = _template("decoder_layer.decode_fused")
    assert tpl.why_not(task.spec) is None
    spec = task_patch_spec(task.spec, "c", 1.0, "cpu")
    assert spec.guard.state_adapter == "DynamicLayer"

    def bundle():
        b = PatchBundle(name="dynamic-layer")
        b.add_patch(spec, source=tpl.render(task.spec, tpl.default(task.spec)))
        return b

    ref, got, counters = _logits("static", bundle)
    assert counters and all(not c["kernel"] for c in counters.values()), counters
    reasons = {r for c in counters.values() for r in c["fallback"]}
    assert any("StaticLayer" in r and "DynamicLayer" in r for r in reasons), reasons
    for step, (g, r) in enumerate(zip(got, ref)):
        assert_close(g, r, name=f"logits step {step}")


@pytest.mark.slow
def test_the_guard_records_the_cache_kind_of_the_task(tiny_extracted):
    from kernels_runtime.bundle import Guard
    from llm4llm.patchspec import guard_for
    from llm4llm.taskspec import load_task

    static = _layer_task(tiny_extracted, "tiny-qwen3+static")
    assert guard_for(static.spec, "cpu").state_adapter == "StaticLayer"
    stateless = [load_task(d) for d in tiny_extracted("tiny-qwen3") if d.name.startswith("norm-")]
    assert stateless and all(guard_for(t.spec, "cpu").state_adapter is None for t in stateless)
    assert Guard.model_validate({"dtypes": ["float32"]}).state_adapter is None  # a bundle written before the field
