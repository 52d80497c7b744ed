"""Prefect tasks of extraction: the extract stage, its task index written through storage.store.Store (the stage
writes none)."""
from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact

from llm4llm.stages import extract as extract_stage
from llm4llm.stages.extract import ExtractedTasks  # noqa: F401 - the flow's result type, re-exported to flows/
from storage.store import Store
from tasks.common import infrastructure_only, stage_cache_key


@task(
    name="extract-tasks",
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=infrastructure_only,
    cache_key_fn=lambda ctx, p: stage_cache_key("extract", p, "profile_path", "data_dir", "min_score",
                                                "static_cache", "min_share"),
    persist_result=True,
)
def extract(workload: dict, profile_path: str, data_dir: str, min_score: float = 0.0,
            static_cache: bool = False, min_share: float = 0.0) -> str:
    return extract_stage.run_extract(workload["path"], profile_path, data_dir, min_score, static_cache=static_cache,
                                     min_share=min_share)


@task(name="record-tasks", retries=2, retry_delay_seconds=2, retry_condition_fn=infrastructure_only)
def record_tasks(index_path: str, run_id: str, db_path: str | None) -> int:
    return Store(db_path).record_task_index(index_path, run_id)


@task(name="publish-tasks")
def publish_tasks(index_path: str) -> None:
    create_table_artifact(key="tasks", table=extract_stage.task_table(index_path),
                          description="Extracted phase-aware tasks")
