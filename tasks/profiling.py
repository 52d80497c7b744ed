"""Prefect tasks of profiling: the profile stage, its rows written to DuckDB here (the stage writes none)."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from llm4llm.stages import common as common_stage, profile as profile_stage
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
    return record_profile_rows(profile_path, workload, db_path, kind, flow_run_id)


def record_profile_rows(profile_path: str, workload: dict, db_path: str | None, kind: str = "cli",
                        flow_run_id: str | None = None) -> str:
    """Start a run: its `runs` row (what started it: `kind`; the Prefect flow run) and its profile rows, in one
    transaction. Every call is a run of its own: a profile that an earlier run recorded (served from the cache) is
    recorded again under a new run id, its `profile_of` naming the run that measured it, so no run writes into
    another's rows."""
    from storage import repo
    from storage.db import Database
    from storage.rows import profile_row, run_row

    payload, result = profile_stage.load_profile(profile_path)
    run_id, profile_of = payload["run_id"], None
    started = payload["started_at"]
    with Database(db_path) as db:
        if repo.get_run(db, run_id) is not None:
            run_id, profile_of = common_stage.new_run_id(payload["workload_name"]), run_id
            started = datetime.now(timezone.utc).replace(tzinfo=None).isoformat()
        run = run_row(payload, result, run_id, started, profile_of, str(Path(profile_path).parent), kind, flow_run_id)
        repo.record_profile_run(db, run, workload, [profile_row(r) for r in result.records])
    return run_id


def finish_run(run_id: str, db_path: str | None, error: BaseException | None = None) -> None:
    """The run ends: ok, failed (an exception) or stopped (Ctrl-C, a cancelled flow run), with the error's first
    line."""
    from storage import repo
    from storage.db import Database

    status = "ok" if error is None else "failed" if isinstance(error, Exception) else "stopped"
    first = str(error).splitlines()[0] if error is not None and str(error) else ""
    text = None if error is None else (type(error).__name__ + (f": {first}" if first else ""))[:500]
    with Database(db_path) as db:
        repo.finish_run(db, run_id, status, text)


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
