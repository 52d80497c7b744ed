"""Prefect tasks of profiling: the profile stage, and the run it starts recorded through the repository handed to it
(storage.store.Store)."""
from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact

from llm4llm.stages import common as common_stage, profile as profile_stage
from llm4llm.stages.profile import ProfiledRun  # noqa: F401 - the flow's result type, re-exported to flows/
from storage.store import Store
from tasks.common import infrastructure_only, stage_cache_key


@task(name="describe-workload", retries=0)
def describe(workload_path: str) -> dict:
    return common_stage.describe_workload(workload_path)


@task(
    name="profile",
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=infrastructure_only,
    cache_key_fn=lambda ctx, p: stage_cache_key("profile", p, "data_dir"),
    persist_result=True,
)
def profile(workload: dict, data_dir: str) -> str:
    return profile_stage.run_profile(workload["path"], data_dir)


@task(name="record-profile", retries=2, retry_delay_seconds=2, retry_condition_fn=infrastructure_only)
def record_profile(profile_path: str, workload: dict, db_path: str | None, kind: str = "cli",
                   flow_run_id: str | None = None) -> str:
    return profile_stage.record_run(profile_path, workload, Store(db_path), kind, flow_run_id)


@task(name="publish-hotspots")
def publish_hotspots(profile_path: str, top: int = 25) -> None:
    payload, result = profile_stage.load_profile(profile_path)
    create_table_artifact(key="hotspots", table=profile_stage.hotspot_table(result, top),
                          description=f"Hotspots of {payload['workload_name']} (run {payload['run_id']})")
