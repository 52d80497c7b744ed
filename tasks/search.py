from __future__ import annotations

from prefect import task

from llm4llm import pipeline
from llm4llm.config import SearchSettings
from tasks.common import infrastructure_only


@task(name="search-task", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only,
      task_run_name="search-{task_dir}")
def search_task(task_dir: str, settings: SearchSettings, db_path: str | None, data_dir: str, device: str,
                run_id: str | None, llm: dict | None = None, decode_timing: str = "launch") -> dict:
    """One task's search. A failing candidate is data (a row), not a task failure: only infrastructure errors
    (the worker pool cannot start, the database is unavailable) fail and retry this task."""
    return pipeline.run_task_search(task_dir, db_path, data_dir, mode=settings.mode, budget=settings.budget,
                                    proposer=settings.proposer, device=device, timeout_s=settings.timeout_s,
                                    seed=settings.seed, run_id=run_id, llm=llm, use_prior=settings.warm_start,
                                    decode_timing=decode_timing)


@task(name="searchable-tasks")
def searchable_tasks(run_id: str, db_path: str | None, task_ids: list[str] | None, families: list[str] | None,
                     top: int | None, proposer: str = "library") -> list[str]:
    return pipeline.searchable_task_dirs(run_id, db_path, task_ids, families, top, proposer)
