from __future__ import annotations

from prefect import task

from llm4llm import pipeline
from tasks.common import infrastructure_only


@task(name="search-task", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only,
      task_run_name="search-{task_dir}")
def search_task(task_dir: str, db_path: str | None, data_dir: str, mode: str, budget: int, proposer: str,
                device: str, timeout_s: float, seed: int, run_id: str | None, llm: dict | None = None,
                decode_timing: str = "launch") -> dict:
    """One task's search. A failing candidate is data (a row), not a task failure: only infrastructure errors
    (the worker pool cannot start, the database is unavailable) fail and retry this task."""
    return pipeline.run_task_search(task_dir, db_path, data_dir, mode=mode, budget=budget, proposer=proposer,
                                    device=device, timeout_s=timeout_s, seed=seed, run_id=run_id, llm=llm,
                                    decode_timing=decode_timing)


@task(name="searchable-tasks")
def searchable_tasks(run_id: str, db_path: str | None, task_ids: list[str] | None, families: list[str] | None,
                     top: int | None, proposer: str = "library", device: str | None = None,
                     timeout_s: float = 120.0, decode_timing: str = "launch") -> list[str]:
    """Hottest deployable tasks first; with the library proposer, those no built-in template computes (checked on
    `device` before any trial) are left out before the top N."""
    return pipeline.searchable_task_dirs(run_id, db_path, task_ids, families, top, proposer, device, timeout_s,
                                         decode_timing)
