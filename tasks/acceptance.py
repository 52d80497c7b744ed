from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact

from llm4llm.stages import accept as accept_stage, evaluate as evaluate_stage
from llm4llm.accept import AcceptConfig
from tasks.common import infrastructure_only


@task(name="accept-patches", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only)
def accept_patches(workload_path: str, run_id: str, cfg: AcceptConfig, db_path: str | None, data_dir: str) -> dict:
    return accept_stage.run_accept(workload_path, run_id, db_path, data_dir, cfg)


@task(name="evaluate-e2e", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only)
def evaluate_e2e(workload_path: str, db_path: str | None, bundle: str | None, repeats: int,
                 variants: tuple[str, ...], run_id: str | None) -> dict:
    from llm4llm.evaluate import table_rows

    out = evaluate_stage.run_evaluate(workload_path, db_path, bundle=bundle, repeats=repeats, variants=variants,
                                      run_id=run_id)
    create_table_artifact(key="e2e", table=table_rows(out["rows"]),
                          description="End to end: eager vs torch.compile vs patched (and, when asked, with decode graphs)")
    return out
