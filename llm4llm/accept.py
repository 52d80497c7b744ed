"""Deployment-time acceptance: insert verified candidates into the real model instance, check them in-model and end
to end through the user's script, and keep only those that gain at least δ.

In-model correctness is teacher-forced: the unpatched model's greedy tokens are forced through both the patched and
the unpatched model (a logits processor that allows only the reference token), and the raw logits of every step are
compared. Token identity is not the metric: on random weights near-flat logits flip tokens on rounding-level
differences (../shared/DESIGN.md); token agreement is an extra check only where real weights are loaded.

Metrics (AcceptSettings.metric, llm4llm.config; "auto" picks logits_rel_l2_floor for 16-bit models, logits_rel_l2 for fp32):
- logits_rel_l2: per step ||patched - unpatched|| / ||unpatched|| <= tol_factor x TOLERANCES[dtype].rtol (fixed).
- logits_rel_l2_floor: the same rel-L2, calibrated by the model's own precision noise floor. floor_t = rel-L2 of the
  unpatched model in its dtype vs an upcast copy of itself (same weights in fp32, or fp64 for an fp32 model; same
  forced tokens). A step passes if rel-L2 <= max(fixed limit, floor_factor x floor_t): the patch may move the
  logits by no more than the dtype's own rounding does (x floor_factor). Where the upcast copy does not fit in
  memory, the floor comes from the unpatched model with its weights perturbed at rounding level; where neither
  works, the fixed limit applies and the reason says so.
- logits_max_abs: the shared elementwise tolerance (|d| <= atol + rtol |ref|) on every step.
NaN/Inf never pass under any metric.
"""
from __future__ import annotations

import copy
import gc
import json
import math
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kernels_runtime import tolerances
from kernels_runtime.buckets import pad_rows
from kernels_runtime.bundle import PatchBundle, PatchSpec, library_versions, load_bundle, save_bundle
from kernels_runtime.patch import verified_on
from kernels_runtime.tolerances import tolerance_for
from llm4llm.config import AcceptSettings
from llm4llm.evaluate import clone_sharing_weights
from llm4llm.outcomes import NOT_RETRIED, AcceptDecision, AcceptTiming, DecidedBy
from llm4llm.patchspec import task_patch_spec
from llm4llm.taskspec import TaskSpec

METRICS = ("logits_rel_l2_floor", "logits_rel_l2", "logits_max_abs")
METRIC_CHOICES = ("auto",) + METRICS


@dataclass(frozen=True)
class GraphPlan:
    """What the run decided about CUDA graphs before acceptance (not a setting: llm4llm.graph_plan derives it
    from the `graphs.decode_graphs` setting, the device and the tasks). decode_graphs: measure (and ship) the model
    with its one-token decode steps replayed from CUDA graphs (kernels_runtime.graphs), gated like a patch: the
    baseline is the unpatched model with graphs, each trial the patched one with graphs, and the bundle records it;
    off the GPU nothing is replayed or timed, and the result says so. static_cache: with decode_graphs, generate
    with transformers' static KV cache (Llama, Qwen3, RecurrentGemma: graphable only so)."""

    decode_graphs: bool = False
    static_cache: bool = False


@dataclass
class Proposal:
    """A verified candidate for one task, as the acceptance stage sees it."""

    task_dir: str
    candidate_id: str
    source: str
    speedup: float  # task-level, in-context
    config: dict = field(default_factory=dict)
    template: str = ""

    def spec(self) -> TaskSpec:
        from llm4llm.taskspec import load_spec

        return load_spec(Path(self.task_dir))


# decisions made without running the patched model: they take no time, so they do not count as the run's first trial
UNTRIED = frozenset({DecidedBy.NOT_TRIED, DecidedBy.LOSSY_NOT_ALLOWED, DecidedBy.TIME_BUDGET})


@dataclass
class Decision:
    """One acceptance decision. `decision` and `decided_by` are what code reads; `reason` says the same in words,
    with its numbers, for people (the acceptances row, the CLI)."""

    task_id: str
    candidate_id: str
    decision: AcceptDecision
    reason: str
    metric: str  # the metric and its numbers, e.g. "logits_rel_l2_floor: rel-L2 0.039 vs floor 0.052 x 1 (...)"
    in_model_err: float | None
    e2e_before_ms: float | None
    e2e_after_ms: float | None
    gain: float | None
    expected_impact: float
    counters: dict = field(default_factory=dict)
    in_model_limit: float | None = None  # the deciding step's limit
    in_model_floor: float | None = None  # the deciding step's noise floor (logits_rel_l2_floor)
    baseline_after_ms: float | None = None  # the model without the trial, measured again right after it
    lossy: dict | None = None  # a lossy trial: its routing, the budget and what was measured against it
    decided_by: DecidedBy = field(kw_only=True)  # the step of the trial that decided

    def __post_init__(self):
        self.decision, self.decided_by = AcceptDecision(self.decision), DecidedBy(self.decided_by)

    @property
    def accepted(self) -> bool:
        return self.decision == AcceptDecision.ACCEPTED

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=str)

    @classmethod
    def from_json(cls, text: str) -> Decision:
        return cls(**json.loads(text))

    def retried(self) -> bool:
        """Whether the task goes back to search with this decision as experience: a rejection that says something
        about the candidate (not one the CPU's missing latency gate made)."""
        return self.decision == AcceptDecision.REJECTED and self.decided_by not in NOT_RETRIED


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


def not_worth_a_trial(p: Proposal, cfg: AcceptSettings, on_gpu: bool) -> str | None:
    """Why a candidate is rejected without an in-model trial (None: try it). Only on the GPU: the CPU has no
    timings, so every candidate is tried there (and none is accepted)."""
    if on_gpu and p.speedup <= cfg.min_task_speedup:
        return (f"not tried in-model: task-level in-context speedup {p.speedup:.2f}x <= {cfg.min_task_speedup:g}x "
                f"(min_task_speedup)")
    return None


def patch_spec_for(p: Proposal, spec: TaskSpec, device_type: str, run_id: str = "") -> PatchSpec:
    return task_patch_spec(spec, p.candidate_id, p.speedup, device_type, run_id)


# Templates whose renderings are lossy by design (kernels_runtime.ops.tilemix_attention's INT8 score tiles)
LOSSY_TEMPLATES = ("attention.prefill_tilemix",)


def lossy_of(p: Proposal) -> dict | None:
    """The routing ({"template", "coverage"}) of a lossy candidate, {} for one lossy by its source alone (an LLM's
    candidate calling TileMix), None for an exact one. Read from the proposal's template and config, whatever the
    workload allows; the verifier's verify.gates.lossy_of_source instead reads the routing a source declares
    (`LOSSY = {...}`) and only where the workload opted in."""
    if p.template in LOSSY_TEMPLATES or "tilemix_attention" in p.source or "\nLOSSY = " in p.source:
        return {k: p.config[c] for k, c in (("template", "tm_template"), ("coverage", "tm_coverage")) if c in p.config}
    return None


