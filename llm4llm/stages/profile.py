"""The profile stage: profile the workload per phase into `profile.json`, read it back, rank its hotspots, and start
the run with its rows through the repository handed in (record_run; storage.store.Store on DuckDB)."""
from __future__ import annotations

import json
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from llm4llm.records import ModuleRecord, PhaseInfo, ProfileResult
from llm4llm.stages.common import _build, _free, _write_json, new_run_id
from llm4llm.workload import script_stage


class ProfiledRun(BaseModel):
    """A profiled run, as the profile-workload flow returns it to the optimize flow and the CLI (frozen: handed on
    unchanged). run_id: the run this profile was recorded under (a cached profile is recorded again under a new
    one); profile_path: its `profile.json`; workload: the workload's identity (common.describe_workload's dict:
    workload_hash, name, path, device, config; a dict, as the tasks' cache keys and storage read it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    profile_path: str
    workload: dict[str, Any]


@script_stage("profile")
def run_profile(workload_path: str, data_dir: str) -> str:
    """Build the model through the user's script, profile it per phase; write `profile.json` under a new run dir
    and return its path. Nothing touches the database here."""
    from llm4llm import progress
    from llm4llm.profiler import profile_model

    progress.start(f"profile:{workload_path}", f"profile {Path(workload_path).stem}", None)
    wl, model, run_fn = _build(workload_path)
    started = datetime.now(timezone.utc).replace(tzinfo=None)
    # On the GPU each phase reports the median of 3 recorded runs: one host stall must not make one module look
    # like the hotspot.
    repeats = 3 if wl.device.startswith("cuda") else 1
    result = profile_model(model, run_fn, device=wl.device, phase_weights=wl.phase_weights, repeats=repeats)
    run_id = new_run_id(wl.name)
    run_dir = Path(data_dir) / "runs" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "run_id": run_id,
        "workload_hash": wl.content_hash(),
        "workload_name": wl.name,
        "started_at": started.isoformat(),
        "profile": asdict(result),
    }
    path = _write_json(run_dir / "profile.json", payload)
    del model, run_fn
    _free()
    progress.done(f"profile:{workload_path}")
    return str(path)


class RunRepository(Protocol):
    """Where a run starts (storage.store.Store on DuckDB): the stage opens no database."""

    def has_run(self, run_id: str) -> bool: ...

    def record_profile_run(self, payload: dict, result: ProfileResult, run_id: str, started: str,
                           profile_of: str | None, artifact_dir: str, kind: str, flow_run_id: str | None,
                           workload: dict) -> None:
        """The run's `runs` row and its profile rows, in one transaction."""


def record_run(profile_path: str, workload: dict, repo: RunRepository, kind: str = "cli",
               flow_run_id: str | None = None) -> str:
    """Start a run: its `runs` row (what started it: `kind`; the Prefect flow run) and its profile rows, through
    `repo`. Every call is a run of its own: a profile that an earlier run recorded (served from the cache) is
    recorded again under a new run id, its `profile_of` naming the run that measured it, so no run writes into
    another's rows. Returns the run id."""
    payload, result = load_profile(profile_path)
    run_id, profile_of, started = payload["run_id"], None, payload["started_at"]
    if repo.has_run(run_id):
        run_id, profile_of = new_run_id(payload["workload_name"]), run_id
        started = datetime.now(timezone.utc).replace(tzinfo=None).isoformat()
    repo.record_profile_run(payload, result, run_id, started, profile_of, str(Path(profile_path).parent), kind,
                            flow_run_id, workload)
    return run_id


def load_profile(profile_path: str) -> tuple[dict, ProfileResult]:
    payload = json.loads(Path(profile_path).read_text())
    p = payload["profile"]
    result = ProfileResult(
        phases={k: PhaseInfo(**v) for k, v in p["phases"].items()},
        records=[ModuleRecord(**r) for r in p["records"]],
        hardware=p["hardware"],
        timer=p["timer"],
    )
    return payload, result


def hotspot_rows(result: ProfileResult, top: int | None = None) -> list[ModuleRecord]:
    """Ranked hotspots, leaving out the top-level model (its share is 1 by definition)."""
    rows = [r for r in result.ranked() if r.depth > 0]
    return rows[:top] if top else rows


def hotspot_table(result: ProfileResult, top: int | None = None) -> list[dict]:
    """The ranked hotspots (hotspot_rows) as table rows: rank, module, class, family, phase, calls, time and share."""
    return [{"rank": i + 1, "module": r.module_path or "<model>", "class": r.class_name, "family": r.family,
             "phase": r.phase, "calls": r.calls, "time_ms": round(r.time_ms, 3), "share": round(r.share, 4),
             "hotspot_score": round(r.hotspot_score, 4)}
            for i, r in enumerate(hotspot_rows(result, top))]
