"""The run's template coverage: per deployable task, the built-in templates that compute what its module does (decided
by running them on its captured calls), those found inapplicable and why, what was tried and accepted; per phase, the
share of its time an accepted patch covers. A report of the run, not a stage: the optimize flow builds its `coverage`
table artifact from it in its own process, and the CLI's `tasks` prints it."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol


class CoverageRows(Protocol):
    """Where the run's rows are read (storage.store.Store on DuckDB)."""

    def coverage_rows(self, run_id: str) -> tuple:
        """(the run's storage.repo.coverage_rows, its tasks' template checks), both DataFrames."""


def coverage_of_run(run_id: str, repo: CoverageRows) -> dict:
    """The run's template coverage (coverage_table) from its rows in `repo`."""
    cov, checks = repo.coverage_rows(run_id)
    return coverage_table(cov, checks)


def coverage_table(cov, checks) -> dict:
    """Per deployable task of a run (`cov`: its storage.repo.coverage_rows; `checks`: its tasks' template checks):
    the built-in templates that compute what its module does, those found inapplicable and why, the templates tried,
    trials (and wrong-output trials), whether a patch was accepted, and the task's share of its phase's time; per
    phase, the share some accepted patch covers (instances of an accepted task nested in another accepted task's
    instances are counted once). {"tasks": [...], "phases": {...}}."""
    from llm4llm.search.applicability import NOT_COVERED
    from llm4llm.taskspec import load_spec

    by_task: dict[str, list[dict]] = {}
    for r in checks.to_dict("records"):
        by_task.setdefault(r["task_id"], []).append(r)
    rows, covered_paths = [], {}
    for r in cov.to_dict("records"):
        if not r["deployable"]:
            continue
        cs = by_task.get(r["task_id"], [])
        ok = [c["template"] for c in cs if c["applicable"]]
        bad = [f"{c['template']} ({c['reason'][:160]})" for c in cs if not c["applicable"] and c["stage"] == "computation"]
        share = float(r["time_ms"] or 0.0) / float(r["phase_ms"]) if r["phase_ms"] else 0.0
        status = "accepted" if r["accepted"] else ("searched" if r["trials"] else
                                                    ("not checked" if not cs else (NOT_COVERED if not ok else "")))
        rows.append({"task_id": r["task_id"], "family": r["family"], "phase": r["phase"],
                     "applicable": ", ".join(ok), "inapplicable": "; ".join(bad), "tried": r["templates_tried"],
                     "trials": int(r["trials"]), "wrong_output": int(r["wrong_output"]), "accepted": bool(r["accepted"]),
                     "phase_share": round(share, 4), "status": status})
        if r["accepted"] and r["artifact_path"]:
            try:
                insts = load_spec(Path(r["artifact_path"])).instances
            except Exception:  # noqa: BLE001 - a deleted artifact: its share is still the task's own
                insts = [r["task_id"]]
            covered_paths.setdefault(r["phase"], []).append((insts, float(r["time_ms"] or 0.0), r["phase_ms"]))
    phases = {}
    for phase, items in covered_paths.items():
        outer = [i for i in items if not any(o is not i and all(any(p.startswith(q + ".") for q in o[0])
                                                                for p in i[0]) for o in items)]
        phases[phase] = round(sum(t for _, t, _ in outer) / float(items[0][2]), 4) if items[0][2] else 0.0
    return {"tasks": rows, "phases": phases}
