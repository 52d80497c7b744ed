"""Stage functions of the nightly run that the Prefect tasks wrap (tasks/service.py): re-validate the bundle in
service in an isolated process, then decide keep / replace / rollback (llm4llm.service.decide), version tonight's
bundle when it enters service, move the `current` pointer, and record it all in DuckDB."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from llm4llm.service import Validation, decide


def _revalidate(workload_path: str, bundle_path: str, cfg) -> Validation:
    from llm4llm.isolation import in_subprocess
    from llm4llm.service import revalidate

    # the bundle's kernels run inside the model here: a GPU fault costs this check, never the flow process
    # absolute: the sandboxed child runs in its own private dir
    return in_subprocess(revalidate, str(Path(workload_path).resolve()), str(Path(bundle_path).resolve()), cfg)


def current_validation(workload_path: str, db_path: str | None, cfg=None) -> dict | None:
    """The bundle in service re-validated tonight (Validation.to_dict() with its version), or None if none is."""
    from llm4llm.stages.common import describe_workload
    from storage import repo
    from storage.db import Database

    name = describe_workload(workload_path)["name"]
    with Database(db_path) as db:
        cur = repo.current_bundle(db, name)
    if cur is None:
        return None
    return {**_revalidate(workload_path, cur["bundle_path"], cfg).to_dict(), "version": int(cur["version"])}


def bundle_home(data_dir: str, workload_name: str) -> Path:
    """<data>/bundles/<workload>/: v0001, v0002, ... (immutable copies) and `current` (a link to the one in
    service; absent when none is), what serving code hands to kernels_runtime.apply."""
    return Path(data_dir) / "bundles" / workload_name


def _point_current(home: Path, version: int | None) -> None:
    link = home / "current"
    if version is None:
        link.unlink(missing_ok=True)
        return
    tmp = home / f".current-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(f"v{version:04d}", target_is_directory=True)
    os.replace(tmp, link)  # atomic: a reader sees the old version or the new one


def service_decision(workload_path: str, run_id: str, candidate_bundle: str | None, current: dict | None,
                     db_path: str | None, data_dir: str, cfg=None) -> dict:
    """Tonight's keep / replace / rollback for the workload. `current`: current_validation()'s result (taken before
    tonight's search); `candidate_bundle`: tonight's accepted bundle dir (None if none). The reason, every
    validation and the pointer go to DuckDB; a bundle that enters service is copied to its own version dir."""
    from kernels_runtime.bundle import load_bundle
    from llm4llm.accept import AcceptConfig
    from llm4llm.stages.common import describe_workload
    from storage import repo
    from storage.db import Database

    cfg = cfg or AcceptConfig()
    wl = describe_workload(workload_path)
    name = wl["name"]
    with Database(db_path) as db:
        versions = repo.bundle_versions(db, name)
    cur_version = current.pop("version", None) if current else None
    cur = Validation.from_dict(current)
    checked = [("current", cur_version, cur)] if cur else []
    cand = _revalidate(workload_path, candidate_bundle, cfg) if candidate_bundle else None
    if cand is not None:
        checked.append(("candidate", None, cand))
    fallback, fb_version = None, None
    if cur is not None and not cur.ok and not (cand is not None and cand.ok):
        for row in versions:  # newest first: the last good one
            if row["version"] >= cur_version:
                continue
            v = _revalidate(workload_path, row["bundle_path"], cfg)
            checked.append(("fallback", int(row["version"]), v))
            if v.ok:
                fallback, fb_version = v, int(row["version"])
                break
    d = decide(cur, cand, fallback, cfg.delta, fallback_version=fb_version)
    home = bundle_home(data_dir, name)
    with Database(db_path) as db:
        if d.target == "candidate":
            home.mkdir(parents=True, exist_ok=True)
            new_version = repo.next_bundle_version(db, name)
            dst = home / f"v{new_version:04d}"
            shutil.copytree(candidate_bundle, dst)  # raises if it exists: a version dir is never overwritten
            repo.record_bundle_version(db, {"workload_name": name, "version": new_version, "run_id": run_id,
                                            "workload_hash": wl["workload_hash"], "bundle_path": str(dst),
                                            "digest": load_bundle(dst).digest()})
        else:
            new_version = {"current": cur_version, "fallback": fb_version, None: None}[d.target]
        rows = [{"run_id": run_id, "workload_name": name, "subject": subject, "version": ver,
                 "bundle_path": v.bundle_path, "ok": v.ok, "correctness": v.correctness, "latency": v.latency,
                 "unpatched_ms": v.unpatched_ms, "patched_ms": v.patched_ms, "gain": v.gain, "reason": v.reason,
                 "versions_json": v.versions} for subject, ver, v in checked]
        repo.record_service_night(db, rows, {"run_id": run_id, "workload_name": name, "decision": d.decision,
                                             "from_version": cur_version, "to_version": new_version,
                                             "reason": d.reason})
        repo.set_current_bundle(db, name, new_version, run_id)
    if new_version is not None or cur_version is not None:
        home.mkdir(parents=True, exist_ok=True)
        _point_current(home, new_version)
    print(f"service: {d.decision} (v{cur_version} -> v{new_version}): {d.reason}")
    return {"decision": d.decision, "from_version": cur_version, "to_version": new_version, "reason": d.reason,
            "validations": [{"subject": s, "version": ver, "ok": v.ok, "latency": v.latency} for s, ver, v in checked]}
