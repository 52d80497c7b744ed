from __future__ import annotations

from pathlib import Path

from prefect import flow

from llm4llm.config import RunKind, kind_of_deployment
from storage.db import data_home
from storage.store import Store
from tasks import extraction, profiling
from tasks.extraction import ExtractedTasks
from tasks.profiling import ProfiledRun


def _defaults(data_dir: str | None) -> str:
    return str(Path(data_dir).resolve() if data_dir else data_home())


def run_kind(kind: str | None) -> str:
    """The run's kind: as given, else from the deployment that started this flow run (cli: none did)."""
    if kind is not None:
        return kind
    from prefect.runtime import deployment

    return kind_of_deployment(deployment.name)


def _root_flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return str(flow_run.root_flow_run_id or flow_run.id or "") or None


@flow(name="profile-workload", log_prints=True)
def profile_workload(workload_path: str, db_path: str | None = None, data_dir: str | None = None,
                     refresh: bool = False, kind: RunKind | None = None) -> ProfiledRun:
    """Profile a workload per phase, as a run of its own; returns its ProfiledRun (run id, profile path, workload). A
    profile served from the cache is recorded again under a new run id (`runs.profile_of` names the run that
    measured it), so every run keeps its own rows. kind: what started the run (default: the deployment that
    started this flow run, else cli). Run on its own it ends the run; as a subflow it leaves that to its parent.

    Args:
        workload_path: the workload's TOML file (examples/workloads/*.toml), as the worker's host sees it
        db_path: DuckDB file the run writes (empty: $LLM4LLM_DB, else $LLM4LLM_HOME/llm4llm.duckdb)
        data_dir: where profiles and their artifacts go (empty: $LLM4LLM_HOME, else ./.llm4llm)
        refresh: measure again instead of serving a cached profile of the same workload
        kind: what started the run: nightly, manual, on-change or cli (empty: from the deployment that started it)
    """
    from prefect.runtime import flow_run

    data_dir = _defaults(data_dir)
    workload = profiling.describe(workload_path)
    profile_path = profiling.profile.with_options(refresh_cache=refresh)(workload, data_dir)
    if not Path(profile_path).exists():  # a cached result whose artifact was deleted: run again
        profile_path = profiling.profile.with_options(refresh_cache=True)(workload, data_dir)
    run_id = profiling.record_profile(profile_path, workload, db_path, run_kind(kind), _root_flow_run_id())
    profiling.publish_hotspots(profile_path)
    if not flow_run.parent_flow_run_id:
        Store(db_path).finish_run(run_id)
    return ProfiledRun(run_id=run_id, profile_path=profile_path, workload=workload)


@flow(name="extract-tasks", log_prints=True)
def extract_tasks(workload_path: str, run_id: str, profile_path: str, db_path: str | None = None,
                  data_dir: str | None = None, min_score: float = 0.0, refresh: bool = False,
                  static_cache: bool = False, min_share: float = 0.0) -> ExtractedTasks:
    """Extract phase-aware tasks for a profiled run; returns its ExtractedTasks (run id, index path, task count).
    static_cache: the decode tasks of KV-cache modules are captured on transformers' static cache; min_share: a
    module class whose whole share is below it (the acceptance's delta) is not captured
    (llm4llm.extract.extract_tasks)."""
    data_dir = _defaults(data_dir)
    workload = profiling.describe(workload_path)
    index_path = extraction.extract.with_options(refresh_cache=refresh)(workload, profile_path, data_dir, min_score,
                                                                         static_cache, min_share)
    if not Path(index_path).exists():
        index_path = extraction.extract.with_options(refresh_cache=True)(workload, profile_path, data_dir, min_score,
                                                                         static_cache, min_share)
    n = extraction.record_tasks(index_path, run_id, db_path)
    extraction.publish_tasks(index_path)
    return ExtractedTasks(run_id=run_id, index_path=index_path, tasks=n)
