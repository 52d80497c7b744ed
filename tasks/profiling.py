"""Prefect tasks of profiling: the profile stage, its rows written to DuckDB here (the stage writes none)."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from llm4llm.stages import common as common_stage, profile as profile_stage
from tasks.common import infrastructure_only, stage_cache_key


@task(name="describe-workload", retries=0)
def describe_workload(workload_path: str) -> dict:
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
def record_profile(profile_path: str, workload: dict, db_path: str | None, new_run: bool = False) -> str:
    return record_profile_rows(profile_path, workload, db_path, new_run=new_run)


def record_profile_rows(profile_path: str, workload: dict, db_path: str | None, new_run: bool = False) -> str:
    """Write the run and its profile rows to DuckDB in one transaction. Idempotent for a cached profile, unless
    new_run: then a profile whose run is recorded already is recorded again under a new run id (its `profile_of`
    names the run that measured it), so that a run served from the cache still has rows of its own."""
    from storage import repo
    from storage.db import Database
    from storage.rows import profile_row, run_row

    payload, result = profile_stage.load_profile(profile_path)
    run_id, profile_of = payload["run_id"], None
    started = payload["started_at"]
    with Database(db_path) as db:
        if repo.get_run(db, run_id) is not None:
            if not new_run:
                return run_id
            run_id, profile_of = common_stage.new_run_id(payload["workload_name"]), run_id
            started = datetime.now(timezone.utc).replace(tzinfo=None).isoformat()
        run = run_row(payload, result, run_id, started, profile_of, str(Path(profile_path).parent))
        repo.record_profile_run(db, run, workload, [profile_row(r) for r in result.records])
    return run_id


@task(name="publish-hotspots")
def publish_hotspots(profile_path: str, top: int = 25) -> None:
    payload, result = profile_stage.load_profile(profile_path)
    rows = [
        {"rank": i + 1, "module": r.module_path or "<model>", "class": r.class_name, "family": r.family,
         "phase": r.phase, "calls": r.calls, "time_ms": round(r.time_ms, 3), "share": round(r.share, 4),
         "hotspot_score": round(r.hotspot_score, 4)}
        for i, r in enumerate(profile_stage.hotspot_rows(result, top))
    ]
    create_table_artifact(key="hotspots", table=rows,
                          description=f"Hotspots of {payload['workload_name']} (run {payload['run_id']})")
