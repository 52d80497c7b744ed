"""The run's plan: which extracted tasks to search, in what order, with how many trials, inside one time budget.

A user runs `llm4llm optimize W.toml` with no flags and waits for one result. The planner ranks targets as the
paper's loop and AutoKernel-style tools do, by Amdahl's law: the expected end-to-end saving of a task is its share of
the workload's time (hotspot score = phase weight x the task's share of that phase, summed over its instances) times
(1 - 1 / the speedup its family usually reaches in that phase). Then:

- a task whose instances all sit inside a module that is searched whole is not a target of its own (the parent's
  kernel replaces it); it becomes one only if the parent finds nothing or is rejected in the model (`children_of`);
- a task whose saving, even at its family's usual speedup, is below the acceptance bar delta cannot be accepted and
  is not searched;
- the search gets what the budget leaves after the stages that follow it (acceptance and evaluation, estimated from
  the workload's own run time or from the last run of this workload), split over the targets by expected saving, so
  the task with the most to win gets the most trials; a task stops early when its best candidate is near the
  physical floor (bytes / HBM bandwidth) or its share of the time is spent.

Nothing here runs anything or touches a database: flows/ and tasks/ hand in the extracted tasks, the history and
the clock, and store the plan this returns.
"""
from __future__ import annotations

import math
import re
import statistics
import time
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Iterable

from llm4llm.outcomes import PlanAction, PlanWhy

# when the user's command started (Unix time): a run's budget counts from there, start-up included (the CLI sets it)
RUN_STARTED: ContextVar[float | None] = ContextVar("llm4llm_run_started", default=None)

DEFAULT_TIME_BUDGET_S = 480.0  # what `optimize` spends when no --time-budget is given: 8 minutes on one GPU

# The speedup a family's best candidate usually reaches in its task (in-context timing, graph replay for decode),
# before this database has its own: the median of every search's best in the project's recorded GPU runs
# (built-in proposer; docs/hardware.md). decoder_layer/decode: 222 -> 68 us (qwen3-4b), 177 -> 63 (Llama-3.2-3B),
# 215 -> 124 (llama-2-7b). mlp/decode is below 1 there (cuBLAS' GEMV is hard to beat alone): the planner does not
# search it unless this database has seen it win.
PRIOR_SPEEDUP: dict[tuple[str, str], float] = {
    ("decoder_layer", "decode"): 2.8, ("decoder_layer", "prefill"): 1.2,
    ("attention", "decode"): 1.32, ("attention", "prefill"): 1.63,
    ("mlp", "decode"): 0.77, ("mlp", "prefill"): 1.35,
    ("norm", "decode"): 5.57, ("norm", "prefill"): 3.06,
    ("rotary", "decode"): 1.3, ("rotary", "prefill"): 1.3,
    ("lm_head", "decode"): 1.1, ("lm_head", "prefill"): 1.0,
    ("ssm_mixer", "decode"): 2.42, ("ssm_mixer", "prefill"): 33.3,
    ("ssm_block", "decode"): 4.67, ("ssm_block", "prefill"): 26.2,
    ("recurrent_block", "decode"): 2.34, ("recurrent_block", "prefill"): 55.4,
    ("conv", "decode"): 1.5, ("conv", "prefill"): 1.5,
}
DEFAULT_SPEEDUP = 1.3  # a family with no measurement at all

NEAR_FLOOR = 1.2  # a task whose best candidate is within this factor of its physical floor stops searching
# ... and one whose last PLATEAU_TRIALS trials did not improve its best by PLATEAU_GAIN (qwen3-4b
# once reached 2.60x at trial 1 and 2.61x at trial 9 of 15: four minutes for 0.4 %)
PLATEAU_TRIALS = 6
PLATEAU_GAIN = 0.01
MIN_TRIALS = 2  # a searched task gets at least this many trials (a template's default, then one seed)
MAX_TRIALS = 15  # and at most this many (the former fixed budget)

