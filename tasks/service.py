"""Prefect tasks of the nightly run: re-validate the bundle in service, decide keep / replace / rollback
(llm4llm.nightly), and record the night in DuckDB here (the stage writes none)."""
from __future__ import annotations

from prefect import task

from llm4llm import nightly
from llm4llm.config import AcceptSettings
from tasks.common import infrastructure_only


@task(name="revalidate-current-bundle", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only)
def revalidate_current(workload_path: str, db_path: str | None, cfg: AcceptSettings) -> dict | None:
    return current_validation(workload_path, db_path, cfg)


@task(name="decide-service", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only)
def decide_service(workload_path: str, run_id: str, candidate_bundle: str | None, current: dict | None,
                   db_path: str | None, data_dir: str, cfg: AcceptSettings) -> dict:
    return service_decision(workload_path, run_id, candidate_bundle, dict(current) if current else None,
                            db_path, data_dir, cfg)


def current_validation(workload_path: str, db_path: str | None, cfg=None) -> dict | None:
    """The bundle in service re-validated tonight (Validation.to_dict() with its version), or None if none is."""
    from llm4llm.stages.common import describe_workload
    from storage import repo
    from storage.db import Database

    name = describe_workload(workload_path)["name"]
    with Database(db_path) as db:
        cur = repo.current_bundle(db, name)
    return nightly.current_validation(workload_path, cur, cfg)


def service_decision(workload_path: str, run_id: str, candidate_bundle: str | None, current: dict | None,
                     db_path: str | None, data_dir: str, cfg=None) -> dict:
    """Tonight's keep / replace / rollback for the workload (llm4llm.nightly.night_decision). `current`:
    current_validation()'s result (taken before tonight's search); `candidate_bundle`: tonight's accepted bundle
    dir (None if none). The reason, every validation and the pointer go to DuckDB; a bundle that enters service is
    copied to its own version dir."""
    from llm4llm.stages.common import describe_workload
    from storage import repo
    from storage.db import Database

    cfg = cfg or AcceptSettings()
    wl = describe_workload(workload_path)
    name = wl["name"]
    with Database(db_path) as db:
        versions = repo.bundle_versions(db, name)
    night = nightly.night_decision(workload_path, candidate_bundle, current, versions, cfg)
    d, cur_version = night.decision, night.cur_version
    home = nightly.bundle_home(data_dir, name)
    with Database(db_path) as db:
        if d.target == "candidate":
            new_version = repo.next_bundle_version(db, name)
            dst, digest = nightly.enter_service(home, new_version, candidate_bundle)
            repo.record_bundle_version(db, {"workload_name": name, "version": new_version, "run_id": run_id,
                                            "workload_hash": wl["workload_hash"], "bundle_path": str(dst),
                                            "digest": digest})
        else:
            new_version = {"current": cur_version, "fallback": night.fb_version, None: None}[d.target]
        repo.record_service_night(db, night.validation_rows(run_id, name),
                                  {"run_id": run_id, "workload_name": name, "decision": d.decision,
                                   "from_version": cur_version, "to_version": new_version, "reason": d.reason})
        repo.set_current_bundle(db, name, new_version, run_id)
    nightly.point_current(home, cur_version, new_version)
    print(f"service: {d.decision} (v{cur_version} -> v{new_version}): {d.reason}")
    return {"decision": d.decision, "from_version": cur_version, "to_version": new_version, "reason": d.reason,
            "validations": [{"subject": s, "version": ver, "ok": v.ok, "latency": v.latency}
                            for s, ver, v in night.checked]}
