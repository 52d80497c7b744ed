"""Which built-in templates compute what a task's module computes, decided by running them, not by names.

Before a search spends a trial on a template, its default config is verified once on the task's captured cases
alone (correctness against the module's own recorded outputs; no fresh draws, no timing) — a check, not a trial: it
is no `candidates` row and no budget. A mismatch (wrong output, NaN/Inf, another shape or dtype) on the default and
on every variant of the template's option keys (`Template.options`) marks the template inapplicable to that task
with the verifier's message as the reason; so does a default that raises on the module's own call or does not
compile. Names are not enough: a Falcon-Mamba mixer carries Mamba's weight names but computes something else, so
every trial of a Mamba template on it fails with `wrong_output`. A failure of the machinery (timeout, worker crash,
OOM, GPU fault, an outside stop) says nothing about the template: it stays in and the reason says the check was
inconclusive.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from llm4llm.outcomes import FailureClass
from llm4llm.search.templates.base import Template
from llm4llm.taskspec import TaskSpec

# failure classes that mean "computes something else"
MISMATCH = frozenset({FailureClass.WRONG_OUTPUT, FailureClass.NAN_INF, FailureClass.SHAPE_DTYPE})
# failures that say nothing about the template (the worker, the machine, a time limit): the check is inconclusive;
# any other failure of the default (it raised on the module's own call, it does not compile) rules the template out
INCONCLUSIVE = frozenset({FailureClass.TIMEOUT, FailureClass.WORKER_CRASH, FailureClass.INTERRUPTED,
                          FailureClass.OOM, FailureClass.GPU_FAULT})
NOT_COVERED = "not covered by the built-in library"

CheckVerify = Callable[[Path, str], Any]  # (task_dir, source) -> Verdict-like, correctness on the captured cases


@dataclass
class TemplateCheck:
    template: str
    applicable: bool
    stage: str  # "scope": ruled out before running (family, phase, ops, call structure) | "computation"
    failure_class: str | None = None
    reason: str = ""
    pinned: dict[str, Any] = field(default_factory=dict)  # the option values that matched

    def row(self, task_id: str, run_id: str | None) -> dict:
        return {"task_id": task_id, "run_id": run_id, **asdict(self)}


def check_templates(task_dir: Path, spec: TaskSpec, templates: Sequence[Template], verify: CheckVerify) -> \
        list[TemplateCheck]:
    """One TemplateCheck per template of the task's family and phase (the others are not listed)."""
    out = []
    for t in templates:
        if t.family != spec.family or spec.phase not in t.phases:
            continue
        why = t.why_not(spec)
        if why:
            out.append(TemplateCheck(t.name, False, "scope", None, why))
            continue
        out.append(_run_check(Path(task_dir), spec, t, verify))
    return out


def _run_check(task_dir: Path, spec: TaskSpec, t: Template, verify: CheckVerify) -> TemplateCheck:
    default = t.default(spec)
    first = None
    for variant in [{}, *t.variants(spec)]:
        v = verify(task_dir, t.render(spec, {**default, **variant}))
        if _get(v, "passed"):
            pinned = {k: default[k] for k in t.options if k in default} | variant
            note = "default config matches the module on the captured cases" if not variant else \
                f"matches with option {variant} (the default did not: {_brief(first)})"
            return TemplateCheck(t.name, True, "computation", None, note, pinned)
        fc = _get(v, "failure_class")
        if fc in INCONCLUSIVE:
            if first is None:  # the default itself could not be judged: keep the template, say why
                return TemplateCheck(t.name, True, "computation", fc,
                                     f"check inconclusive ({fc}): {_get(v, 'message')[:300]}")
            continue
        first = first or v
    what = "computes something else than the module" if _get(first, "failure_class") in MISMATCH else \
        "cannot run the module's own call"
    return TemplateCheck(t.name, False, "computation", _get(first, "failure_class"),
                         f"default config {what}: {_brief(first)}")


def applicable_templates(templates: Sequence[Template], checks: Sequence[TemplateCheck]) -> list[Template]:
    """The templates the checks kept, each pinned to the option values that matched."""
    ok = {c.template: c for c in checks if c.applicable}
    return [t.pinned(ok[t.name].pinned) for t in templates if t.name in ok]


def _get(v: Any, key: str) -> Any:
    return v.get(key) if isinstance(v, dict) else getattr(v, key, None)


def _brief(v: Any) -> str:
    if v is None:
        return ""
    lines = [ln.strip() for ln in str(_get(v, "message") or "").splitlines() if ln.strip()]
    if len(lines) > 1 and any(ln.startswith("Traceback") for ln in lines):  # the raise, not the frames
        lines = [lines[0].split("Traceback")[0].strip(), lines[-1]]
    return f"{_get(v, 'failure_class')}: {' '.join(ln for ln in lines if ln)[:240]}"
