"""The markdown artifacts a run publishes, one key per workload and kind (`<workload>-hotspots`, `-leaderboard`,
`-acceptance`, `-e2e`), so the Prefect UI's artifact page keeps each workload's history under its own keys."""
from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact

from llm4llm.report import artifact_key, markdown


@task(name="publish-report", retries=1, retry_delay_seconds=2, task_run_name="publish-{kind}")
def publish_markdown(kind: str, workload_name: str, run_id: str, db_path: str | None) -> str:
    """Publish one kind of llm4llm.report.ARTIFACTS for a run (markdown refuses any other kind); returns the
    artifact key."""
    from storage.db import Database
    from storage.report_queries import ReportReader

    with Database(db_path) as db:
        text = markdown(kind, ReportReader(db), run_id)
    key = artifact_key(workload_name, kind)
    create_markdown_artifact(key=key, markdown=text, description=f"{kind} of {workload_name}, run {run_id}")
    return key
