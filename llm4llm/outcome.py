"""What a run gave its user: the flow's typed result (OptimizeResult, holding each stage's result as the stage
returned it; NightlyResult, with the night's service decision), and the few lines `llm4llm optimize` ends with: end
to end against eager and against torch.compile (median and spread over the interleaved rounds), the bundle, the line
that installs it, the time."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from llm4llm.planner import fmt_s
from llm4llm.stages.accept import AcceptSummary
from llm4llm.stages.evaluate import EvaluateResult
from llm4llm.stages.search import SearchSummary


class OptimizeResult(BaseModel):
    """What one optimize run (flows.optimize.optimize_workload) returns to the CLI and to the nightly flow. Frozen;
    the stages' results are held as the stages returned them: `searches` each task search's SearchSummary,
    `acceptances` each acceptance step's AcceptSummary (in step order), `e2e` the evaluation's EvaluateResult. A
    field of a stage that did not run is empty (None or ()). plan: the first plan's items (llm4llm.planner.PlanItem's
    fields); decode_graphs: the decode-graphs decision, the last acceptance step's where it made one; summary: the
    closing lines (summary_lines)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    profile_path: str | None = None
    index_path: str | None = None
    tasks: int | None = None
    decode_graphs: str | None = None
    plan: tuple[dict[str, Any], ...] = ()
    searches: tuple[SearchSummary, ...] = ()
    acceptances: tuple[AcceptSummary, ...] = ()
    e2e: EvaluateResult | None = None
    summary: tuple[str, ...] = ()

    @property
    def acceptance(self) -> AcceptSummary | None:
        """The last acceptance step's summary (None: no step ran)."""
        return self.acceptances[-1] if self.acceptances else None

    @property
    def bundle(self) -> str | None:
        """The run's bundle: the newest one a step wrote (each step's holds the earlier steps' patches too)."""
        return next((a.bundle for a in reversed(self.acceptances) if a.bundle), None)

    @property
    def accepted_tasks(self) -> tuple[str, ...]:
        """The tasks accepted in every step, in step order."""
        return tuple(t for a in self.acceptances for t in a.accepted_tasks)


class NightlyResult(BaseModel):
    """What one night (flows.nightly.nightly_workload) returns: tonight's optimize run as it returned it, and the
    keep / replace / rollback decision (llm4llm.nightly.decide_night). Frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    optimize: OptimizeResult
    service: dict[str, Any]

# the variant that is what the bundle gives in serving, best first
SERVED = ("patched_graphs", "patched")


def _ratio(row: dict, key: str) -> str | None:
    v = row.get(key)
    if v is None or v != v:
        return None
    lo, hi = row.get(f"{key}_p20"), row.get(f"{key}_p80")
    spread = f" (p20-p80 {lo:.2f}-{hi:.2f})" if lo is not None and hi is not None and lo == lo and hi == hi else ""
    return f"{v:.2f}x{spread}"


def _ms(row: dict | None) -> str:
    v = (row or {}).get("total_ms")
    return f"{v:.1f} ms" if v is not None and v == v else "-"


def result_lines(rows: list) -> list[str]:
    """One result line per measured point (batch size, prompt length), in the order measured: one line, as
    `result_line`, where the run measured one point. rows: the evaluate stage's E2ERows, or dicts of their fields."""
    rows = [r if isinstance(r, dict) else r.model_dump() for r in rows]
    points = list(dict.fromkeys((r.get("batch_size"), r.get("prompt_len")) for r in rows))
    if len(points) <= 1:
        return [result_line(rows)]
    return [result_line([r for r in rows if (r.get("batch_size"), r.get("prompt_len")) == (b, p)],
                        at=f"batch {b}, prompt {p}") for b, p in points]


def result_line(rows: list[dict], at: str = "") -> str:
    """The run's end-to-end result, from its e2e rows (one per variant) at one point (`at` names it)."""
    head = f"result at {at}:" if at else "result:"
    by = {r["variant"]: r for r in rows}
    ours = next((by[v] for v in SERVED if v in by and by[v].get("total_ms") is not None
                 and by[v].get("total_ms") == by[v].get("total_ms")), None)
    if ours is None:
        why = next((by[v].get("notes") for v in SERVED if v in by and by[v].get("notes")), "")
        base = f"eager {_ms(by.get('eager'))}, torch.compile {_ms(by.get('torch_compile'))}"
        return f"{head} no patched run to compare ({why or 'no bundle'}); {base}"
    parts = [f"{head} {ours['variant']} {_ms(ours)} a request"]
    vs_c, vs_e = _ratio(ours, "vs_compile"), _ratio(ours, "vs_eager")
    if vs_c:
        parts.append(f"{vs_c} torch.compile ({_ms(by.get('torch_compile'))})")
    elif "torch_compile" in by:
        parts.append(f"torch.compile: {by['torch_compile'].get('notes') or 'not measured'}")
    if vs_e:
        parts.append(f"{vs_e} eager ({_ms(by.get('eager'))})")
    rounds = ours.get("repeats")
    tail = f", {rounds} interleaved rounds" if rounds else ""
    return ", ".join(parts) + tail


def summary_lines(rows: list | None, bundle: str | None, accepted: list[str], seconds: dict[str, float],
                  elapsed_s: float, budget_s: float | None, device: str) -> list[str]:
    """The closing lines of a run."""
    lines = []
    if rows:
        lines += result_lines(rows)
    if bundle:
        what = ", ".join(accepted) if accepted else "decode graphs only"
        lines.append(f"bundle: {bundle} ({what})")
        lines.append(f"install: kernels_runtime.apply(model, {bundle!r})  # in serving code, on the built model")
    elif not device.startswith("cuda"):
        lines.append("bundle: none (on a CPU the latency gate never accepts a patch; run on a GPU for a bundle)")
    else:
        lines.append("bundle: none (no patch passed in-model correctness and the delta gain)")
    stages = ", ".join(f"{k} {fmt_s(v)}" for k, v in seconds.items())
    budget = f" of the {fmt_s(budget_s)} budget" if budget_s else ""
    lines.append(f"time: {fmt_s(elapsed_s)}{budget} ({stages})")
    return lines
