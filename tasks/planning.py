"""Prefect tasks of the planner: read what a plan needs (the run's extracted tasks, this database's history of what
each family reaches, the workload's last stage times, whether a template covers a task), make it
(llm4llm.planner), and store it with the run's stage times."""
from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from llm4llm import planner
from llm4llm.config import OptimizeConfig, SearchSettings
from llm4llm.stages import search as search_stage
from storage.store import Store


@task(name="plan-search", cache_policy=NO_CACHE)
def plan_search(index_path: str, profile_path: str, run_id: str, workload: dict, cfg: OptimizeConfig,
                db_path: str | None, started_wall: float, searched: list[str] | None = None,
                excluded: list[str] | None = None) -> planner.Plan:
    """The run's plan (llm4llm.planner.make_plan) after extraction, or again after an acceptance step (`searched`:
    tasks searched so far; `excluded`: tasks searched whole that found nothing or were rejected, whose children
    then count). Each target's template coverage is checked before it counts (most valuable first, one at a time:
    a task no template covers hands its place to the modules inside it)."""
    views = [planner.TaskView.of(t) for t in json.loads(Path(index_path).read_text())]
    views = [v for v in views if not v.deployable or v.artifact_path]
    device, s = workload["device"], cfg.search
    history, past, gpu = _history(db_path, workload["name"], device, profile_path)
    run_s = _run_seconds(profile_path)
    covers: dict[str, bool] = {}
    while True:
        plan = planner.make_plan(
            views, device=device, run_s=run_s, delta=cfg.accept.delta, budget_s=cfg.time_budget_s,
            elapsed_s=time.time() - started_wall, history=history, past=past, covers=covers,
            excluded=excluded or (), searched=searched or (), families=s.families, phases=s.phases, top=s.top,
            trials=s.budget, stages=cfg.stages)
        unchecked = [i for i in plan.targets() if i.task_id not in covers]
        if not unchecked:
            if gpu:
                plan.notes.append(f"expected speedups: this database's searches on {gpu} where it has them, else "
                                  "the measured priors")
            return plan
        covers[unchecked[0].task_id] = _covered(unchecked[0], s, device, db_path, run_id)


def _covered(item: planner.PlanItem, settings: SearchSettings, device: str, db_path: str | None,
             run_id: str) -> bool:
    """Whether the proposer can write for the task: the LLM proposers can for any task; the built-in library when
    one of its templates computes what the module does, checked on the device (recorded checks are reused)."""
    if settings.proposer != "library":
        return True
    from llm4llm.search.builtin import LibraryProposer
    from llm4llm.taskspec import load_spec

    spec = load_spec(Path(item.artifact_path))
    if not LibraryProposer().templates_for(spec):
        return False
    checks = search_stage.check_applicability(item.artifact_path, Store(db_path), run_id, device, settings)
    return any(c["applicable"] for c in checks)


def _history(db_path: str | None, workload_name: str, device: str, profile_path: str):
    """(family speedups on this GPU, the workload's last stage seconds on this device kind, the GPU's name)."""
    from llm4llm.stages.profile import load_profile
    from storage import repo
    from storage.db import Database

    payload, result = load_profile(profile_path)
    gpu = (result.hardware or {}).get("gpu_name")
    kind = "cuda" if device.startswith("cuda") else "cpu"
    with Database(db_path) as db:
        rows = repo.family_best_speedups(db, gpu) if gpu else []
        past = repo.last_stage_seconds(db, workload_name, kind)
    return planner.history_speedups(rows), past, gpu


def _run_seconds(profile_path: str) -> float:
    """The workload's eager run time as profiled (prefill + decode), in seconds."""
    from llm4llm.stages.profile import load_profile

    _, result = load_profile(profile_path)
    return sum(p.time_ms for p in result.phases.values()) / 1e3


@task(name="record-plan", cache_policy=NO_CACHE)
def record_plan(run_id: str, plan: planner.Plan, db_path: str | None) -> None:
    from storage import repo
    from storage.db import Database

    with Database(db_path) as db:
        step = repo.plan_steps(db, run_id)
        rows = [i.row(run_id, k) | {"step": step, "budget_s": plan.budget_s, "search_s": plan.search_s}
                for k, i in enumerate(plan.items)]
        repo.record_plan(db, rows)


@task(name="record-stage-times", cache_policy=NO_CACHE)
def record_stage_times(run_id: str, workload_name: str, device: str, spans: list[dict], db_path: str | None) -> None:
    """The run's stage spans (llm4llm.planner.Clock.spans) as `stage_times` rows."""
    from datetime import datetime, timezone

    from storage import repo
    from storage.db import Database

    kind = "cuda" if device.startswith("cuda") else "cpu"
    rows = [{"run_id": run_id, "workload_name": workload_name, "device": kind, "seq": k, "stage": s["stage"],
             "note": s.get("note") or "", "start_s": s["start_s"], "seconds": s["end_s"] - s["start_s"],
             "trials": s.get("trials"),
             "started_at": datetime.fromtimestamp(s["started_at"], timezone.utc).replace(tzinfo=None)}
            for k, s in enumerate(spans) if s.get("end_s") is not None]
    with Database(db_path) as db:
        repo.record_stage_times(db, rows)
