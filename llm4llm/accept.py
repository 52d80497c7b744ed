"""Deployment-time acceptance: insert verified candidates into the real model instance, check them in-model and end
to end through the user's script, and keep only those that gain at least δ.

In-model correctness is teacher-forced: the unpatched model's greedy tokens are forced through both the patched and
the unpatched model (a logits processor that allows only the reference token), and the raw logits of every step are
compared. Token identity is not the metric: on random weights near-flat logits flip tokens on rounding-level
differences (../shared/DESIGN.md); token agreement is an extra check only where real weights are loaded.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernels_runtime.bundle import Guard, PatchBundle, PatchSpec, Provenance, library_versions, save_bundle
from kernels_runtime.tolerances import tolerance_for
from llm4llm.taskspec import TaskSpec

METRICS = ("logits_rel_l2", "logits_max_abs")


@dataclass
class AcceptConfig:
    delta: float = 0.02  # minimum end-to-end gain (fraction of the current latency)
    metric: str = "logits_rel_l2"  # or logits_max_abs (the shared elementwise tolerance)
    tol_factor: float = 3.0  # rel-L2 threshold = tol_factor x TOLERANCES[dtype].rtol
    repeats: int = 5
    check_tokens: bool = False  # greedy-token agreement too (meaningful with real weights only)

    def __post_init__(self):
        if self.metric not in METRICS:
            raise ValueError(f"metric: expected one of {METRICS}, got {self.metric!r}")
        if not 0 <= self.delta < 1:
            raise ValueError(f"delta: expected a fraction in [0, 1), got {self.delta}")


@dataclass
class Proposal:
    """A verified candidate for one task, as the acceptance stage sees it."""

    task_dir: str
    candidate_id: str
    source: str
    speedup: float  # task-level, in-context
    config: dict = field(default_factory=dict)

    def spec(self) -> TaskSpec:
        from llm4llm.taskspec import load_spec

        return load_spec(Path(self.task_dir))


@dataclass
class Decision:
    task_id: str
    candidate_id: str
    decision: str  # accepted | rejected
    reason: str
    metric: str
    in_model_err: float | None
    e2e_before_ms: float | None
    e2e_after_ms: float | None
    gain: float | None
    expected_impact: float
    counters: dict = field(default_factory=dict)


def expected_impact(p: Proposal, spec: TaskSpec) -> float:
    """Share of the workload the task covers x the fraction of it a speedup removes."""
    if p.speedup <= 0:
        return 0.0
    return spec.hotspot_score * (1.0 - 1.0 / p.speedup)


def rank(proposals: list[Proposal]) -> list[tuple[Proposal, TaskSpec, float]]:
    """Order by module compatibility (deployable), phase and shape coverage present, then expected impact."""
    scored = []
    for p in proposals:
        spec = p.spec()
        if not spec.deployable or not spec.cases or spec.phase not in ("prefill", "decode"):
            continue
        scored.append((p, spec, expected_impact(p, spec)))
    return sorted(scored, key=lambda t: t[2], reverse=True)


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


def patch_spec_for(p: Proposal, spec: TaskSpec, device_type: str, run_id: str = "") -> PatchSpec:
    return PatchSpec(
        patch_id=f"{spec.task_id}:{p.candidate_id}",
        module_class=spec.module_class,
        instances=list(spec.instances),
        phase=spec.phase,
        guard=guard_for(spec, device_type),
        kernel="",
        outputs=spec.recipe.get("outputs") if spec.recipe else None,
        dispatch_template=spec.module_class,
        provenance=Provenance(run_id=run_id, task_id=spec.task_id, candidate_id=p.candidate_id,
                              metrics={"task_speedup": p.speedup}, library_versions=library_versions(),
                              gpu=str(spec.hardware.get("gpu_name", ""))),
    )


class _ForceTokens:
    """Logits processor that allows only the reference token at each step (teacher forcing through generate)."""

    def __init__(self, tokens: torch.Tensor, prompt_len: int):
        self.tokens, self.prompt_len = tokens, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_len
        forced = self.tokens[:, step].to(scores.device)
        out = torch.full_like(scores, -math.inf)
        out.scatter_(1, forced[:, None], 0.0)
        return out


def teacher_forced_logits(model, batch: dict, tokens: torch.Tensor, decode_len: int) -> list[torch.Tensor]:
    """Raw logits of every generation step with `tokens` ([B, decode_len] new tokens) forced."""
    from transformers import LogitsProcessorList

    prompt_len = batch["input_ids"].shape[1]
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=decode_len, min_new_tokens=decode_len, do_sample=False,
                             pad_token_id=0, logits_processor=LogitsProcessorList([_ForceTokens(tokens, prompt_len)]),
                             output_logits=True, return_dict_in_generate=True)
    return [l.float() for l in out.logits]


def reference_tokens(model, batch: dict, decode_len: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=decode_len, min_new_tokens=decode_len, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    prompt_len = batch["input_ids"].shape[1]
    return out.sequences[:, prompt_len:], [l.float() for l in out.logits]


def compare_logits(ref: list[torch.Tensor], new: list[torch.Tensor], dtype: torch.dtype,
                   cfg: AcceptConfig) -> tuple[bool, float, str]:
    """Worst step under the configured metric; NaN/Inf never pass."""
    tol = tolerance_for(dtype)
    worst, worst_step = 0.0, -1
    for step, (r, n) in enumerate(zip(ref, new)):
        if not torch.isfinite(n).all():
            return False, math.inf, f"step {step}: non-finite logits"
        if cfg.metric == "logits_rel_l2":
            err = float((n - r).norm() / r.norm().clamp_min(1e-12))
        else:
            err = float(((n - r).abs() - tol.rtol * r.abs()).max())
        if err > worst:
            worst, worst_step = err, step
    limit = cfg.tol_factor * tol.rtol if cfg.metric == "logits_rel_l2" else tol.atol
    ok = worst <= limit and len(ref) == len(new)
    detail = f"{cfg.metric} worst {worst:.3g} at step {worst_step} (limit {limit:.3g})"
    return ok, worst, detail


@dataclass
class AcceptanceResult:
    decisions: list[Decision]
    bundle_dir: str | None
    baseline_ms: float | None
    final_ms: float | None
    metric: str
    timing: str  # "cuda" | "skipped: cpu"

    def to_dict(self) -> dict:
        return asdict(self)


def accept(workload_path: str, proposals: list[Proposal], bundle_dir: str, *, cfg: AcceptConfig | None = None,
           run_id: str = "") -> AcceptanceResult:
    """Greedy acceptance in order of expected impact, re-measuring after each accepted patch (patches interact)."""
    import kernels_runtime
    from llm4llm.evaluate import measure
    from llm4llm.workload import call_script, load_script, load_workload

    cfg = cfg or AcceptConfig()
    wl = load_workload(workload_path)
    script = load_script(wl)
    model = call_script(script.build, wl)
    batch = call_script(script.inputs, wl)
    on_gpu = wl.device.startswith("cuda")
    device_type = "cuda" if on_gpu else "cpu"
    tokens, _ = reference_tokens(model, batch, wl.decode_len)
    ref_logits = teacher_forced_logits(model, batch, tokens, wl.decode_len)

    def latency() -> float | None:
        if not on_gpu:
            return None
        return measure(model, wl, batch, script.run, repeats=cfg.repeats).total_ms

    current = latency()
    baseline = current
    accepted = PatchBundle(name=f"{wl.name}", library_versions=library_versions(),
                           gpu=torch.cuda.get_device_name() if on_gpu else "cpu")
    decisions: list[Decision] = []
    for p, spec, impact in rank(proposals):
        trial = PatchBundle.from_json(accepted.to_json())
        for s in accepted.patches:
            trial.add_kernel(accepted.source(s.kernel))
        trial.add_patch(patch_spec_for(p, spec, device_type, run_id), source=p.source)
        decision = _try(model, trial, spec, p, batch, tokens, ref_logits, wl, cfg, latency, current, impact)
        decisions.append(decision)
        kernels_runtime.revert(model)
        if decision.decision == "accepted":
            accepted = trial
            current = decision.e2e_after_ms
    bundle_path = None
    if accepted.patches:
        bundle_path = str(save_bundle(accepted, bundle_dir))
    return AcceptanceResult(decisions, bundle_path, baseline, current, cfg.metric,
                            "cuda" if on_gpu else "skipped: cpu")


def _try(model, bundle, spec, p, batch, tokens, ref_logits, wl, cfg, latency, current, impact) -> Decision:
    import kernels_runtime

    def decide(decision, reason, err=None, after=None, gain=None, counters=None):
        return Decision(spec.task_id, p.candidate_id, decision, reason, cfg.metric, err, current, after, gain,
                        impact, counters or {})

    try:
        report = kernels_runtime.apply(model, bundle, strict=True)
        new_logits = teacher_forced_logits(model, batch, tokens, wl.decode_len)
        if wl.device.startswith("cuda"):
            torch.cuda.synchronize()
    except Exception as e:  # runtime validity: a CUDA error or a kernel failure under the model's own allocator
        return decide("rejected", f"runtime: {type(e).__name__}: {str(e)[:300]}")
    counters = report.totals()
    ok, err, detail = compare_logits(ref_logits, new_logits, wl.torch_dtype, cfg)
    if not ok:
        return decide("rejected", f"in-model correctness: {detail}", err, counters=counters)
    if counters.get("kernel", 0) == 0:
        return decide("rejected", f"shape coverage: the kernel never ran in-model (all calls fell back: "
                                  f"{report.counters()})", err, counters=counters)
    if cfg.check_tokens:
        forced_free, _ = reference_tokens(model, batch, wl.decode_len)
        if not torch.equal(forced_free, tokens):
            return decide("rejected", "greedy tokens differ from the unpatched model", err, counters=counters)
    after = latency()
    if after is None:
        return decide("rejected", f"latency gate skipped on the CPU: no CPU timing may accept a patch "
                                  f"(in-model correctness ok: {detail})", err, counters=counters)
    gain = (current - after) / current
    if gain < cfg.delta:
        return decide("rejected", f"end-to-end gain {gain:+.2%} below delta {cfg.delta:.0%}", err, after, gain, counters)
    return decide("accepted", f"end-to-end gain {gain:+.2%}; {detail}", err, after, gain, counters)


def decision_rows(result: AcceptanceResult, run_id: str) -> list[dict[str, Any]]:
    return [
        {"acceptance_id": f"{run_id}:{d.task_id}:{d.candidate_id}", "run_id": run_id, "task_id": d.task_id,
         "candidate_id": d.candidate_id, "decision": d.decision, "reason": d.reason, "metric": d.metric,
         "in_model_max_abs_err": d.in_model_err, "e2e_before_ms": d.e2e_before_ms, "e2e_after_ms": d.e2e_after_ms,
         "gain": d.gain}
        for d in result.decisions
    ]