def lossy_descent(p: Proposal, spec: TaskSpec) -> list[Proposal]:
    """The proposal, then its template rendered at each lower INT8 coverage of the space, highest first: the
    search ranks TileMix points by speed, the budget can only be measured in the model, so acceptance walks the
    coverage down until the budget holds. The lower renderings differ only in the routing (the same kernels, less
    INT8); they keep the verified candidate's task speedup, an upper bound, for the ranking."""
    from llm4llm.search.templates import TEMPLATES

    template = next((t for t in TEMPLATES if t.name == p.template), None)
    if template is None or "tm_coverage" not in p.config:
        return [p]
    lower = sorted((c for c in template.space(spec)["tm_coverage"] if c < p.config["tm_coverage"]), reverse=True)
    out = [p]
    for c in lower:
        config = {**p.config, "tm_coverage": c}
        out.append(Proposal(p.task_dir, f"{p.candidate_id}@{c:g}", template.render(spec, config), p.speedup, config,
                            p.template))
    return out


def token_agreement(model, batch: dict, tokens: torch.Tensor, decode_len: int) -> float:
    """Fraction of the free-running greedy tokens equal to `tokens` (the unpatched model's), position by position."""
    free, _ = reference_tokens(model, batch, decode_len)
    return float((free == tokens.to(free.device)).float().mean())


def budget_check(ref: list[torch.Tensor], new: list[torch.Tensor], budget: dict,
                 agreement: Callable[[], float]) -> LogitsCheck:
    """A lossy trial against the workload's accuracy budget: every step's teacher-forced logits rel-L2 at most
    max_logit_deviation and/or the greedy token agreement at least min_token_agreement. NaN/Inf never pass."""
    metric = "accuracy_budget"
    if len(ref) != len(new):
        return LogitsCheck(False, math.inf, f"{metric}: {len(new)} steps of logits, expected {len(ref)}", metric,
                           summary=f"{metric}: step count mismatch")
    devs = []
    for step, (r, n) in enumerate(zip(ref, new)):
        if not torch.isfinite(n).all():
            return LogitsCheck(False, math.inf, f"{metric}: step {step}: non-finite logits", metric, step,
                               summary=f"{metric}: non-finite")
        devs.append(rel_l2(n, r))
    step = max(range(len(devs)), key=devs.__getitem__) if devs else -1
    dev = devs[step] if devs else 0.0
    limit, tmin = budget.get("max_logit_deviation"), budget.get("min_token_agreement")
    ok, parts, agree = True, [], None
    if limit is not None:
        ok = dev <= limit
        parts.append(f"logits rel-L2 {dev:.3g} at step {step} {'<=' if ok else '>'} {limit:g}")
    else:
        parts.append(f"logits rel-L2 {dev:.3g} at step {step} (no bound)")
    if tmin is not None and ok:
        agree = agreement()
        ok = agree >= tmin
        parts.append(f"greedy token agreement {agree:.3f} {'>=' if ok else '<'} {tmin:g}")
    detail = f"{metric}: " + ", ".join(parts)
    return LogitsCheck(ok, dev, detail, metric, step, limit, None, detail, agreement=agree)


class _ForceTokens:
    """Logits processor that allows only the reference token at each step (teacher forcing through generate)."""

    def __init__(self, tokens: torch.Tensor, prompt_len: int):
        self.tokens, self.prompt_len = tokens, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_len
        # a batch padded to its bucket (kernels_runtime.buckets) repeats its last sequence: so do its tokens
        forced = pad_rows(self.tokens[:, step], scores.shape[0]).to(scores.device)
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


def rel_l2(new: torch.Tensor, ref: torch.Tensor) -> float:
    """The shared rel-L2 (kernels_runtime.tolerances), inf where `new` is not finite."""
    return tolerances.rel_l2(new, ref) if torch.isfinite(new).all() else math.inf


@dataclass
class NoiseFloor:
    """Per-step precision noise floor of the unpatched model: rel-L2 of its teacher-forced logits vs a reference
    that differs only in rounding. per_step is None where no floor could be measured (note says why)."""

    per_step: list[float] | None
    method: str  # "float32 copy" | "float64 copy" | "perturbed weights" | "unavailable"
    note: str = ""

    @property
    def available(self) -> bool:
        return self.per_step is not None

    def describe(self) -> str:
        if not self.available:
            return f"floor unavailable ({self.note})"
        return (f"floor from {self.method}: min {min(self.per_step):.3g}, max {max(self.per_step):.3g} over "
                f"{len(self.per_step)} steps" + (f" ({self.note})" if self.note else ""))


