"""Shared by the static-cache template tests: generate on transformers' static cache with one candidate installed
and check, eagerly and with the decode steps replayed from (emulated: closure re-run) graphs, that every decode
call of the patched modules takes the kernel, none falls back outside prefill, and the teacher-forced logits match
the unpatched model's."""
from __future__ import annotations

import torch

from kernels_runtime.tolerances import assert_close


def check_static_decode_in_model(workload: str, spec, source: str, name: str, modules: list[str] | None = None):
    """`modules`: the exact patched module paths expected (None: any two). Returns the patch report's counters."""
    import kernels_runtime
    from kernels_runtime.bundle import PatchBundle
    from kernels_runtime.graphs import disable_decode_graphs, enable_decode_graphs
    from kernels_runtime.patch import report_of
    from llm4llm.accept import teacher_forced_logits
    from llm4llm.patchspec import task_patch_spec
    from llm4llm.workload import call_script, load_script, load_workload

    wl = load_workload(workload)
    script = load_script(wl)
    model, batch = call_script(script.build, wl), call_script(script.inputs, wl)
    steps = wl.decode_len
    model.generation_config.cache_implementation, model.generation_config.disable_compile = "static", True
    with torch.inference_mode():
        tokens = model.generate(**batch, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                pad_token_id=0)[:, batch["input_ids"].shape[1]:]
    ref = teacher_forced_logits(model, batch, tokens, steps)
    bundle = PatchBundle(name=name)
    bundle.add_patch(task_patch_spec(spec, "c", 1.0, "cpu"), source=source)
    report = kernels_runtime.apply(model, bundle, strict=True)
    try:
        got = teacher_forced_logits(model, batch, tokens, steps)
        counters = report_of(model)
        if modules is not None:
            assert sorted(counters) == modules, counters
        else:
            assert len(counters) == 2, counters
        for c in counters.values():
            assert c["kernel"] == {"decode": steps - 1} and all("prefill" in r for r in c["fallback"]), c
        assert report.calls_of(bundle.patches[0].patch_id) == 2 * (steps - 1)
        for step, (g, r) in enumerate(zip(got, ref)):
            assert_close(g, r, name=f"logits step {step}")
        graphs = enable_decode_graphs(model, backend="rerun", static_cache=True)
        try:
            again = teacher_forced_logits(model, batch, tokens, steps)
            stats = graphs.stats()
        finally:
            disable_decode_graphs(model)
        assert stats["graphs"] == 1 and stats["refused"] == [] and stats["replays"] >= steps - 2, stats
        for step, (g, r) in enumerate(zip(again, ref)):
            assert_close(g, r, name=f"graphed logits step {step}")
        counters = report_of(model)
        assert all(c["kernel"]["decode"] >= steps - 1 for c in counters.values())
        return counters
    finally:
        kernels_runtime.revert(model)
