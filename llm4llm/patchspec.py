"""The patch a task's candidate becomes: its guard from what extraction observed, and its PatchSpec. Shared by
deployment-time acceptance (llm4llm/accept.py) and the verifier, which times a candidate installed through
kernels_runtime exactly as acceptance will install it (llm4llm/verify/timing.py)."""
from __future__ import annotations

from kernels_runtime.bundle import Guard, PatchSpec, Provenance, library_versions
from llm4llm.taskspec import TaskSpec


def guard_for(spec: TaskSpec, device_type: str) -> Guard:
    """Guards from what extraction observed: dtype, device, capability, every input's dims (exact where all cases
    agree, else the observed range) and contiguity. Anything outside falls back to the original forward."""
    shapes: dict[str, list] = {}
    for name in spec.input_names:
        sigs = [c.inputs[name].shape for c in spec.cases if name in c.inputs]
        if not sigs or len({len(s) for s in sigs}) != 1:
            continue
        dims = []
        for d in range(len(sigs[0])):
            vals = {s[d] for s in sigs}
            dims.append(vals.pop() if len(vals) == 1 else [min(s[d] for s in sigs), max(s[d] for s in sigs)])
        shapes[name] = dims
    cap = spec.hardware.get("capability") if device_type == "cuda" else None
    return Guard(dtypes=[spec.dtype], device_types=[device_type], min_capability=cap or None, shapes=shapes)


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
