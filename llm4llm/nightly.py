"""Stage functions of the nightly run that the Prefect tasks of tasks/service.py wrap: re-validate the bundle in
service in an isolated process, decide keep / replace / rollback (llm4llm.service.decide), and move the `current`
pointer of the bundle store. The bundles in service are read, tonight's bundle versioned when it enters service and
the night recorded through the repository handed in (ServiceRepository: storage.store.Store on DuckDB)."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from llm4llm.service import ServiceDecision, Validation, decide


def _revalidate(workload_path: str, bundle_path: str, cfg) -> Validation:
    from llm4llm.isolation import in_subprocess
    from llm4llm.service import revalidate

    # the bundle's kernels run inside the model here: a GPU fault costs this check, never the flow process
    # absolute: the sandboxed child runs in its own private dir
    return in_subprocess(revalidate, str(Path(workload_path).resolve()), str(Path(bundle_path).resolve()), cfg)


def current_validation(workload_path: str, current: dict | None, cfg=None) -> dict | None:
    """The bundle in service (`current`: its `bundle_versions` row, None if none is) re-validated tonight
    (Validation.to_dict() with its version), or None."""
    if current is None:
        return None
    return {**_revalidate(workload_path, current["bundle_path"], cfg).to_dict(), "version": int(current["version"])}


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


@dataclass
class Night:
    """Tonight's decision and the validations behind it: (subject, version, Validation) per bundle checked, the
    subject one of current, candidate, fallback."""
    decision: ServiceDecision
    checked: list[tuple[str, int | None, Validation]]
    cur_version: int | None
    fb_version: int | None

    def validation_rows(self, run_id: str, workload_name: str) -> list[dict]:
        return [{"run_id": run_id, "workload_name": workload_name, "subject": subject, "version": ver,
                 "bundle_path": v.bundle_path, "ok": v.ok, "correctness": v.correctness, "latency": v.latency,
                 "unpatched_ms": v.unpatched_ms, "patched_ms": v.patched_ms, "gain": v.gain, "reason": v.reason,
                 "versions_json": v.versions} for subject, ver, v in self.checked]


def night_decision(workload_path: str, candidate_bundle: str | None, current: dict | None, versions: list[dict],
                   cfg) -> Night:
    """Tonight's keep / replace / rollback for the workload. `current`: current_validation()'s result (taken before
    tonight's search); `candidate_bundle`: tonight's accepted bundle dir (None if none); `versions`: the workload's
    bundle versions, newest first, where a rollback looks for the last one that passes tonight."""
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
    return Night(decide(cur, cand, fallback, cfg.delta, fallback_version=fb_version), checked, cur_version,
                 fb_version)


def enter_service(home: Path, version: int, bundle: str) -> tuple[Path, str]:
    """Copy tonight's bundle to its own version dir under the store; returns (the dir, the bundle's digest)."""
    from kernels_runtime.bundle import load_bundle

    home.mkdir(parents=True, exist_ok=True)
    dst = home / f"v{version:04d}"
    shutil.copytree(bundle, dst)  # raises if it exists: a version dir is never overwritten
    return dst, load_bundle(dst).digest()


def point_current(home: Path, cur_version: int | None, new_version: int | None) -> None:
    """Move the store's `current` link to the version in service (remove it when none is)."""
    if new_version is not None or cur_version is not None:
        home.mkdir(parents=True, exist_ok=True)
        _point_current(home, new_version)


class ServiceRepository(Protocol):
    """Where the bundles in service are read and the night written (storage.store.Store on DuckDB)."""

    def current_bundle(self, workload_name: str) -> dict | None: ...

    def bundle_versions(self, workload_name: str) -> list[dict]: ...

    def enter_service(self, row: dict) -> None:
        """Record a bundle version (`row` with its `version`) entering service."""

    def next_bundle_version(self, workload_name: str) -> int: ...

    def record_night(self, validations: list[dict], decision: dict) -> None:
        """Tonight's validations and decision, and the `current` pointer moved to decision's `to_version`."""


def validate_in_service(workload_path: str, repo: ServiceRepository, cfg=None) -> dict | None:
    """The bundle in service re-validated tonight (Validation.to_dict() with its version), or None if none is."""
    from llm4llm.stages.common import describe_workload

    return current_validation(workload_path, repo.current_bundle(describe_workload(workload_path)["name"]), cfg)


def decide_night(workload_path: str, run_id: str, candidate_bundle: str | None, current: dict | None,
                 repo: ServiceRepository, data_dir: str, cfg=None) -> dict:
    """Tonight's keep / replace / rollback for the workload (night_decision). `current`: validate_in_service()'s
    result (taken before tonight's search); `candidate_bundle`: tonight's accepted bundle dir (None if none). The
    reason, every validation and the pointer go through `repo`; a bundle that enters service is copied to its own
    version dir. `current` is not changed (the caller's copy may be a task's cached result)."""
    from llm4llm.config import AcceptSettings
    from llm4llm.stages.common import describe_workload

    cfg = cfg or AcceptSettings()
    wl = describe_workload(workload_path)
    name = wl["name"]
    night = night_decision(workload_path, candidate_bundle, dict(current) if current else None,
                           repo.bundle_versions(name), cfg)
    d, cur_version = night.decision, night.cur_version
    home = bundle_home(data_dir, name)
    if d.target == "candidate":
        new_version = repo.next_bundle_version(name)
        dst, digest = enter_service(home, new_version, candidate_bundle)
        repo.enter_service({"workload_name": name, "version": new_version, "run_id": run_id,
                            "workload_hash": wl["workload_hash"], "bundle_path": str(dst), "digest": digest})
    else:
        new_version = {"current": cur_version, "fallback": night.fb_version, None: None}[d.target]
    repo.record_night(night.validation_rows(run_id, name),
                      {"run_id": run_id, "workload_name": name, "decision": d.decision, "from_version": cur_version,
                       "to_version": new_version, "reason": d.reason})
    point_current(home, cur_version, new_version)
    print(f"service: {d.decision} (v{cur_version} -> v{new_version}): {d.reason}")
    return {"decision": d.decision, "from_version": cur_version, "to_version": new_version, "reason": d.reason,
            "validations": [{"subject": s, "version": ver, "ok": v.ok, "latency": v.latency}
                            for s, ver, v in night.checked]}