# Seconds, before this workload has a run of its own to go by. Measured on a GPU host (qwen3-4b, llama-2-7b,
# Llama-3.2-3B: acceptance 66-112 s for a 2.3-4.6 s run; evaluation's set-up and torch.compile 85-148 s;
# docs/hardware.md) and on a 2-core CPU (tiny workloads: a trial 10-20 s under Triton's interpreter).
TRIAL_S = {"cuda": 32.0, "cpu": 15.0}
PER_BATCH_S = 20.0  # a verification's extra seconds for each further decode batch a task's cases hold
ACCEPT_FIXED_S = {"cuda": 20.0, "cpu": 15.0}
ACCEPT_PER_RUN = {"cuda": 20.0, "cpu": 10.0}  # x the workload's eager run time
EVALUATE_FIXED_S = {"cuda": 75.0, "cpu": 20.0}  # model build, warm-ups, torch.compile's compile
EVALUATE_PER_RUN = {"cuda": 12.0, "cpu": 12.0}
MIN_EVALUATE_ROUNDS_S = {"cuda": 30.0, "cpu": 10.0}  # the interleaved rounds: at least a few of them
SAFETY = 0.05  # of the budget, kept back for what no estimate covers (start-up, writing rows)


def parse_duration(text: str | float | int | None) -> float | None:
    """'8m', '90s', '1h', '1h30m', '600' (seconds) -> seconds; 'off', 'none', '0' -> None (no time budget)."""
    if text is None:
        return None
    if isinstance(text, (int, float)):
        return float(text) if text > 0 else None
    s = str(text).strip().lower()
    if s in ("off", "none", "0", ""):
        return None
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return float(s) if float(s) > 0 else None
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([hms])", s)
    if not parts or "".join(n + u for n, u in parts) != s.replace(" ", ""):
        raise ValueError(f"expected a duration such as 8m, 90s, 1h30m or off, got {text!r}")
    total = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)
    return total if total > 0 else None


