"""Pure stage functions that the Prefect tasks wrap. Each takes and returns paths, ids and small dicts, never tensors
or modules, so Prefect can hash, cache and retry them."""
from __future__ import annotations

import gc
import hashlib
import json
import uuid
from dataclasses import asdict
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

from llm4llm.records import ModuleRecord, PhaseInfo, ProfileResult

PACKAGES = ("llm4llm", "kernels_runtime")


@lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of the project's own source (part of every cache key: a code change re-runs the stages)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def hardware_fingerprint(device: str) -> str:
    from llm4llm.profiler import hardware_info

    info = hardware_info(device)
    keys = ("device", "gpu_name", "capability", "torch", "triton", "transformers")
    return "|".join(str(info.get(k, "")) for k in keys)


def describe_workload(workload_path: str) -> dict:
    """Validate a workload file (raises WorkloadError) and return its identity."""
    from llm4llm.workload import load_workload

    wl = load_workload(workload_path)
    return {
        "workload_hash": wl.content_hash(),
        "name": wl.name,
        "path": str(Path(workload_path).resolve()),
        "device": wl.device,
        "config": json.loads(wl.model_dump_json()),
    }


def new_run_id(name: str) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{name}-{stamp}-{uuid.uuid4().hex[:6]}"


def _build(workload_path: str):
    from llm4llm.workload import call_script, load_script, load_workload

    wl = load_workload(workload_path)
    script = load_script(wl)
    model = call_script(script.build, wl)
    batch = call_script(script.inputs, wl)

    def run_fn():
        return call_script(script.run, model, wl, batch)

    return wl, model, run_fn


def _free(*objs) -> None:
    del objs
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


def run_profile(workload_path: str, data_dir: str) -> str:
    """Build the model through the user's script, profile it per phase; write `profile.json` under a new run dir
    and return its path. Nothing touches the database here."""
    from llm4llm.profiler import profile_model

    wl, model, run_fn = _build(workload_path)
    started = datetime.now(timezone.utc).replace(tzinfo=None)
    result = profile_model(model, run_fn, device=wl.device, phase_weights=wl.phase_weights)
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
    path = run_dir / "profile.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    tmp.replace(path)
    _free(model, run_fn)
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


def record_profile(profile_path: str, workload: dict, db_path: str | None) -> str:
    """Write the run and its profile rows to DuckDB in one transaction. Idempotent for a cached profile."""
    from storage import repo
    from storage.db import Database

    payload, result = load_profile(profile_path)
    run_id = payload["run_id"]
    with Database(db_path) as db:
        if repo.get_run(db, run_id) is not None:
            return run_id
        hw = result.hardware
        run = {
            "run_id": run_id,
            "workload_hash": payload["workload_hash"],
            "workload_name": payload["workload_name"],
            "kind": "profile",
            "status": "ok",
            "started_at": payload["started_at"],
            "device": hw.get("device"),
            "gpu_name": hw.get("gpu_name"),
            "capability": hw.get("capability"),
            "torch_version": hw.get("torch"),
            "triton_version": hw.get("triton"),
            "transformers_version": hw.get("transformers"),
            "timer": result.timer,
            "prefill_ms": result.phases["prefill"].time_ms if "prefill" in result.phases else None,
            "decode_ms": result.phases["decode"].time_ms if "decode" in result.phases else None,
            "prefill_forwards": result.phases["prefill"].forwards if "prefill" in result.phases else 0,
            "decode_forwards": result.phases["decode"].forwards if "decode" in result.phases else 0,
            "artifact_dir": str(Path(profile_path).parent),
        }
        rows = [
            {k: getattr(r, k) for k in ("phase", "module_path", "class_name", "family", "depth", "calls", "time_ms",
                                        "share", "hotspot_score", "in_shapes", "out_shapes")}
            for r in result.records
        ]
        repo.record_profile_run(db, run, workload, rows)
    return run_id


def run_extract(workload_path: str, profile_path: str, data_dir: str, min_score: float = 0.0) -> str:
    """Re-run the workload with capture hooks on the profiled hotspots and write task artifacts; returns the path
    of `tasks.json` (the run's task index)."""
    from llm4llm.extract import extract_tasks

    payload, profile = load_profile(profile_path)
    wl, model, run_fn = _build(workload_path)
    specs = extract_tasks(
        model, run_fn, profile, Path(data_dir) / "tasks",
        workload_name=wl.name, run_id=payload["run_id"], hardware=profile.hardware, min_score=min_score,
    )
    index = [json.loads(s.model_dump_json()) | {"artifact_path": str(Path(data_dir) / "tasks" / s.task_id)
                                                if s.deployable else None} for s in specs]
    path = Path(profile_path).parent / "tasks.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(index, indent=1, default=str))
    tmp.replace(path)
    _free(model, run_fn)
    return str(path)


def record_task_index(index_path: str, run_id: str, db_path: str | None) -> int:
    from storage import repo
    from storage.db import Database

    index = json.loads(Path(index_path).read_text())
    rows = [
        {
            "task_id": t["task_id"],
            "family": t["family"],
            "module_class": t["module_class"],
            "phase": t["phase"],
            "instances": len(t["instances"]),
            "shapes": [c for c in t.get("cases", [])],
            "dtype": t["dtype"],
            "artifact_path": t.get("artifact_path"),
            "score": float(t.get("hotspot_score", 0.0)),
            "time_ms": float(t.get("time_ms", 0.0)),
            "deployable": bool(t["deployable"]),
            "reason": t.get("reason", ""),
        }
        for t in index
    ]
    with Database(db_path) as db:
        return repo.record_tasks(db, run_id, rows)


def hotspot_rows(result: ProfileResult, top: int | None = None) -> list[ModuleRecord]:
    """Ranked hotspots, leaving out the top-level model (its share is 1 by definition)."""
    rows = [r for r in result.ranked() if r.depth > 0]
    return rows[:top] if top else rows
