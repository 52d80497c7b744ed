"""The profile stage: profile the workload per phase into `profile.json`, record it in DuckDB, rank its hotspots."""
from __future__ import annotations

import json
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from llm4llm.records import ModuleRecord, PhaseInfo, ProfileResult
from llm4llm.stages.common import _build, _free, _write_json, new_run_id
from storage.rows import profile_row, run_row


def run_profile(workload_path: str, data_dir: str) -> str:
    """Build the model through the user's script, profile it per phase; write `profile.json` under a new run dir
    and return its path. Nothing touches the database here."""
    from llm4llm import progress
    from llm4llm.profiler import profile_model

    progress.start(f"profile:{workload_path}", f"profile {Path(workload_path).stem}", None)
    wl, model, run_fn = _build(workload_path)
    started = datetime.now(timezone.utc).replace(tzinfo=None)
    # On the GPU each phase reports the median of 3 recorded runs: one host stall (seen once: a 0.5 s v_proj call
    # in 63 decode steps of qwen3-4b) must not make one module look like the hotspot.
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
    _free(model, run_fn)
    progress.done(f"profile:{workload_path}")
    return str(path)


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


def record_profile(profile_path: str, workload: dict, db_path: str | None, new_run: bool = False) -> str:
    """Write the run and its profile rows to DuckDB in one transaction. Idempotent for a cached profile, unless
    new_run: then a profile whose run is recorded already is recorded again under a new run id (its `profile_of`
    names the run that measured it), so that a run served from the cache still has rows of its own."""
    from storage import repo
    from storage.db import Database

    payload, result = load_profile(profile_path)
    run_id, profile_of = payload["run_id"], None
    started = payload["started_at"]
    with Database(db_path) as db:
        if repo.get_run(db, run_id) is not None:
            if not new_run:
                return run_id
            run_id, profile_of = new_run_id(payload["workload_name"]), run_id
            started = datetime.now(timezone.utc).replace(tzinfo=None).isoformat()
        run = run_row(payload, result, run_id, started, profile_of, str(Path(profile_path).parent))
        repo.record_profile_run(db, run, workload, [profile_row(r) for r in result.records])
    return run_id


def hotspot_rows(result: ProfileResult, top: int | None = None) -> list[ModuleRecord]:
    """Ranked hotspots, leaving out the top-level model (its share is 1 by definition)."""
    rows = [r for r in result.ranked() if r.depth > 0]
    return rows[:top] if top else rows

