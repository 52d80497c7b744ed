"""Prefect tasks of acceptance and end-to-end evaluation: the stages decide and measure, the rows they return are
written to DuckDB here (the stages write none)."""
from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact

from llm4llm.stages import accept as accept_stage, evaluate as evaluate_stage
from llm4llm.accept import GraphPlan
from llm4llm.config import AcceptSettings, EvaluateSettings
from storage.store import Store
from tasks.common import infrastructure_only


@task(name="accept-patches", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only)
def accept_patches(workload_path: str, run_id: str, cfg: AcceptSettings, db_path: str | None, data_dir: str,
                   task_ids: list[str] | None = None, base_bundle: str | None = None,
                   graphs: GraphPlan | None = None) -> dict:
    """task_ids: only these tasks' best candidates (default: every searched task's); base_bundle: an earlier step's
    bundle of this run that the trials start from; graphs: the run's CUDA-graph plan."""
    return run_acceptance(workload_path, run_id, db_path, data_dir, cfg, task_ids=task_ids, base_bundle=base_bundle,
                          graphs=graphs)


@task(name="evaluate-e2e", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only)
def evaluate_e2e(workload_path: str, db_path: str | None, bundle: str | None, settings: EvaluateSettings,
                 run_id: str | None, deadline: float | None = None) -> dict:
    """settings: the run's EvaluateSettings with its variants resolved (the flow picks them when they are None).
    deadline: Unix time by which the interleaved rounds end (the run's time budget)."""
    from llm4llm.evaluate import table_rows

    out = evaluate_stage.evaluate_recorded(workload_path, Store(db_path), settings, bundle=bundle, run_id=run_id,
                                           deadline=deadline)
    create_table_artifact(key="e2e", table=table_rows(out["rows"]),
                          description="End to end: eager vs torch.compile vs patched (and, when asked, with decode graphs)")
    return out


def best_proposals(run_id: str, db_path: str | None, min_utility: float = 0.0,
                   task_ids: list[str] | None = None) -> list:
    """Each searched task's best passing candidate (of `task_ids` alone when given), ranked against its search's
    pooled reference (storage.repo.best_candidates)."""
    from storage import repo
    from storage.db import Database

    with Database(db_path) as db:
        df = repo.best_candidates(db, run_id, min_utility)
    if task_ids is not None:
        df = df[df["task_id"].isin(task_ids)]
    return accept_stage.proposals_of(df)


def run_acceptance(workload_path: str, run_id: str, db_path: str | None, data_dir: str,
                   cfg: AcceptSettings | None = None, task_ids: list[str] | None = None,
                   base_bundle: str | None = None, graphs: GraphPlan | None = None) -> dict:
    """Deployment-time acceptance of the run's best candidates (llm4llm.stages.accept.run_accept), of `task_ids`
    alone when given, on top of `base_bundle` when given; decisions, the bundle and rejected reasons (as experience
    for the next search round) go to DuckDB. Returns its summary."""
    proposals = best_proposals(run_id, db_path, min_utility=0.0, task_ids=task_ids)
    outcome = accept_stage.run_accept(workload_path, run_id, proposals, data_dir, cfg, base_bundle=base_bundle,
                                      graphs=graphs)
    record_acceptance(outcome, db_path)
    return outcome.summary()


def record_acceptance(outcome: accept_stage.AcceptOutcome, db_path: str | None) -> None:
    """An acceptance step's rows: one per decision, one `episodes` row with its experience per rejection (the
    run's pseudo-search `accept-<run id>`), and the bundle."""
    from storage import repo
    from storage.db import Database
    from storage.rows import decision_rows, patch_row, rejection_episode_row

    result, run_id = outcome.result, outcome.run_id
    with Database(db_path) as db:
        for row in decision_rows(result, run_id):
            repo.record_acceptance(db, row)
        for i, task_id, experience in outcome.rejections:
            repo.record_episode(db, rejection_episode_row(run_id, i), experience, task_id)
        if result.bundle_dir:
            repo.record_patch_bundle(db, patch_row(run_id, outcome.workload_hash, result.bundle_dir,
                                                   outcome.manifest))
