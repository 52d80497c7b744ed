from __future__ import annotations

from pathlib import Path

from prefect import flow

from storage.db import data_home
from tasks import extraction, profiling


def _defaults(data_dir: str | None) -> str:
    return str(Path(data_dir).resolve() if data_dir else data_home())


@flow(name="profile-workload", log_prints=True)
def profile_workload(workload_path: str, db_path: str | None = None, data_dir: str | None = None,
                     refresh: bool = False, new_run: bool = False) -> dict:
    """Profile a workload per phase; returns {"run_id", "profile_path", "workload"}. new_run: a profile served from
    the cache is recorded again under a run id of its own (a nightly run keeps its own rows; `runs.profile_of`
    names the run that measured the profile)."""
    data_dir = _defaults(data_dir)
    workload = profiling.describe_workload(workload_path)
    profile_path = profiling.profile.with_options(refresh_cache=refresh)(workload, data_dir)
    if not Path(profile_path).exists():  # a cached result whose artifact was deleted: run again
        profile_path = profiling.profile.with_options(refresh_cache=True)(workload, data_dir)
    run_id = profiling.record_profile(profile_path, workload, db_path, new_run)
    profiling.publish_hotspots(profile_path)
    return {"run_id": run_id, "profile_path": profile_path, "workload": workload}


@flow(name="extract-tasks", log_prints=True)
def extract_tasks(workload_path: str, run_id: str, profile_path: str, db_path: str | None = None,
                  data_dir: str | None = None, min_score: float = 0.0, refresh: bool = False,
                  static_cache: bool = False) -> dict:
    """Extract phase-aware tasks for a profiled run; returns {"run_id", "index_path", "tasks"}. static_cache: the
    decode tasks of KV-cache modules are captured on transformers' static cache (llm4llm.extract.extract_tasks)."""
    data_dir = _defaults(data_dir)
    workload = profiling.describe_workload(workload_path)
    index_path = extraction.extract.with_options(refresh_cache=refresh)(workload, profile_path, data_dir, min_score,
                                                                         static_cache)
    if not Path(index_path).exists():
        index_path = extraction.extract.with_options(refresh_cache=True)(workload, profile_path, data_dir, min_score,
                                                                         static_cache)
    n = extraction.record_tasks(index_path, run_id, db_path)
    extraction.publish_tasks(index_path)
    return {"run_id": run_id, "index_path": index_path, "tasks": n}
