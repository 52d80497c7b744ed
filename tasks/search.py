from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from llm4llm import isolation
from llm4llm.config import SearchSettings
from llm4llm.stages import search as search_stage
from tasks.common import infrastructure_only


@task(name="search-task", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only,
      task_run_name="search-{task_dir}")
def search_task(task_dir: str, settings: SearchSettings, db_path: str | None, data_dir: str, device: str,
                run_id: str | None, llm: dict | None = None, decode_timing: str = "launch") -> dict:
    """One task's search. A failing candidate is data (a row), not a task failure: only infrastructure errors
    (the worker pool cannot start, the database is unavailable) fail and retry this task."""
    return search_stage.run_task_search(task_dir, db_path, data_dir, mode=settings.mode, budget=settings.budget,
                                        proposer=settings.proposer, device=device, timeout_s=settings.timeout_s,
                                        seed=settings.seed, run_id=run_id, llm=llm, use_prior=settings.warm_start,
                                        decode_timing=decode_timing)


@task(name="searchable-tasks")
def searchable_tasks(run_id: str, db_path: str | None, task_ids: list[str] | None, families: list[str] | None,
                     top: int | None, proposer: str = "library", device: str | None = None,
                     timeout_s: float = 120.0, decode_timing: str = "launch",
                     phases: list[str] | None = None) -> list[str]:
    """Hottest deployable tasks first; with the library proposer, those no built-in template computes (checked on
    `device` before any trial) are left out before the top N."""
    return search_stage.searchable_task_dirs(run_id, db_path, task_ids, families, top, proposer, device, timeout_s,
                                             decode_timing, phases=phases)


def _placement() -> dict:
    """Where this evaluation runs: host, process, and the GPUs Ray gave it (CUDA_VISIBLE_DEVICES is what the
    verifier worker it spawns inherits)."""
    import os
    import socket

    gpu_ids = None
    try:
        import ray

        if ray.is_initialized():
            gpu_ids = [str(g) for g in ray.get_gpu_ids()]
    except ImportError:
        pass
    return {"host": socket.gethostname(), "pid": os.getpid(), "gpu_ids": gpu_ids,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


@task(name="search-task-remote", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only,
      cache_policy=NO_CACHE, task_run_name="search-remote-{task_id}")
def search_task_remote(task_id: str, task: bytes, prior: list[dict], mode: str, budget: int, proposer: str,
                       device: str, timeout_s: float, seed: int, run_id: str | None, llm: dict | None = None,
                       decode_timing: str = "launch") -> dict:
    """One task's search wherever the task runner puts it (a Ray worker holding one GPU): the task arrives as
    bytes, is searched on this worker's own device (Ray shows it only its GPUs, so `cuda` is the one it was given)
    and comes back as rows for the flow to write; nothing here touches DuckDB."""
    import tempfile
    import time

    from llm4llm.scale import unpack_dir

    where = _placement()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="llm4llm-remote-") as tmp:
        task_dir = unpack_dir(task, Path(tmp) / "task")
        rows = search_stage.search_rows(str(task_dir), tmp, mode=mode, budget=budget, proposer=proposer,
                                        device="cuda" if device.startswith("cuda") else device,
                                        timeout_s=timeout_s, seed=seed, run_id=run_id, llm=llm,
                                        decode_timing=decode_timing, prior=prior)
    rows["placement"] = {**where, "started": started, "finished": time.time()}
    return rows


@task(name="record-search", retries=2, retry_delay_seconds=2, retry_condition_fn=infrastructure_only,
      cache_policy=NO_CACHE)
def record_search(rows: dict, db_path: str | None, data_dir: str) -> dict:
    """Write a remote search's rows, in the flow's process (DuckDB's one writer)."""
    return search_stage.record_search_rows(rows, db_path, data_dir) | {"placement": rows.get("placement")}


# ---- plain helpers the search flow calls in its process (not Prefect tasks: no run, retry or cache of their own)

def remote_search_input(task_dir: str, db_path: str | None) -> dict:
    """What search_task_remote takes for one task, read in the flow (llm4llm.stages.search.remote_search_input)."""
    return search_stage.remote_search_input(task_dir, db_path)


def close_pools() -> None:
    """Close the verifier workers the flow's local searches started (llm4llm.isolation.close_pools)."""
    isolation.close_pools()
