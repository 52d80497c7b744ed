"""The extract stage: capture the profiled hotspots as task artifacts and the run's task index (`tasks.json`). The index
reaches DuckDB through storage.store.Store.record_task_index (the record-tasks task)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from llm4llm.stages.common import _build, _free, _write_json
from llm4llm.stages.profile import load_profile, run_profile
from llm4llm.workload import script_stage


class ExtractedTasks(BaseModel):
    """A run's extracted tasks, as the extract-tasks flow returns them to the optimize flow (frozen: handed on
    unchanged). run_id: the profiled run they belong to; index_path: the run's task index (`tasks.json`); tasks: how
    many tasks were recorded."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    index_path: str
    tasks: int


@script_stage("extract")
def run_extract(workload_path: str, profile_path: str, data_dir: str, min_score: float = 0.0,
                static_cache: bool = False, min_share: float = 0.0) -> str:
    """Re-run the workload with capture hooks on the profiled hotspots and write task artifacts; returns the path
    of `tasks.json` (the run's task index). static_cache: KV-cache decode tasks captured on transformers' static
    cache, as decode graphs will run them (extract_tasks); min_share: the acceptance's delta, below which a module
    class's whole share is not captured (extract.below_share)."""
    from llm4llm import progress
    from llm4llm.extract import extract_tasks

    progress.start(f"extract:{profile_path}", f"extract tasks {Path(workload_path).stem}", None)
    payload, profile = load_profile(profile_path)
    t0 = time.perf_counter()
    wl, model, run_fn = _build(workload_path, corners=True)
    progress.note(f"extract: model built in {time.perf_counter() - t0:.1f} s")
    # a regime's corners and batch buckets are captured as cases of the same tasks (each point adds a prefill and a
    # decode shape)
    corners = len(wl.regime.points(wl.decode_len)) if wl.regime is not None else 0
    specs = extract_tasks(
        model, run_fn, profile, Path(data_dir) / "tasks",
        workload_name=wl.name, run_id=payload["run_id"], hardware=profile.hardware, min_score=min_score,
        max_cases=4 + 2 * corners,
        static_cache=static_cache,
        accuracy_budget=wl.lossy_budget(),
        regime=wl.regime is not None,
        min_share=min_share,
    )
    index = [json.loads(s.model_dump_json()) | {"artifact_path": str(Path(data_dir) / "tasks" / s.task_id)
                                                if s.deployable else None} for s in specs]
    path = _write_json(Path(profile_path).parent / "tasks.json", index)
    del model, run_fn
    _free()
    progress.done(f"extract:{profile_path}")
    return str(path)


def extract_to_temp(workload_path: str, prefix: str = "llm4llm-") -> list:
    """Profile and extract a workload into a fresh temporary directory, without a database: its tasks (specs only,
    cases left on disk), in directory order. For the device scripts that need a workload's tasks outside a run."""
    import tempfile

    from llm4llm.taskspec import load_task

    data = tempfile.mkdtemp(prefix=prefix)
    run_extract(workload_path, run_profile(workload_path, data), data)
    root = Path(data) / "tasks"
    return [load_task(d, with_cases=False) for d in sorted(root.iterdir()) if (d / "spec.json").exists()]


def task_table(index_path: str) -> list[dict]:
    """The task index (run_extract's tasks.json) as table rows: one per task, its family, phase, instance count,
    hotspot score, whether it is deployable and why not."""
    index = json.loads(Path(index_path).read_text())
    return [{"task_id": t["task_id"], "family": t["family"], "phase": t["phase"], "instances": len(t["instances"]),
             "score": round(float(t.get("hotspot_score", 0.0)), 4), "deployable": t["deployable"],
             "reason": t.get("reason", "")} for t in index]
