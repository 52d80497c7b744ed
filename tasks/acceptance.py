"""Prefect tasks of acceptance and end-to-end evaluation: the stages decide and measure, and write their rows through
the repository handed to them (storage.store.Store)."""
from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact

from llm4llm.stages import accept as accept_stage, evaluate as evaluate_stage
from llm4llm.stages.accept import AcceptSummary
from llm4llm.stages.evaluate import EvaluateResult
from llm4llm.accept import GraphPlan
from llm4llm.config import AcceptSettings, EvaluateSettings
from storage.store import Store
from tasks.common import infrastructure_only


@task(name="accept-patches", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only)
def accept_patches(workload_path: str, run_id: str, cfg: AcceptSettings, db_path: str | None, data_dir: str,
                   task_ids: list[str] | None = None, base_bundle: str | None = None,
                   graphs: GraphPlan | None = None, deadline: float | None = None,
                   bundle_deadline: float | None = None) -> AcceptSummary:
    """task_ids: only these tasks' best candidates (default: every searched task's); base_bundle: an earlier step's
    bundle of this run that the trials start from; graphs: the run's CUDA-graph plan; deadline: Unix time by which
    acceptance ends what it can shorten (the run's time budget, less what evaluation needs); bundle_deadline: by
    which a regime's check at its largest batch ends (later: it decides what the bundle serves)."""
    return accept_stage.accept_recorded(workload_path, run_id, Store(db_path), data_dir, cfg, task_ids=task_ids,
                                        base_bundle=base_bundle, graphs=graphs, deadline=deadline,
                                        bundle_deadline=bundle_deadline)


@task(name="evaluate-e2e", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only)
def evaluate_e2e(workload_path: str, db_path: str | None, bundle: str | None, settings: EvaluateSettings,
                 run_id: str | None, deadline: float | None = None) -> EvaluateResult:
    """settings: the run's EvaluateSettings with its variants resolved (the flow picks them when they are None).
    deadline: Unix time by which the interleaved rounds end (the run's time budget)."""
    from llm4llm.evaluate import table_rows

    out = evaluate_stage.evaluate_recorded(workload_path, Store(db_path), settings, bundle=bundle, run_id=run_id,
                                           deadline=deadline)
    create_table_artifact(key="e2e", table=table_rows(out.rows),
                          description="End to end: eager vs torch.compile vs patched (and, when asked, with decode graphs)")
    return out