def _is_oom(e: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(e, (oom, torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(e).lower()


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _model_dtype(model) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _upcast_logits(model, batch: dict, tokens: torch.Tensor, decode_len: int, wide: torch.dtype) -> list[torch.Tensor]:
    params = [p for p in model.parameters()]
    dev = params[0].device
    if dev.type == "cuda":  # deepcopy (narrow bytes) then upcast (wide bytes; freed narrow blocks may not be reused
        # by the caching allocator): refuse early where it cannot fit rather than fragment the model's memory
        need = sum(p.numel() * (p.element_size() + torch.finfo(wide).bits // 8) for p in params)
        free, _ = torch.cuda.mem_get_info(dev)
        if need * 1.1 > free:
            raise torch.cuda.OutOfMemoryError(f"an {wide} copy needs {need / 2**30:.1f} GiB, "
                                              f"{free / 2**30:.1f} GiB free")
    wide_model = None
    try:
        wide_model = copy.deepcopy(model).to(wide)
        return teacher_forced_logits(wide_model, batch, tokens, decode_len)
    finally:
        del wide_model
        _free_memory()


def _perturbed_logits(model, batch: dict, tokens: torch.Tensor, decode_len: int, seed: int = 0) -> list[torch.Tensor]:
    """The unpatched model again with every floating weight moved by a rounding-level amount: w -> round_dtype(
    fp32(w) x (1 + U(-eps/2, eps/2))), eps of the weight's dtype; the originals are kept on the host and restored."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for p in model.parameters():
                if not p.is_floating_point():
                    continue
                eps = torch.finfo(p.dtype).eps
                saved.append((p, p.detach().to("cpu", copy=True)))
                noise = (torch.rand(p.shape, generator=gen) * 2 - 1).mul_(eps / 2).add_(1.0)
                p.copy_((saved[-1][1].float() * noise).to(p.dtype))
        return teacher_forced_logits(model, batch, tokens, decode_len)
    finally:
        with torch.no_grad():
            for p, orig in saved:
                p.copy_(orig.to(p.device))
        _free_memory()


def noise_floor(model, batch: dict, tokens: torch.Tensor, decode_len: int,
                ref_logits: list[torch.Tensor] | None = None, *, method: str = "auto") -> NoiseFloor:
    """Per-step floor_t = rel_l2(model in its dtype, reference) over the teacher-forced logits (`tokens` forced).

    method "upcast": the reference is copy.deepcopy(model) in fp32 (fp64 for an fp32 model), freed after;
    "perturb": the reference is the model with its weights perturbed at rounding level (see _perturbed_logits);
    "auto": upcast, and perturb where the copy does not fit in memory. Never raises for lack of memory: returns
    an unavailable floor whose note says why."""
    if method not in ("auto", "upcast", "perturb"):
        raise ValueError(f"method: expected auto | upcast | perturb, got {method!r}")
    dtype = _model_dtype(model)
    if ref_logits is None:
        ref_logits = teacher_forced_logits(model, batch, tokens, decode_len)
    wide = torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32
    notes: list[str] = []

    def steps(other: list[torch.Tensor]) -> list[float] | None:
        vals = [rel_l2(r, o) for r, o in zip(ref_logits, other)]
        if len(other) != len(ref_logits) or not all(math.isfinite(v) for v in vals) or \
                not all(torch.isfinite(o).all() for o in other):
            notes.append("reference logits not finite or of another length")
            return None
        return vals

    if method in ("auto", "upcast"):
        try:
            per = steps(_upcast_logits(model, batch, tokens, decode_len, wide))
            if per is not None:
                return NoiseFloor(per, f"{str(wide).removeprefix('torch.')} copy", "; ".join(notes))
        except Exception as e:  # noqa: BLE001 - only memory errors are expected; anything else is reported too
            if not _is_oom(e):
                raise
            _free_memory()
            notes.append(f"{str(wide).removeprefix('torch.')} copy does not fit: {str(e).splitlines()[0][:160]}")
    if method in ("auto", "perturb"):
        try:
            per = steps(_perturbed_logits(model, batch, tokens, decode_len))
            if per is not None:
                return NoiseFloor(per, "perturbed weights", "; ".join(notes))
        except Exception as e:  # noqa: BLE001
            if not _is_oom(e):
                raise
            _free_memory()
            notes.append(f"perturbed run does not fit: {str(e).splitlines()[0][:160]}")
    return NoiseFloor(None, "unavailable", "; ".join(notes) or "no method")


@dataclass
class LogitsCheck:
    """The outcome of one in-model comparison. Iterates as (ok, err, detail) for older callers."""

    ok: bool
    err: float  # the deciding step's error (rel-L2, or max abs excess for logits_max_abs)
    detail: str  # for the Decision reason: names the metric and both numbers
    metric: str  # the metric actually applied
    step: int = -1  # the deciding step (highest err / limit)
    limit: float | None = None  # the deciding step's limit
    floor: float | None = None  # the deciding step's floor (logits_rel_l2_floor)
    summary: str = ""  # compact, for the acceptance row's metric field
    agreement: float | None = None  # accuracy_budget: free-running greedy token agreement, where measured

    def __iter__(self):
        return iter((self.ok, self.err, self.detail))


def compare_logits(ref: list[torch.Tensor], new: list[torch.Tensor], dtype: torch.dtype, cfg: AcceptSettings,
                   floor: NoiseFloor | list[float] | None = None) -> LogitsCheck:
    """Compare the patched (`new`) with the unpatched (`ref`) teacher-forced logits step by step under the configured
    metric; the deciding step is the one with the highest error / limit. NaN/Inf never pass."""
    metric = cfg.resolved_metric(dtype)
    tol = tolerance_for(dtype)
    fixed = cfg.tol_factor * tol.rtol
    if isinstance(floor, NoiseFloor):
        floor_note, floor = floor.note, floor.per_step
    else:
        floor_note = "not measured" if floor is None else ""
    if metric == "logits_rel_l2_floor" and floor is not None and len(floor) != len(ref):
        floor_note, floor = f"floor has {len(floor)} steps, logits {len(ref)}", None
    if len(ref) != len(new):
        return LogitsCheck(False, math.inf, f"{metric}: {len(new)} steps of logits, expected {len(ref)}", metric,
                           summary=f"{metric}: step count mismatch")
    worst = (-math.inf, 0.0, -1, None, None)  # (err / limit, err, step, limit, floor)
    for step, (r, n) in enumerate(zip(ref, new)):
        if not torch.isfinite(n).all():
            return LogitsCheck(False, math.inf, f"{metric}: step {step}: non-finite logits", metric, step,
                               summary=f"{metric}: non-finite")
        if metric == "logits_max_abs":
            err = float(((n.double() - r.double()).abs() - tol.rtol * r.double().abs()).max())
            limit, f_t = tol.atol, None
        else:
            err = rel_l2(n, r)
            f_t = floor[step] if (metric == "logits_rel_l2_floor" and floor is not None) else None
            limit = fixed if f_t is None or not math.isfinite(f_t) else max(fixed, cfg.floor_factor * f_t)
        ratio = err / limit if limit > 0 else (math.inf if err > 0 else 0.0)
        if ratio > worst[0]:
            worst = (ratio, err, step, limit, f_t)
    ratio, err, step, limit, f_t = worst
    ok = ratio <= 1.0
    if metric == "logits_rel_l2_floor" and floor is not None:
        detail = (f"{metric}: rel-L2 {err:.3g} vs floor {f_t:.3g} x {cfg.floor_factor:g} at step {step} "
                  f"(limit max({fixed:.3g}, {cfg.floor_factor * f_t:.3g}) = {limit:.3g})")
        summary = f"{metric}: rel-L2 {err:.3g} vs floor {f_t:.3g} x {cfg.floor_factor:g} (fixed {fixed:.3g})"
    elif metric == "logits_rel_l2_floor":
        detail = (f"{metric}: floor unavailable ({floor_note}), fixed limit applies: rel-L2 {err:.3g} at step "
                  f"{step} (limit {limit:.3g})")
        summary = f"{metric}: rel-L2 {err:.3g} vs fixed {limit:.3g} (floor unavailable)"
    elif metric == "logits_rel_l2":
        detail = f"{metric}: rel-L2 {err:.3g} at step {step} (limit {limit:.3g})"
        summary = f"{metric}: rel-L2 {err:.3g} vs fixed {limit:.3g}"
    else:
        detail = f"{metric}: max abs excess {err:.3g} at step {step} (atol {limit:.3g}, rtol {tol.rtol:g})"
        summary = f"{metric}: excess {err:.3g} vs atol {limit:.3g}"
    return LogitsCheck(ok, err, detail, metric, step, limit, f_t, summary)


@dataclass
class AcceptanceResult:
    decisions: list[Decision]
    bundle_dir: str | None
    baseline_ms: float | None
    final_ms: float | None
    metric: str  # the metric applied (auto resolved)
    timing: AcceptTiming  # a member is its string: "cuda" | "skipped: cpu"
    floor: list[float] | None = None  # per-step noise floor (logits_rel_l2_floor), None if not measured/unavailable
    floor_note: str = ""  # how the floor was measured, or why it is unavailable
    graphs: str = ""  # the decode-graphs decision and its numbers ("" when not asked for)
    graph_decision: Decision | None = None  # the same, gated like a patch (in-model logits, then delta); GPU only

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Run:
    """The workload as acceptance holds it: its model and inputs, the reference tokens and logits every trial is
    compared with, and the noise floor."""

    wl: Any
    script: Any
    model: Any
    batch: dict
    cfg: AcceptSettings
    tokens: torch.Tensor
    ref_logits: list[torch.Tensor]
    floor: NoiseFloor | None
    metric: str
    graphs: GraphPlan = GraphPlan()
    deadline: float | None = None  # Unix time: the run's time budget for acceptance (None: none)
    # Unix time by which a check that decides what the bundle serves ends (the regime's at its largest batch); later
    # than `deadline` (evaluation gives up its rounds for it); None: `deadline`
    bundle_deadline: float | None = None

    @property
    def on_gpu(self) -> bool:
        return self.wl.device.startswith("cuda")

    def out_of_time(self, need_s: float = 0.0) -> bool:
        """Whether `need_s` more seconds would end past the deadline."""
        return self.deadline is not None and time.time() + need_s > self.deadline

    def bundle_out_of_time(self, need_s: float) -> bool:
        """Whether a check of `need_s` seconds that decides the bundle's reach would end past bundle_deadline."""
        end = self.deadline if self.bundle_deadline is None else self.bundle_deadline
        return end is not None and time.time() + need_s > end

    def latency(self) -> float | None:
        from llm4llm.evaluate import measure

        if not self.on_gpu:
            return None
        return measure(self.model, self.wl, self.batch, self.script.run, repeats=self.cfg.repeats,
                       split=False).total_ms


def reference_run(wl, cfg: AcceptSettings):
    """The unpatched side that acceptance and the nightly re-validation compare a bundle to, built through the
    workload's own script: (script, model, batch, metric, greedy tokens, teacher-forced logits, the bf16-vs-fp32
    noise floor when the metric uses one, else None)."""
    from llm4llm.workload import call_script, load_script

    script = load_script(wl)
    model = call_script(script.build, wl)
    batch = call_script(script.inputs, wl)
    metric = cfg.resolved_metric(wl.torch_dtype)
    tokens, _ = reference_tokens(model, batch, wl.decode_len)
    ref_logits = teacher_forced_logits(model, batch, tokens, wl.decode_len)
    floor = noise_floor(model, batch, tokens, wl.decode_len, ref_logits) if metric == "logits_rel_l2_floor" else None
    return script, model, batch, metric, tokens, ref_logits, floor


def _prepare(workload_path: str, cfg: AcceptSettings, graphs: GraphPlan, deadline: float | None = None,
             bundle_deadline: float | None = None) -> _Run:
    from llm4llm.workload import load_workload

    wl = load_workload(workload_path)
    script, model, batch, metric, tokens, ref_logits, floor = reference_run(wl, cfg)
    if floor is not None:
        print(f"accept: {metric}: {floor.describe()}")
    return _Run(wl, script, model, batch, cfg, tokens, ref_logits, floor, metric, graphs, deadline, bundle_deadline)


def accept(workload_path: str, proposals: list[Proposal], bundle_dir: str, *, cfg: AcceptSettings | None = None,
           graphs: GraphPlan | None = None, run_id: str = "", base_bundle: str | None = None,
           deadline: float | None = None, journal: str | None = None,
           bundle_deadline: float | None = None) -> AcceptanceResult:
    """Greedy acceptance in order of expected impact, re-measuring after each accepted patch (patches interact).
    base_bundle: a bundle accepted earlier in this run (its patches and its decode-graphs decision): the trials
    start on top of it instead of the unpatched model, and the bundle written holds it plus what is accepted now.
    graphs: the run's CUDA-graph plan (default: none). deadline: Unix time, the run's time budget for acceptance.
    Past it, the interleaved rounds stop at MIN_ROUNDS, later trials are not tried, and a regime's check at its
    largest batch is not run when it would end past `bundle_deadline` (default `deadline`; the flow gives it
    evaluation's rounds too: the check decides what the bundle serves), and the bundle then keeps the buckets up to
    the workload's batch. The first trial of a run always runs: a run that ends without a bundle gave its user nothing.
    journal: a file each decision is appended to as it is made (JSON lines, Decision.from_json reads them back), for
    the caller to record before the step ends: a run stopped mid-step keeps what it decided. Each accepted trial
    also writes `bundle_dir` at once (`provisional`): a stopped step leaves the bundle accepted so far."""
    import kernels_runtime

    def record(d: Decision, echo: bool = True) -> None:
        if echo:
            print(decision_line(d))
        if journal:
            with open(journal, "a") as f:
                f.write(d.to_json() + "\n")

    cfg = cfg or AcceptSettings()
    r = _prepare(workload_path, cfg, graphs or GraphPlan(), deadline, bundle_deadline)
    current = baseline = r.latency()
    # the interleaved gate's baseline side: a weight-sharing copy that always carries the accepted bundle
    base_model = clone_sharing_weights(r.model) if r.on_gpu and cfg.interleave_rounds > 0 else None
    if base_bundle is not None:
        accepted, graph_decision, graphs_note, current = _start_from(r, base_bundle, base_model, current)
    else:
        accepted, graph_decision, graphs_note, current = _start_fresh(r, base_model, current)
    if graph_decision is not None:
        record(graph_decision, echo=False)  # its line was printed with its numbers
    graphs = accepted.decode_graphs
    decisions: list[Decision] = []
    for p, spec, impact in rank(proposals):
        if r.out_of_time() and (base_bundle is not None or any(d.decided_by not in UNTRIED for d in decisions)):
            decisions.append(Decision(spec.task_id, p.candidate_id, AcceptDecision.REJECTED,
                                      "not tried: the run's time budget ended before its trial (a longer "
                                      "--time-budget tries it)", r.metric, None, current, None, None, impact,
                                      decided_by=DecidedBy.TIME_BUDGET))
            record(decisions[-1])
            continue
        task_decisions, trial = _task_trials(r, p, spec, impact, accepted, current, base_model, run_id)
        decisions += task_decisions
        for d in task_decisions:
            record(d)
        last = task_decisions[-1]
        if trial is not None:
            accepted, current = trial, last.e2e_after_ms
            save_bundle(provisional(r, accepted), bundle_dir)  # what a step stopped from now on ships
            if base_model is not None:  # the baseline side now carries the new bundle
                kernels_runtime.revert(base_model)
                kernels_runtime.disable_decode_graphs(base_model)
                kernels_runtime.apply(base_model, accepted, strict=True)
        elif last.baseline_after_ms is not None:  # the latest measurement of the state the next trial starts from
            current = last.baseline_after_ms
    regime = _regime_gate(r, accepted, base_model, current) if accepted.patches else None
    if regime is not None:
        decisions.append(regime[0])
        record(regime[0])
        accepted = regime[1]
    bundle_path = None
    if accepted.patches or graphs:  # graphs alone are a deployable gain: a bundle with no kernel patches
        bundle_path = str(save_bundle(accepted, bundle_dir))
    return AcceptanceResult(decisions, bundle_path, baseline, current, r.metric,
                            AcceptTiming.CUDA if r.on_gpu else AcceptTiming.SKIPPED_CPU,
                            floor=r.floor.per_step if r.floor is not None else None,
                            floor_note=r.floor.describe() if r.floor is not None else "", graphs=graphs_note,
                            graph_decision=graph_decision)


def decision_line(d: Decision) -> str:
    """One decision as it is made, in the log and on the terminal: a run stopped later (a time limit, Ctrl-C)
    still shows what its finished trials decided and why."""
    return f"accept: {d.task_id} {d.candidate_id}: {d.decision} ({d.decided_by}): {d.reason[:400]}"


def _start_fresh(r: _Run, base_model, current: float | None):
    """The unpatched model, with decode graphs where their gate accepts them: (the empty bundle, the graphs'
    decision, its note, the latency the first trial starts from)."""
    import kernels_runtime

    plan = r.graphs
    graph_decision, graphs_note = None, ("" if not plan.decode_graphs else
                                         "decode graphs: not on the CPU (nothing is timed there)")
    if plan.decode_graphs and r.on_gpu:
        graph_decision, graphed = _graphs_gate(r, current)
        graphs_note = f"decode graphs {'on' if graph_decision.accepted else 'off'}: " \
                      f"{graph_decision.reason}"
        if graph_decision.accepted:
            current = graphed
            if base_model is not None:
                kernels_runtime.enable_decode_graphs(base_model, static_cache=plan.static_cache)
        print(f"accept: {graphs_note}")
    graphs = graph_decision is not None and graph_decision.accepted
    # a regime's decode batch buckets: every decode task was extracted and verified at each (Regime.points)
    buckets = list(r.wl.regime.batch_buckets()) if r.wl.regime is not None else []
    bundle = PatchBundle(name=f"{r.wl.name}", library_versions=library_versions(),
                         gpu=torch.cuda.get_device_name() if r.on_gpu else "cpu", decode_graphs=graphs,
                         static_cache=graphs and plan.static_cache, batch_buckets=buckets, **verified_on(r.model))
    return bundle, graph_decision, graphs_note, current


def _start_from(r: _Run, base_bundle: str, base_model, current: float | None):
    """The model as a bundle accepted earlier in this run leaves it (its decode-graphs decision stands): the same
    four values as _start_fresh, the latency measured with the bundle installed."""
    import kernels_runtime

    bundle = load_bundle(base_bundle)
    note = f"decode graphs {'on' if bundle.decode_graphs else 'off'}: as accepted earlier in this run"
    if r.on_gpu:
        current = _measure_as(r.model, bundle, r.latency)
        if base_model is not None:
            kernels_runtime.apply(base_model, bundle, strict=True)
    print(f"accept: starting from the bundle accepted earlier in this run ({len(bundle.patches)} patch(es)); {note}")
    return bundle, None, note, current


def _graphs_gate(r: _Run, current: float | None) -> tuple[Decision, float | None]:
    """Decode graphs, gated like a patch: the unpatched model with graphs, in-model logits, then delta. Returns the
    decision and the graphed latency; the model is left without graphs."""
    import kernels_runtime

    g = kernels_runtime.enable_decode_graphs(r.model, static_cache=r.graphs.static_cache)
    try:
        check = compare_logits(r.ref_logits, teacher_forced_logits(r.model, r.batch, r.tokens, r.wl.decode_len),
                               r.wl.torch_dtype, r.cfg, r.floor)
        graphed = r.latency()
        how = g.summary() + (", static KV cache" if r.graphs.static_cache else "")
    except Exception as e:  # an error with graphs rejects them (a sticky CUDA fault ends this process: isolated)
        check, graphed, how = None, None, f"runtime: {type(e).__name__}: {str(e)[:300]}"
    finally:
        kernels_runtime.disable_decode_graphs(r.model)
    return decide_graphs(check, current, graphed, how, r.cfg, static_cache=r.graphs.static_cache), graphed


def _task_trials(r: _Run, p: Proposal, spec: TaskSpec, impact: float, accepted: PatchBundle, current: float | None,
                 base_model, run_id: str) -> tuple[list[Decision], PatchBundle | None]:
    """One task's trials on top of the `accepted` bundle: one, or for a lossy candidate the coverage walk-down until
    one fits the workload's accuracy budget. Returns the decisions and, if the last was accepted, its bundle."""
    import kernels_runtime

    cfg, budget, lossy = r.cfg, r.wl.lossy_budget(), lossy_of(p)
    if lossy is not None and budget is None:  # never accepted without the workload's opt-in
        return [Decision(spec.task_id, p.candidate_id, AcceptDecision.REJECTED,
                         f"lossy candidate {lossy or '(by its source)'}: the workload has not opted in "
                         f"(allow_lossy = true and an [accuracy_budget])", r.metric, None, current, None, None,
                         impact, decided_by=DecidedBy.LOSSY_NOT_ALLOWED)], None
    skip = not_worth_a_trial(p, cfg, r.on_gpu)
    if skip:
        return [Decision(spec.task_id, p.candidate_id, AcceptDecision.REJECTED, skip, r.metric, None, current, None,
                         None, impact, decided_by=DecidedBy.NOT_TRIED)], None
    decisions = []
    for q in (lossy_descent(p, spec) if lossy is not None else [p]):
        trial = PatchBundle.from_json(accepted.to_json())
        for s in accepted.patches:
            trial.add_kernel(accepted.source(s.kernel))
        ps = patch_spec_for(q, spec, "cuda" if r.on_gpu else "cpu", run_id)
        if lossy is not None:
            ps.lossy = {**lossy_of(q), "budget": dict(budget)}
        trial.add_patch(ps, source=q.source)
        interleaved = None if base_model is None else (
            lambda: interleave(r.model, base_model, r.wl, r.batch, r.script.run, cfg.interleave_rounds, r.deadline))
        decision = _try(r.model, trial, spec, q, r.batch, r.tokens, r.ref_logits, r.wl, cfg, r.latency, current,
                        impact, floor=r.floor, rebaseline=lambda: _measure_as(r.model, accepted, r.latency),
                        interleaved=interleaved, budget=budget if lossy is not None else None)
        decisions.append(decision)
        kernels_runtime.revert(r.model)
        if decision.accepted:
            if lossy is not None:
                trial.patches[-1].lossy["measured"] = decision.lossy
            return decisions, trial
        if lossy is None or decision.decided_by != DecidedBy.IN_MODEL:
            break  # over the budget: the next lower coverage; anything else ends this task's trials
    return decisions, None


def _measure_as(model, bundle: PatchBundle, latency: Callable[[], float | None]) -> float | None:
    """End-to-end latency of `model` as `bundle` leaves it (its patches, its decode graphs); the model is left
    unpatched."""
    import kernels_runtime

    kernels_runtime.revert(model)
    try:
        if bundle.patches or bundle.decode_graphs:
            kernels_runtime.apply(model, bundle, strict=True)
        return latency()
    finally:
        kernels_runtime.revert(model)


GRAPHS_TASK = "decode-graphs"  # the acceptances row of the graph decision (task_id; candidate_id says which cache)
REGIME_TASK = "regime-largest-batch"  # the acceptances row of the check at a regime's largest decode batch


def _regime_gate(r: _Run, bundle: PatchBundle, base_model, current: float | None = None
                 ) -> tuple[Decision, PatchBundle] | None:
    """A serving regime's second gain check (the first is the representative point's, per patch): the accepted
    bundle against the model without its kernels (its decode graphs kept) at the regime's largest decode bucket,
    interleaved. A bundle measurably slower there (past delta) keeps the buckets up to the workload's batch only:
    larger batches fall back to the model's own forward (counted), the rest keep the kernels; so does a bundle
    whose check would end past the run's deadline (regime_check_s from `current`, the bundle's run time in ms at
    the workload's batch). None where there is nothing to check: on the CPU, without a regime, or when the largest
    bucket is the workload's own batch."""
    import kernels_runtime

    buckets = sorted(bundle.batch_buckets)
    if not r.on_gpu or r.wl.regime is None or not buckets or buckets[-1] <= r.wl.batch_size or base_model is None:
        return None
    from llm4llm.workload import call_script

    big = buckets[-1]
    need = regime_check_s(current, big, r.wl.batch_size)
    if r.bundle_out_of_time(need):
        kept = up_to(bundle, r.wl.batch_size)
        return Decision(REGIME_TASK, f"batch-{big}", AcceptDecision.REJECTED,
                        f"not checked: the run's time budget ends before the check at batch {big} (about "
                        f"{need:.0f} s): the bundle keeps batch buckets {kept.batch_buckets}, larger batches fall "
                        f"back (a longer --time-budget checks them)", "", None, None, None, None, 0.0,
                        decided_by=DecidedBy.TIME_BUDGET), kept
    wl = r.wl.model_copy(update={"batch_size": big})
    batch = call_script(r.script.inputs, wl)
    base = bundle.model_copy(update={"patches": []})
    for model, b in ((r.model, bundle), (base_model, base)):
        kernels_runtime.revert(model)
        kernels_runtime.disable_decode_graphs(model)
        if b.patches or b.decode_graphs:
            kernels_runtime.apply(model, b, strict=True)
    try:
        trials, bases = interleave(r.model, base_model, wl, batch, r.script.run,
                                   max(MIN_ROUNDS, r.cfg.interleave_rounds), r.deadline)
    except SlowTrial as e:  # decided on the warm-up runs: the bundle's fastest against the baseline's slowest
        trials, bases = [min(e.trial_ms)], [max(e.base_ms)]
        print(f"accept: at batch {big}: {e}")
    finally:
        for model in (r.model, base_model):
            kernels_runtime.revert(model)
    return regime_decision(bundle, big, r.wl.batch_size, trials, bases, r.cfg.delta)


def provisional(r: _Run, bundle: PatchBundle) -> PatchBundle:
    """What the step ships if it is stopped before its end: the bundle accepted so far, its batch buckets cut to the
    workload's batch while a regime's check at a larger batch is still to come (the step's end replaces it)."""
    buckets = sorted(bundle.batch_buckets)
    if r.wl.regime is not None and buckets and buckets[-1] > r.wl.batch_size:
        return up_to(bundle, r.wl.batch_size)
    return bundle


def regime_check_s(current_ms: float | None, big: int, own: int) -> float:
    """Seconds the regime's check at batch `big` is expected to take: its warm-up and MIN_ROUNDS interleaved runs of
    both sides, each as long as a run at the workload's batch (`current_ms`) scaled by the batch (an upper bound
    while decode streams the weights once a step). Unknown (no measurement): 0."""
    return 0.0 if current_ms is None else REGIME_RUNS * current_ms / 1e3 * big / max(own, 1)


def regime_decision(bundle: PatchBundle, big: int, own: int, trials: list[float], bases: list[float],
                    delta: float) -> tuple[Decision, PatchBundle]:
    """The decision of _regime_gate from its interleaved totals, and the bundle to ship (narrowed where rejected)."""
    gain, lo, hi = interleaved_gain(trials, bases)
    after, before = statistics.median(trials), statistics.median(bases)
    numbers = (f"at batch {big}: {after:.1f} ms with the bundle, {before:.1f} ms without its kernels "
               f"(gain {gain:+.2%}, p20-p80 {lo:+.2%}..{hi:+.2%}, {len(trials)} interleaved rounds)")
    if gain >= -delta:
        return Decision(REGIME_TASK, f"batch-{big}", "accepted", f"no loss {numbers}", "", None, before, after,
                        gain, 0.0, decided_by=DecidedBy.LATENCY), bundle
    kept = up_to(bundle, own)
    return Decision(REGIME_TASK, f"batch-{big}", "rejected",
                    f"slower past delta {delta:.0%} {numbers}: the bundle keeps batch buckets {kept.batch_buckets}, "
                    f"larger batches fall back", "", None, before, after, gain, 0.0, decided_by=DecidedBy.LATENCY), kept


def up_to(bundle: PatchBundle, own: int) -> PatchBundle:
    """The bundle serving batches up to `own` (the workload's batch, where its gain was measured) only."""
    return narrow_buckets(bundle, [b for b in bundle.batch_buckets if b <= own])


def narrow_buckets(bundle: PatchBundle, keep: list[int]) -> PatchBundle:
    """The bundle with its batch buckets, and every patch guard's, cut to `keep`."""
    patches = [p.model_copy(update={"guard": p.guard.model_copy(update={
        "batch_buckets": [b for b in p.guard.batch_buckets if b in keep]})}) if p.guard.batch_buckets else p
        for p in bundle.patches]
    return bundle.model_copy(update={"batch_buckets": list(keep), "patches": patches})


def decide_graphs(check: LogitsCheck | None, before: float, after: float | None, how: str, cfg: AcceptSettings, *,
                  static_cache: bool = False) -> Decision:
    """The decode-graphs gate, as for a patch: the unpatched model's teacher-forced logits with graphs (and the
    static cache, which changes the attention's padding) within the metric, then an end-to-end gain of at least
    delta. `check` None: the graphed run failed (`how` says how)."""
    cand = "cuda-graphs+static-cache" if static_cache else "cuda-graphs"

    def decision(verdict, by, reason, gain=None):
        return Decision(GRAPHS_TASK, cand, verdict, reason, check.summary if check is not None else "",
                        check.err if check is not None else None, before, after, gain, 0.0, {},
                        check.limit if check is not None else None, check.floor if check is not None else None,
                        decided_by=by)

    if check is None or after is None:
        return decision(AcceptDecision.REJECTED, DecidedBy.RUNTIME, how)
    if not check.ok:
        return decision(AcceptDecision.REJECTED, DecidedBy.IN_MODEL,
                        f"in-model correctness with graphs: {check.detail} ({how})")
    gain = (before - after) / before
    numbers = f"unpatched {before:.1f} ms without, {after:.1f} ms with ({how}); {check.detail}"
    if gain < cfg.delta:
        return decision(AcceptDecision.REJECTED, DecidedBy.LATENCY,
                        f"end-to-end gain {gain:+.2%} below delta {cfg.delta:.0%}: {numbers}", gain)
    return decision(AcceptDecision.ACCEPTED, DecidedBy.LATENCY, f"end-to-end gain {gain:+.2%}: {numbers}", gain)


# A trial whose faster warm-up run is over this many times the baseline's slower one (and a second longer) is
# decided on its warm-up runs, without rounds: drift between calls is 20-35 %, so no round can turn such a loss
# into a gain, and each of its runs may take a minute (a serving batch's first runs once took 30-60 s against 0.9 s),
# which would cost the run its acceptance.
SLOW_TRIAL_FACTOR, SLOW_TRIAL_MIN_MS = 3.0, 1000.0
# the interleaved rounds a gain is decided on even past the run's deadline; a regime's check at its largest batch
# costs REGIME_RUNS runs (two warm-ups of each side and MIN_ROUNDS rounds of two)
MIN_ROUNDS = 3
REGIME_RUNS = 4 + 2 * MIN_ROUNDS


class SlowTrial(Exception):
    """interleave(): the trial's warm-up runs were far slower than the baseline's (SLOW_TRIAL_FACTOR)."""

    def __init__(self, trial_ms: list[float], base_ms: list[float]):
        self.trial_ms, self.base_ms = trial_ms, base_ms
        super().__init__(f"the trial's warm-up runs took {_secs(trial_ms)}, the baseline's {_secs(base_ms)}: over "
                         f"{SLOW_TRIAL_FACTOR:g}x slower, no rounds timed")


def _secs(ms: list[float]) -> str:
    return ", ".join(f"{m / 1e3:.1f} s" for m in ms)


def interleave(trial_model, base_model, wl, batch, run_fn, rounds: int,
               deadline: float | None = None) -> tuple[list[float], list[float]]:
    """(trial ms, baseline ms) of `rounds` interleaved full runs, the order swapped every round (T B, B T, ...), after
    two warm-up runs of each (the second captures a prompt graph); past `deadline` (Unix time) the rounds end after
    MIN_ROUNDS. Raises SlowTrial, without rounds, where the trial's warm-up runs are both far slower than the
    baseline's."""
    from llm4llm.evaluate import _Slot
    from llm4llm.workload import script_stage

    trial, base = _Slot("trial", trial_model), _Slot("baseline", base_model)

    def run(s: _Slot) -> float:  # the heartbeat of a slow run names its side
        with script_stage(f"accept ({s.variant})"):
            return s.run_full(run_fn, wl, batch)

    warm: dict[str, list[float]] = {}
    for s in (trial, base):
        for i in range(2):
            warm.setdefault(s.variant, []).append(run(s))
            # what the run did, counted so far: a slow side shows here whether its graphs re-captured or refused,
            # or its kernels fell back, while the run is in the log before any round
            print(f"accept: warm-up {s.variant} {i + 1}: {warm[s.variant][-1] / 1e3:.1f} s; {side_counts(s.model)}")
    # where a slow trial's time goes (a first run that compiles or captures), before the rounds are timed
    print("accept: warm-up runs: " + "; ".join(f"{k} {_secs(v)}" for k, v in warm.items()))
    fast, slow = min(warm["trial"]), max(warm["baseline"])
    if fast > SLOW_TRIAL_FACTOR * slow and fast - slow > SLOW_TRIAL_MIN_MS:
        raise SlowTrial(warm["trial"], warm["baseline"])
    for r in range(rounds):
        if r >= MIN_ROUNDS and deadline is not None and time.time() > deadline:
            print(f"accept: the run's time budget ended the interleaved rounds after {r} of {rounds}")
            break
        for s in ((trial, base) if r % 2 == 0 else (base, trial)):
            s.totals.append(run(s))
    return trial.totals, base.totals


def side_counts(model) -> str:
    """The decode graphs' summary and the patches' kernel calls and fallbacks (by reason) of `model`, so far."""
    import kernels_runtime

    g = kernels_runtime.decode_graphs_of(model)
    kernel, fallback = 0, Counter()
    for c in kernels_runtime.report_of(model).values():
        kernel += sum(c["kernel"].values())
        fallback.update(c["fallback"])
    falls = "; ".join(f"{why} x{n}" for why, n in fallback.most_common(3))
    from kernels_runtime.ops._common import compiled_launches

    # compiled kernel specializations held by the runtime's launcher cache: a count that grows run after run is
    # a kernel argument that specializes per call (a compile or cache load each time)
    return (f"decode graphs: {g.summary() if g is not None else 'off'}; kernel calls {kernel}, fallbacks "
            f"{sum(fallback.values())}" + (f" ({falls})" if falls else "")
            + f"; compiled launches {compiled_launches()}")


def interleaved_gain(trials: list[float], bases: list[float]) -> tuple[float, float, float]:
    """Median, p20 and p80 of the per-round gains 1 - trial / baseline."""
    from llm4llm.evaluate import quantile

    gains = [1 - t / b for t, b in zip(trials, bases)]
    return statistics.median(gains), quantile(gains, 0.2), quantile(gains, 0.8)


@dataclass
class _Trial:
    """What every gate of one trial reads, and the baseline measurements the latency gates update: `before` (the
    model without the trial, as last measured) and `again` (measured again around the trial)."""

    model: Any
    bundle: PatchBundle
    spec: TaskSpec
    p: Proposal
    batch: dict
    tokens: torch.Tensor
    ref_logits: list[torch.Tensor]
    wl: Any
    cfg: AcceptSettings
    impact: float
    floor: NoiseFloor | None
    budget: dict | None
    before: float | None
    again: float | None = None

    def reject(self, by: DecidedBy, reason: str, check: LogitsCheck | None = None, after: float | None = None,
               gain: float | None = None, counters: dict | None = None) -> Decision:
        return self._decide(AcceptDecision.REJECTED, by, reason, check, after, gain, counters)

    def accept(self, reason: str, check: LogitsCheck, after: float, gain: float, counters: dict) -> Decision:
        """Only the latency gate, the last, accepts."""
        return self._decide(AcceptDecision.ACCEPTED, DecidedBy.LATENCY, reason, check, after, gain, counters)

    def _decide(self, decision: AcceptDecision, by: DecidedBy, reason: str, check: LogitsCheck | None,
                after: float | None, gain: float | None, counters: dict | None) -> Decision:
        measured = None if self.budget is None or check is None else {"max_logit_deviation": check.err,
                                                                       "token_agreement": check.agreement}
        return Decision(self.spec.task_id, self.p.candidate_id, decision, reason,
                        check.summary if check is not None else self.cfg.resolved_metric(self.wl.torch_dtype),
                        check.err if check is not None else None, self.before, after, gain, self.impact,
                        counters or {}, check.limit if check is not None else None,
                        check.floor if check is not None else None, baseline_after_ms=self.again, lossy=measured,
                        decided_by=by)


def _try(model, bundle, spec, p, batch, tokens, ref_logits, wl, cfg, latency, current, impact,
         floor: NoiseFloor | None = None, rebaseline: Callable[[], float | None] | None = None,
         interleaved: Callable[[], tuple[list[float], list[float]]] | None = None,
         budget: dict | None = None) -> Decision:
    """One trial: apply `bundle` to `model` (the caller reverts), then its gates in order, the first refusal
    deciding: in-model logits against `ref_logits`, the trial's kernel ran in-model, greedy tokens (where asked),
    then the latency gate, interleaved (`interleaved`) or bracketed by the baseline measured again right after the
    trial (`latency()` returns None on the CPU: never accepts)."""
    import kernels_runtime

    t = _Trial(model, bundle, spec, p, batch, tokens, ref_logits, wl, cfg, impact, floor, budget, current)
    t0 = time.perf_counter()
    try:
        report = kernels_runtime.apply(model, bundle, strict=True)  # bundle.decode_graphs: as the baseline ran
        t1 = time.perf_counter()
        new_logits = teacher_forced_logits(model, batch, tokens, wl.decode_len)
        if wl.device.startswith("cuda"):
            torch.cuda.synchronize()
    except Exception as e:  # runtime validity: a CUDA error or a kernel failure under the model's own allocator
        return t.reject(DecidedBy.RUNTIME, f"runtime: {type(e).__name__}: {str(e)[:300]}")
    print(f"accept: {p.candidate_id}: applied in {t1 - t0:.1f} s, its teacher-forced logits in "
          f"{time.perf_counter() - t1:.1f} s; {side_counts(model)}")
    counters = report.totals()
    if budget is not None:  # a lossy trial answers to the workload's accuracy budget, not to the noise floor
        check = budget_check(ref_logits, new_logits, budget,
                             lambda: token_agreement(model, batch, tokens, wl.decode_len))
    else:
        check = compare_logits(ref_logits, new_logits, wl.torch_dtype, cfg, floor)
    for gate in (_correct_gate, _kernel_ran_gate, _tokens_gate):
        refused = gate(t, report, check, counters)
        if refused is not None:
            return refused
    if interleaved is not None:
        return _interleaved_gate(t, interleaved, check, counters)
    return _bracketed_gate(t, latency, current, rebaseline, check, counters)


def _correct_gate(t: _Trial, report, check: LogitsCheck, counters: dict) -> Decision | None:
    if not check.ok:
        return t.reject(DecidedBy.IN_MODEL, f"in-model correctness: {check.detail}", check, counters=counters)
    return None


def _kernel_ran_gate(t: _Trial, report, check: LogitsCheck, counters: dict) -> Decision | None:
    """The trial's patch is the bundle's last (the rest were accepted). The report's totals count those too: a
    patch whose module another patch's kernel replaces (the mixer under an accepted block kernel) runs 0 times, and
    its "gain" would be the baseline's noise."""
    if report.calls_of(t.bundle.patches[-1].patch_id) == 0:
        return t.reject(DecidedBy.SHAPE_COVERAGE, f"shape coverage: this candidate's kernel never ran in-model (its "
                                                  f"calls fell back or another patch's kernel took them: "
                                                  f"{report.counters()})", check, counters=counters)
    return None


def _tokens_gate(t: _Trial, report, check: LogitsCheck, counters: dict) -> Decision | None:
    if t.cfg.check_tokens:
        forced_free, _ = reference_tokens(t.model, t.batch, t.wl.decode_len)
        if not torch.equal(forced_free, t.tokens):
            return t.reject(DecidedBy.TOKENS, "greedy tokens differ from the unpatched model", check,
                            counters=counters)
    return None


def _with_graphs(t: _Trial, detail: str) -> str:
    import kernels_runtime

    g = kernels_runtime.decode_graphs_of(t.model)  # what the graphs did (a refusal: every decode step ran eagerly)
    return detail if g is None else f"{detail}; decode graphs: {g.summary()}"


def _interleaved_gate(t: _Trial, interleaved: Callable[[], tuple[list[float], list[float]]], check: LogitsCheck,
                      counters: dict) -> Decision:
    """The trial and the baseline (a weight-sharing copy carrying the accepted bundle) in alternating rounds: the
    median per-round gain must reach delta."""
    try:
        trials, bases = interleaved()
    except SlowTrial as e:
        after, t.before = min(e.trial_ms), max(e.base_ms)
        t.again = t.before
        return t.reject(DecidedBy.LATENCY, f"end-to-end: {e}; {_with_graphs(t, check.detail)}", check, after,
                        1 - after / t.before, counters)
    except Exception as e:  # noqa: BLE001 - a failure while timing costs this candidate only
        return t.reject(DecidedBy.RUNTIME, f"runtime (interleaved timing): {type(e).__name__}: {str(e)[:300]}",
                        check, counters=counters)
    gain, lo, hi = interleaved_gain(trials, bases)
    t.before = t.again = statistics.median(bases)
    after = statistics.median(trials)
    how = (f"median of {len(trials)} interleaved rounds {gain:+.2%} (p20 {lo:+.2%}, p80 {hi:+.2%}); baseline "
           f"{t.before:.1f} ms ({min(bases):.1f}-{max(bases):.1f}), trial {after:.1f} ms "
           f"({min(trials):.1f}-{max(trials):.1f})")
    detail = _with_graphs(t, check.detail)
    if gain < t.cfg.delta:
        return t.reject(DecidedBy.LATENCY, f"end-to-end gain {how} below delta {t.cfg.delta:.0%}; {detail}", check,
                        after, gain, counters)
    return t.accept(f"end-to-end gain {how}; {detail}", check, after, gain, counters)


def _bracketed_gate(t: _Trial, latency: Callable[[], float | None], current: float | None,
                    rebaseline: Callable[[], float | None] | None, check: LogitsCheck, counters: dict) -> Decision:
    """The trial timed once, judged against the mean of the baseline before it (`current`) and measured again right
    after it (`rebaseline()`); it must gain at least delta and at least the baseline's drift between the two (a
    baseline taken minutes earlier would decide trials on the host's drift). A drift above delta gets `noisy_rounds`
    more (trial, baseline) pairs, and the median bracketed gain decides against delta."""
    after = latency()
    detail = _with_graphs(t, check.detail)
    if after is None:
        return t.reject(DecidedBy.LATENCY_SKIPPED, f"latency gate skipped on the CPU: no CPU timing may accept a "
                                                   f"patch (in-model correctness ok: {detail})", check,
                        counters=counters)
    cfg, bracket, need, gain = t.cfg, "", t.cfg.delta, None
    if rebaseline is not None and current is not None:
        t.again = rebaseline()
        if t.again is not None:
            drift = abs(t.again - current) / min(t.again, current)
            t.before = (current + t.again) / 2
            need = max(cfg.delta, drift)
            bracket = f" (baseline {current:.1f} ms before, {t.again:.1f} ms after the trial: drift {drift:.1%})"
            if drift > cfg.delta and cfg.noisy_rounds > 0:
                base, trials = [current, t.again], [after]
                try:
                    for _ in range(cfg.noisy_rounds):  # trial, baseline, trial, baseline ...
                        trials.append(_measure_as(t.model, t.bundle, latency))
                        base.append(rebaseline())
                except Exception as e:  # noqa: BLE001 - it ran once already: a failure now costs this candidate only
                    return t.reject(DecidedBy.RUNTIME, f"runtime (measuring a noisy bracket again): "
                                                       f"{type(e).__name__}: {str(e)[:300]}", check, counters=counters)
                if all(x is not None for x in trials + base):  # the median bracketed gain decides, against delta
                    gains = [1 - x / ((b0 + b1) / 2) for x, b0, b1 in zip(trials, base, base[1:])]
                    gain, need = statistics.median(gains), cfg.delta
                    t.before, after, t.again = statistics.median(base), statistics.median(trials), base[-1]
                    bracket = (f" (median of {len(gains)} bracketed gains {', '.join(f'{g:+.1%}' for g in gains)}: "
                               f"the baseline drifted {drift:.1%} around the first trial; baselines "
                               f"{', '.join(f'{b:.1f}' for b in base)} ms, trials "
                               f"{', '.join(f'{x:.1f}' for x in trials)} ms)")
    if gain is None:
        gain = (t.before - after) / t.before
    if gain < need:
        below = f"delta {cfg.delta:.0%}" if need == cfg.delta else f"the baseline's drift {need:.1%}"
        return t.reject(DecidedBy.LATENCY, f"end-to-end gain {gain:+.2%}{bracket} below {below}; {detail}", check,
                        after, gain, counters)
    return t.accept(f"end-to-end gain {gain:+.2%}{bracket}; {detail}", check, after, gain, counters)
