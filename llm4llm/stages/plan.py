"""The plan stage: read what a plan needs (the run's extracted tasks, this database's history of what each family
reaches, the workload's last stage times, whether a template covers a task) through the repository handed in
(PlanRepository: storage.store.Store on DuckDB), make it (llm4llm.planner), and store it."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Protocol

from llm4llm import planner
from llm4llm.config import OptimizeConfig, SearchSettings
from llm4llm.stages.profile import load_profile
from llm4llm.stages.search import SearchRepository, check_applicability


class PlanRepository(SearchRepository, Protocol):
    """What planning reads and writes, besides the template checks a search reads (storage.store.Store)."""

    def family_best_speedups(self, gpu_name: str) -> list[dict]: ...

    def last_stage_seconds(self, workload_name: str, device_kind: str) -> dict[str, float]: ...

    def record_plan_step(self, run_id: str, rows: list[dict]) -> None:
        """The plan's rows as the run's next step (`plans` rows with their `step`)."""


def device_kind(device: str) -> str:
    """`cuda` for any CUDA device, else `cpu`: stage times are kept per kind of device."""
    return "cuda" if device.startswith("cuda") else "cpu"


def make_run_plan(index_path: str, profile_path: str, run_id: str, workload: dict, cfg: OptimizeConfig,
                  repo: PlanRepository, started_wall: float, searched: list[str] | None = None,
                  excluded: list[str] | None = None) -> planner.Plan:
    """The run's plan (llm4llm.planner.make_plan) after extraction, or again after an acceptance step (`searched`:
    tasks searched so far; `excluded`: tasks searched whole that found nothing or were rejected, whose children
    then count). Each target's template coverage is checked before it counts (most valuable first, one at a time:
    a task no template covers hands its place to the modules inside it)."""
    views = [planner.TaskView.of(t) for t in json.loads(Path(index_path).read_text())]
    views = [v for v in views if not v.deployable or v.artifact_path]
    device, s = workload["device"], cfg.search
    history, past, gpu = _history(repo, workload["name"], device, profile_path)
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
        covers[unchecked[0].task_id] = _covered(unchecked[0], s, device, repo, run_id,
                                                cfg.scale.task_runner != "ray")


def store_plan(run_id: str, plan: planner.Plan, repo: PlanRepository) -> None:
    """The plan as the run's next step of `plans` rows, each with the plan's budget and search share."""
    repo.record_plan_step(run_id, [i.row(run_id, k) | {"budget_s": plan.budget_s, "search_s": plan.search_s}
                                   for k, i in enumerate(plan.items)])


def _covered(item: planner.PlanItem, settings: SearchSettings, device: str, repo: PlanRepository,
             run_id: str, searched_here: bool = True) -> bool:
    """Whether the proposer can write for the task: the LLM proposers can for any task; the built-in library when
    one of its templates computes what the module does, checked on the device (recorded checks are reused)."""
    if settings.proposer != "library":
        return True
    from llm4llm.search.builtin import LibraryProposer
    from llm4llm.taskspec import load_spec

    spec = load_spec(Path(item.artifact_path))
    if not LibraryProposer().templates_for(spec):
        return False
    checks = check_applicability(item.artifact_path, repo, run_id, device, settings, searched_here)
    return any(c.applicable for c in checks)


def _history(repo: PlanRepository, workload_name: str, device: str, profile_path: str):
    """(family speedups on this GPU, the workload's last stage seconds on this device kind, the GPU's name)."""
    _, result = load_profile(profile_path)
    gpu = (result.hardware or {}).get("gpu_name")
    rows = repo.family_best_speedups(gpu) if gpu else []
    past = repo.last_stage_seconds(workload_name, device_kind(device))
    return planner.history_speedups(rows), past, gpu


def _run_seconds(profile_path: str) -> float:
    """The workload's eager run time as profiled (prefill + decode), in seconds."""
    _, result = load_profile(profile_path)
    return sum(p.time_ms for p in result.phases.values()) / 1e3
