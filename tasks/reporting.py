"""The markdown artifacts a run publishes, one key per workload and kind (`<workload>-hotspots`, `-leaderboard`,
`-acceptance`, `-e2e`), so the Prefect UI's artifact page keeps each workload's history under its own keys; and the
plain function that renders a run's report for the CLI."""
from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact

from llm4llm.report import ARTIFACTS, artifact_key, markdown


@task(name="publish-report", retries=1, retry_delay_seconds=2, task_run_name="publish-{kind}")
def publish_markdown(kind: str, workload_name: str, run_id: str, db_path: str | None) -> str:
    """Publish one kind of ARTIFACTS for a run; returns the artifact key."""
    from storage.db import Database
    from storage.report_queries import ReportReader

    if kind not in ARTIFACTS:
        raise ValueError(f"kind: expected one of {ARTIFACTS}, got {kind!r}")
    with Database(db_path) as db:
        text = markdown(kind, ReportReader(db), run_id)
    key = artifact_key(workload_name, kind)
    create_markdown_artifact(key=key, markdown=text, description=f"{kind} of {workload_name}, run {run_id}")
    return key


def write_report(db_path: str | Path | None, run: str | None = None, workload: str | None = None,
                 out: str | Path | None = None) -> tuple[Path, str]:
    """Render the report of `run` (or of `workload`'s latest optimized run) to `out` (default
    `<data home>/reports/<run>.html`); returns (path, run_id). Opens the database read-only."""
    from llm4llm.report import render_report
    from storage import report_queries
    from storage.db import Database, data_home

    with Database(db_path, read_only=True) as db:
        run_id = report_queries.resolve_run(db, run, workload)
        if run_id is None:
            what = f"run {run!r}" if run else (f"workload {workload!r}" if workload else "any run")
            raise LookupError(f"{what}: nothing in {db.path} (see `llm4llm runs`)")
        page = render_report(report_queries.ReportReader(db), run_id)
    path = Path(out) if out else data_home() / "reports" / f"{run_id}.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path, run_id
