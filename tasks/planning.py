"""Prefect tasks of the planner (llm4llm.stages.plan): make the run's plan and store it, and the run's stage times,
through the repository handed to them (storage.store.Store)."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from llm4llm import planner
from llm4llm.config import OptimizeConfig
from llm4llm.stages import plan as plan_stage
from storage.store import Store


@task(name="plan-search", cache_policy=NO_CACHE)
def plan_search(index_path: str, profile_path: str, run_id: str, workload: dict, cfg: OptimizeConfig,
                db_path: str | None, started_wall: float, searched: list[str] | None = None,
                excluded: list[str] | None = None) -> planner.Plan:
    return plan_stage.make_run_plan(index_path, profile_path, run_id, workload, cfg, Store(db_path), started_wall,
                                    searched, excluded)


@task(name="record-plan", cache_policy=NO_CACHE)
def record_plan(run_id: str, plan: planner.Plan, db_path: str | None) -> None:
    plan_stage.store_plan(run_id, plan, Store(db_path))


@task(name="record-stage-times", cache_policy=NO_CACHE)
def record_stage_times(run_id: str, workload_name: str, device: str, spans: list[dict], db_path: str | None) -> None:
    """The run's stage spans (llm4llm.planner.Clock.spans) as `stage_times` rows."""
    Store(db_path).record_stage_times(run_id, workload_name, plan_stage.device_kind(device), spans)
