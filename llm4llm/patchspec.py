"""The patch a task's candidate becomes: its guard from what extraction observed, and its PatchSpec. Shared by
deployment-time acceptance (llm4llm/accept.py) and the verifier, which times a candidate installed through
kernels_runtime exactly as acceptance will install it (llm4llm/verify/timing.py)."""
from __future__ import annotations

from kernels_runtime.bundle import Guard, PatchSpec, Provenance, library_versions
from llm4llm.taskspec import TaskSpec


def guard_for(spec: TaskSpec, device_type: str) -> Guard:
    """Guards from what extraction observed: dtypes (the task's and its inputs'), device, capability, every input's
    dims (exact where all cases agree, else the observed range), contiguity, and the state adapter of the cache the
    task was captured on. Anything outside falls back to the original forward."""
    shapes: dict[str, list] = {}
    ragged = False  # an input whose rank differs between cases has no box: only its verified shapes are admitted
    for name in spec.input_names:
        sigs = [c.inputs[name].shape for c in spec.cases if name in c.inputs]
        if not sigs:
            continue
        if len({len(s) for s in sigs}) != 1:
            ragged = True
            continue
        dims = []
        for d in range(len(sigs[0])):
            vals = {s[d] for s in sigs}
            dims.append(vals.pop() if len(vals) == 1 else [min(s[d] for s in sigs), max(s[d] for s in sigs)])
        shapes[name] = dims
    cap = spec.hardware.get("capability") if device_type == "cuda" else None
    # the task's dtype and every floating dtype its captured inputs had (a Mamba block computes in bf16 and takes
    # the fp32 residual stream)
    seen = {sig.dtype for c in spec.cases for sig in c.inputs.values() if sig.dtype in _FLOATING}
    dtypes = [spec.dtype] + sorted(seen - {spec.dtype})
    # the exact joint signatures the verifier judged (every case): nothing in between is admitted, unless the cases
    # span a declared serving regime (its corners verified): then the box of `shapes` is what was verified
    signatures = []
    for c in spec.cases:
        sig = {n: list(c.inputs[n].shape) for n in spec.input_names if n in c.inputs}
        if sig and sig not in signatures:
            signatures.append(sig)
    state = (spec.recipe or {}).get("state") or {}
    # inputs some verified cases had as None (extract.merge_optional_inputs): the guard admits their absence
    optional = [n for n in spec.input_names if any(n not in c.inputs for c in spec.cases)]
    return Guard(dtypes=dtypes, device_types=[device_type], min_capability=cap or None, shapes=shapes,
                 signatures=signatures if ragged or (len(signatures) > 1 and not spec.regime) else [],
                 state_adapter=state.get("adapter"), batch_buckets=_batch_buckets(spec), optional=optional)


def _batch_buckets(spec: TaskSpec) -> list[int]:
    """A decode task over a serving regime: the batches its cases hold (the regime's buckets and corners,
    llm4llm/regime.py), each verified; the guard admits those only. Else [] (not checked)."""
    if not spec.regime or spec.phase != "decode" or not spec.input_names:
        return []
    return spec.batches()


_FLOATING = ("float16", "bfloat16", "float32", "float64")


def task_patch_spec(spec: TaskSpec, candidate_id: str, task_speedup: float, device_type: str,
                    run_id: str = "") -> PatchSpec:
    """The PatchSpec of `candidate_id` for this task (kernel source added by the caller)."""
    return PatchSpec(
        patch_id=f"{spec.task_id}:{candidate_id}",
        module_class=spec.module_class,
        instances=list(spec.instances),
        phase=spec.phase,
        guard=guard_for(spec, device_type),
        kernel="",
        outputs=spec.recipe.get("outputs") if spec.recipe else None,
        dispatch_template=spec.module_class,
        provenance=Provenance(run_id=run_id, task_id=spec.task_id, candidate_id=candidate_id,
                              metrics={"task_speedup": task_speedup}, library_versions=library_versions(),
                              gpu=str(spec.hardware.get("gpu_name", ""))),
    )