def fmt_s(seconds: float | None) -> str:
    """90 -> '1:30'; None -> '-'."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}:{seconds % 60:02d}"


@dataclass
class TaskView:
    """What the planner reads of an extracted task (an entry of the run's tasks.json)."""

    task_id: str
    family: str
    phase: str
    instances: list[str]
    score: float
    time_ms: float = 0.0
    deployable: bool = True
    reason: str = ""
    artifact_path: str | None = None
    batches: int = 1  # the batch sizes its captured cases hold (a serving regime's decode task: every bucket)

    @classmethod
    def of(cls, entry: dict) -> "TaskView":
        return cls(task_id=entry["task_id"], family=entry["family"], phase=entry["phase"],
                   instances=list(entry.get("instances") or []), score=float(entry.get("hotspot_score", 0.0)),
                   time_ms=float(entry.get("time_ms") or 0.0), deployable=bool(entry.get("deployable", True)),
                   reason=entry.get("reason") or "", artifact_path=entry.get("artifact_path"),
                   batches=_batch_sizes(entry))


def _batch_sizes(entry: dict) -> int:
    """How many batch sizes (dim 0 of the first input) an index entry's cases hold, as TaskSpec.batches counts."""
    names = entry.get("input_names") or []
    shapes = [((c.get("inputs") or {}).get(names[0]) or {}).get("shape") for c in entry.get("cases") or []] \
        if names else []
    return max(1, len({s[0] for s in shapes if s}))


@dataclass
class PlanItem:
    """One task's place in the plan. action: search | skip | fallback (searched only if `parent` fails); `why` is
    what code reads of the reason, `reason` says it in words."""

    task_id: str
    family: str
    phase: str
    score: float
    speedup: float  # the speedup the planner expects of its best candidate
    saving: float  # expected end-to-end saving, a fraction of the workload's time
    action: PlanAction
    reason: str
    trials: int = 0
    parent: str | None = None
    artifact_path: str | None = None
    why: PlanWhy | None = None

    def decide(self, action: PlanAction, why: PlanWhy, reason: str) -> None:
        self.action, self.why, self.reason = action, why, reason

    @property
    def negligible(self) -> bool:
        """A skipped task under 0.01 % of the time, not skipped for being undeployable: the plan's long tail."""
        return self.action == PlanAction.SKIP and self.saving < 1e-4 and self.why != PlanWhy.NOT_DEPLOYABLE

    def row(self, run_id: str, rank: int) -> dict:
        return {"run_id": run_id, "rank": rank,
                **{k: v for k, v in asdict(self).items() if k not in ("artifact_path", "why")}}


@dataclass
class Estimates:
    """Seconds the planner expects each later stage to take (`source` says whence: defaults or an earlier run)."""

    trial_s: float
    accept_s: float
    evaluate_s: float
    source: str = "defaults"
    # the part of evaluate_s that is its interleaved rounds: what evaluation gives up first (it runs at least one
    # round), so acceptance, whose decisions are the bundle a user ships, may spend it (flows/optimize.py)
    evaluate_rounds_s: float = 0.0


@dataclass
class Plan:
    items: list[PlanItem]
    budget_s: float | None
    search_s: float | None
    estimates: Estimates
    notes: list[str] = field(default_factory=list)
    later: tuple[str, ...] = ("accept", "evaluate")  # the stages after the search that the budget keeps time for

    def targets(self) -> list[PlanItem]:
        return [i for i in self.items if i.action == PlanAction.SEARCH]

    def expected_saving(self) -> float:
        return sum(i.saving for i in self.targets())

    def lines(self, elapsed_s: float = 0.0, targets_only: bool = False) -> list[str]:
        """The plan as a person reads it at the start of the search (also the run's log); targets_only: the head
        and the targets (a plan made again after an acceptance step)."""
        est = self.estimates
        head = (f"plan: {len(self.targets())} task(s) to search, expected end-to-end saving "
                f"{self.expected_saving():.1%}")
        if self.budget_s is not None:
            kept = "".join(f", {name} ~{fmt_s(s)}" for stage, name, s in (
                ("accept", "acceptance", est.accept_s), ("evaluate", "evaluation", est.evaluate_s))
                if stage in self.later)
            head += (f"; budget {fmt_s(self.budget_s)} (spent {fmt_s(elapsed_s)}: search {fmt_s(self.search_s)}"
                     f"{kept}; a trial ~{est.trial_s:.0f} s, from {est.source})")
        out = [head]
        for i in self.items:
            if targets_only and i.action != PlanAction.SEARCH:
                continue
            if i.negligible:
                continue  # the long tail of negligible tasks: counted below
            what = f"{i.trials} trials" if i.action == PlanAction.SEARCH else i.action
            out.append(f"  {what:>10}  {i.task_id:<40} score {i.score:.3f}  x{i.speedup:.2f} -> "
                       f"{i.saving:6.2%}  {i.reason}")
        tail = sum(1 for i in self.items if i.negligible)
        if tail and not targets_only:
            out.append(f"  {'skip':>10}  {tail} more task(s) under 0.01 % of the time each")
        out += [f"  note: {n}" for n in self.notes]
        over = self.overrun_note(elapsed_s)
        return out + ([f"  note: {over}"] if over and not targets_only else [])

    def overrun_note(self, elapsed_s: float) -> str | None:
        """Where the stages after the search are expected to end past the budget (a 7B serving regime's check and
        acceptance can spend it before evaluation starts): said at plan time, with the budget that would fit them,
        so nobody learns it from the clock at the end. None when they fit (or there is no budget)."""
        if self.budget_s is None:
            return None
        est = self.estimates
        end = elapsed_s + self.search_s + sum(s for stage, s in (("accept", est.accept_s),
                                                                  ("evaluate", est.evaluate_s)) if stage in self.later)
        if end <= self.budget_s * (1 + SAFETY):
            return None
        fits = math.ceil(end / 60)
        return (f"expected to end near {fmt_s(end)}, past the {fmt_s(self.budget_s)} budget: what is left of it cannot "
                f"hold acceptance and evaluation (the second may be cut to one round or skip its last points); "
                f"--time-budget {fits}m fits them")


# ---- expected speedups --------------------------------------------------------------------------------------

def expected_speedup(family: str, phase: str, history: dict[tuple[str, str], float] | None = None) -> float:
    """This database's median best for the family and phase when it has one, else the measured prior."""
    if history and (family, phase) in history:
        return float(history[(family, phase)])
    return PRIOR_SPEEDUP.get((family, phase), DEFAULT_SPEEDUP)


def saving_of(score: float, speedup: float) -> float:
    """Amdahl: the fraction of the workload's time saved when a task of this share runs `speedup` times faster."""
    return max(0.0, score * (1.0 - 1.0 / speedup)) if speedup > 0 else 0.0


# ---- nesting ------------------------------------------------------------------------------------------------

def _inside(path: str, parents: Iterable[str]) -> bool:
    return any(path.startswith(p + ".") for p in parents)


def covered_fraction(child: TaskView, parent_instances: list[str]) -> float:
    """The share of a task's instances that sit inside one of `parent_instances` (a module searched whole)."""
    if not child.instances:
        return 0.0
    return sum(_inside(p, parent_instances) for p in child.instances) / len(child.instances)


def children_of(parent: TaskView, tasks: list[TaskView]) -> list[TaskView]:
    """The tasks of the same phase nested in `parent`'s instances (searched only if the parent fails)."""
    return [t for t in tasks if t.task_id != parent.task_id and t.phase == parent.phase
            and covered_fraction(t, parent.instances) > 0]


# ---- the plan -----------------------------------------------------------------------------------------------

def rank_tasks(tasks: list[TaskView], *, delta: float, history: dict | None = None,
               covers: dict[str, bool] | None = None, excluded: Iterable[str] = (), searched: Iterable[str] = (),
               families: list[str] | None = None, phases: list[str] | None = None,
               top: int | None = None) -> list[PlanItem]:
    """Every task with its action and reason, targets first by expected saving.

    covers: task id -> whether a built-in template computes what it does (the applicability check); a task missing
    from it is taken as covered (the check runs before its search). excluded: tasks searched whole that failed or
    were rejected (their children then count in full). searched: tasks this run searched already (they still
    stand for the modules inside them). families / phases: the user's filters. top: the user's cap on targets (with
    it, nesting and the delta bar do not apply: the N hottest covered tasks, as asked)."""
    covers, excluded, searched = covers or {}, set(excluded), set(searched)
    items: list[PlanItem] = []
    chosen: list[TaskView] = []
    if top is not None:  # the N hottest, as asked
        ranked = sorted(tasks, key=lambda t: t.score, reverse=True)
    else:
        ranked = sorted(tasks, key=lambda t: saving_of(t.score, expected_speedup(t.family, t.phase, history)),
                        reverse=True)
    for t in ranked:
        s = expected_speedup(t.family, t.phase, history)
        item = PlanItem(t.task_id, t.family, t.phase, t.score, s, saving_of(t.score, s), PlanAction.SKIP, "",
                        artifact_path=t.artifact_path)
        items.append(item)
        skip = PlanAction.SKIP
        if not t.deployable:
            item.decide(skip, PlanWhy.NOT_DEPLOYABLE, f"not deployable: {t.reason[:120]}")
        elif families and t.family not in families:
            item.decide(skip, PlanWhy.FAMILY_NOT_ASKED, "family not asked for (--family)")
        elif phases and t.phase not in phases:
            item.decide(skip, PlanWhy.PHASE_NOT_ASKED, "phase not asked for (--phase)")
        elif t.task_id in excluded:
            item.decide(skip, PlanWhy.NOTHING_ACCEPTED, "searched whole: nothing accepted")
        elif t.task_id in searched:
            item.decide(PlanAction.SEARCHED, PlanWhy.SEARCHED, "searched earlier in this run")
            chosen.append(t)
        elif covers.get(t.task_id) is False:
            item.decide(skip, PlanWhy.NOT_COVERED, "no built-in template computes what it does (not covered)")
        elif top is not None:
            if len(chosen) < top:
                item.decide(PlanAction.SEARCH, PlanWhy.IN_TOP, f"among the top {top} asked for")
                chosen.append(t)
            else:
                item.decide(skip, PlanWhy.BEYOND_TOP, f"beyond the top {top}")
        else:
            _decide(item, t, chosen, delta)
    # targets first (in order of saving), then the fall-backs, then what is skipped
    order = {a: k for k, a in enumerate(PlanAction)}
    return sorted(items, key=lambda i: (order[i.action], -(i.score if top is not None else i.saving)))


def _decide(item: PlanItem, t: TaskView, chosen: list[TaskView], delta: float) -> None:
    """The default rule for one covered, deployable task (chosen: the targets so far, more valuable first)."""
    parents = [c for c in chosen if c.phase == t.phase and covered_fraction(t, c.instances) > 0]
    outside = 1.0 - max((covered_fraction(t, c.instances) for c in parents), default=0.0)
    if parents and outside <= 0.05:
        item.parent = parents[0].task_id
        item.decide(PlanAction.FALLBACK, PlanWhy.INSIDE_TARGET,
                    f"inside {parents[0].task_id}, searched whole; searched only if that fails")
        return
    item.saving *= outside
    if item.speedup <= 1.0:
        item.decide(PlanAction.SKIP, PlanWhy.FAMILY_LOSES,
                    f"its family usually loses to the library here (x{item.speedup:.2f})")
    elif item.saving < delta:
        item.decide(PlanAction.SKIP, PlanWhy.BELOW_DELTA,
                    f"at most {item.saving:.2%} end to end, below delta {delta:.0%}")
    else:
        item.decide(PlanAction.SEARCH, PlanWhy.EXPECTED_SAVING,
                    "largest expected saving" if not chosen else "expected saving")
        chosen.append(t)


def split_trials(targets: list[PlanItem], search_s: float | None, trial_s: float, budget: int | None) -> None:
    """Trials per target, in proportion to expected saving (at least MIN_TRIALS, at most MAX_TRIALS or the user's
    --budget). Without a time budget every target gets `budget` (or MAX_TRIALS)."""
    cap = budget if budget is not None else MAX_TRIALS
    if search_s is None:
        for t in targets:
            t.trials = cap
        return
    total = max(0, int(search_s // max(trial_s, 1e-3)))
    weight = sum(t.saving for t in targets) or 1.0
    for t in targets:
        share = total * (t.saving / weight) if weight else total / max(len(targets), 1)
        t.trials = max(min(MIN_TRIALS, cap), min(cap, int(round(share))))


def estimates_for(device: str, run_s: float, past: dict[str, float] | None = None) -> Estimates:
    """Later stages' seconds: from this workload's last run on the same device kind when `past` has them (stage ->
    seconds; trial -> seconds a trial), else from the workload's eager run time (`run_s`, its profiled
    prefill + decode) and the measured defaults above."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    est = Estimates(trial_s=TRIAL_S[kind],
                    accept_s=ACCEPT_FIXED_S[kind] + ACCEPT_PER_RUN[kind] * run_s,
                    evaluate_s=EVALUATE_FIXED_S[kind] + EVALUATE_PER_RUN[kind] * run_s + MIN_EVALUATE_ROUNDS_S[kind])
    est.evaluate_rounds_s = MIN_EVALUATE_ROUNDS_S[kind]
    if past:
        est.trial_s = past.get("trial", est.trial_s)
        est.accept_s = past.get("accept", est.accept_s)
        est.evaluate_s = past.get("evaluate", est.evaluate_s)
        est.evaluate_rounds_s = min(est.evaluate_rounds_s, est.evaluate_s / 2)
        est.source = "this workload's last run"
    else:
        est.source = f"defaults for {kind} and a {run_s:.1f} s run"
    return est


def make_plan(tasks: list[TaskView], *, device: str, run_s: float, delta: float, budget_s: float | None,
              elapsed_s: float, history: dict | None = None, past: dict | None = None,
              covers: dict[str, bool] | None = None, excluded: Iterable[str] = (), searched: Iterable[str] = (),
              families: list[str] | None = None, phases: list[str] | None = None, top: int | None = None,
              trials: int | None = None, stages: Iterable[str] = ("accept", "evaluate")) -> Plan:
    """The plan for the search stage, made after extraction (elapsed_s of the budget already spent)."""
    est = estimates_for(device, run_s, past)
    items = rank_tasks(tasks, delta=delta, history=history, covers=covers, excluded=excluded, searched=searched,
                       families=families, phases=phases, top=top)
    _per_batch(est, tasks, items, past)
    notes = []
    search_s = None
    stages = tuple(stages)
    if budget_s is not None:
        later = (est.accept_s if "accept" in stages else 0.0) + (est.evaluate_s if "evaluate" in stages else 0.0)
        search_s = max(0.0, budget_s * (1 - SAFETY) - elapsed_s - later)
        if search_s < est.trial_s * MIN_TRIALS:
            notes.append(f"the budget leaves {search_s:.0f} s for the search, less than {MIN_TRIALS} trials: each "
                         f"target still gets its template's default (raise --time-budget for more)")
    targets = [i for i in items if i.action == PlanAction.SEARCH]
    split_trials(targets, search_s, est.trial_s, trials)
    if not targets:
        notes.append(_why_nothing(items))
    return Plan(items, budget_s, search_s, est, notes, tuple(s for s in ("accept", "evaluate") if s in stages))


def _per_batch(est: Estimates, tasks: list[TaskView], items: list[PlanItem], past: dict | None) -> None:
    """Without an earlier run's trial time: a trial on a task whose cases hold several batch sizes is verified at each
    (compiles and checks per bucket), as its verification limit allows (PER_BATCH_S each past the first): qwen3-4b's
    decode layer over batches 1-32 took 142 s a trial on the GPU, where the default says 32."""
    if past and "trial" in past:
        return
    searched = {i.task_id for i in items if i.action == PlanAction.SEARCH}
    most = max((t.batches for t in tasks if t.task_id in searched), default=1)
    if most > 1:
        est.trial_s += PER_BATCH_S * (most - 1)
        est.source += f", {most} batch sizes"


def _why_nothing(items: list[PlanItem]) -> str:
    uncovered = [i.task_id for i in items if i.why == PlanWhy.NOT_COVERED]
    if uncovered:
        return (f"nothing to search: no built-in template covers the tasks that matter ({', '.join(uncovered[:4])}); "
                "`--proposer llm` can write for any task (docs/llm.md)")
    return "nothing to search: no task can save delta end to end"


def history_speedups(rows: list[dict]) -> dict[tuple[str, str], float]:
    """(family, phase) -> the median of the best speedup per search, from rows {family, phase, best}."""
    by: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r.get("best") and r["best"] > 0:
            by.setdefault((r["family"], r["phase"]), []).append(float(r["best"]))
    return {k: statistics.median(v) for k, v in by.items()}


# ---- the clock ----------------------------------------------------------------------------------------------

class Clock:
    """The run's time budget: elapsed and remaining seconds, and each stage's span (for the plan's estimates of the
    next run and for the run's record)."""

    def __init__(self, budget_s: float | None, started: float | None = None):
        self.budget_s = budget_s
        self.t0 = started if started is not None else time.monotonic()
        self.wall0 = time.time() - (time.monotonic() - self.t0)
        self.spans: list[dict] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float | None:
        return None if self.budget_s is None else self.budget_s - self.elapsed()

    def deadline_wall(self, reserve_s: float = 0.0) -> float | None:
        """The budget's end less `reserve_s`, as Unix time (what a child process can compare time.time() with)."""
        return None if self.budget_s is None else self.wall0 + self.budget_s - reserve_s

    def status(self) -> str:
        rem = self.remaining()
        return f"[{fmt_s(self.elapsed())}" + (f" / {fmt_s(self.budget_s)}]" if rem is not None else "]")

    def start(self, stage: str, note: str = "") -> dict:
        span = {"stage": stage, "note": note, "start_s": self.elapsed(), "end_s": None,
                "started_at": time.time()}
        self.spans.append(span)
        return span

    def end(self, span: dict, note: str | None = None) -> float:
        span["end_s"] = self.elapsed()
        span["finished_at"] = time.time()
        if note is not None:
            span["note"] = note
        return span["end_s"] - span["start_s"]

    def seconds(self) -> dict[str, float]:
        """Seconds per stage name, summed over its spans."""
        out: dict[str, float] = {}
        for s in self.spans:
            if s["end_s"] is not None:
                out[s["stage"]] = out.get(s["stage"], 0.0) + s["end_s"] - s["start_s"]
        return out


# ---- stopping a task's search -------------------------------------------------------------------------------

def near_floor(trials: list) -> str | None:
    """Why a search can stop: its best passing candidate's in-context time is within NEAR_FLOOR of the task's
    physical floor (the verifier's floor_ms: output + weight bytes at peak HBM bandwidth)."""
    from llm4llm.search.episode import _p50

    best = None
    for t in trials:
        if not t.feedback.passed:
            continue
        ms, floor = _p50(t.verdict, "candidate_in_context"), t.verdict.floor_ms
        if ms and floor and (best is None or ms / floor < best[0]):
            best = (ms / floor, ms, floor)
    if best is not None and best[0] <= NEAR_FLOOR:
        return f"best at {best[1] * 1e3:.1f} us is {best[0]:.2f}x its floor ({best[2] * 1e3:.1f} us)"
    return None


def plateau(trials: list) -> str | None:
    """Why a search can stop: its last PLATEAU_TRIALS trials did not raise its best speedup by PLATEAU_GAIN."""
    if len(trials) <= PLATEAU_TRIALS:
        return None
    def best(ts):
        return max((t.feedback.utility for t in ts if t.feedback.passed), default=0.0)
    before, now = best(trials[:-PLATEAU_TRIALS]), best(trials)
    if before > 0 and now < before * (1 + PLATEAU_GAIN):
        return f"no gain over {before:.2f}x in its last {PLATEAU_TRIALS} trials"
    return None


def search_stop(deadline_wall: float | None, started_wall: float | None = None):
    """The stop rule of one planned search (llm4llm.search.episode.Stop): near its floor, on a plateau, or out of
    its share of the time budget (the next trial, at this search's pace so far, would end after `deadline_wall`)."""
    t0 = started_wall if started_wall is not None else time.time()

    def stop(trials: list) -> str | None:
        why = near_floor(trials) or plateau(trials)
        if why:
            return why
        if deadline_wall is not None and trials:
            # a trial whose verdict came from its template check took no time here, but the next one will take
            # what that verification took (its verdict's seconds)
            verified = sum((getattr(t.verdict, "seconds", None) or {}).get("total", 0.0) for t in trials)
            pace = max(time.time() - t0, verified) / len(trials)
            if time.time() + pace > deadline_wall:
                return f"its share of the time budget is spent ({len(trials)} trials at {pace:.0f} s each)"
        return None

    return stop
