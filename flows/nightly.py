"""The nightly run of a workload: re-validate the bundle in service, re-optimize from stored experience, and keep,
replace or roll back."""
from __future__ import annotations

from prefect import flow

from flows.gpu import gpu_slot
from flows.optimize import optimize_workload
from flows.profiling import _defaults
from llm4llm.config import OptimizeConfig
from llm4llm.outcome import NightlyResult
from tasks.profiling import describe
from tasks.service import decide_service, revalidate_current


@flow(name="nightly-workload", log_prints=True)
def nightly_workload(workload_path: str, config: OptimizeConfig = OptimizeConfig(), db_path: str | None = None,
                     data_dir: str | None = None) -> NightlyResult:
    """One night: (1) the bundle in service re-validated against tonight's torch, triton, driver, GPU and workload
    (in-model correctness; latency on a GPU, skipped and said so on the CPU); (2) the closed loop, a run of kind
    `nightly` with its own run id even when the profile comes from the cache, each task's search warm-started from
    its stored experience;
    (3) keep / replace / rollback, the reason in DuckDB (service_decisions), the bundle that enters service copied
    to a new version dir and `current` pointed at it. The whole night holds the device's GPU slot. Returns a
    NightlyResult: the optimize run's OptimizeResult as it returned it, and the service decision.

    Args:
        workload_path: the workload's TOML file (examples/workloads/*.toml), as the worker's host sees it
        config: every setting of tonight's closed loop (the default is what `llm4llm optimize` runs without options)
        db_path: DuckDB file the night writes (empty: $LLM4LLM_DB, else $LLM4LLM_HOME/llm4llm.duckdb)
        data_dir: where profiles, tasks, candidates and bundles go (empty: $LLM4LLM_HOME, else ./.llm4llm)
    """
    cfg = config if config is not None else OptimizeConfig()  # None: a caller that passes no settings
    data_dir = _defaults(data_dir)
    with gpu_slot(describe(workload_path)["device"]):
        current = revalidate_current(workload_path, db_path, cfg.accept)
        out = optimize_workload(workload_path, cfg, db_path=db_path, data_dir=data_dir, kind="nightly")
        service = decide_service(workload_path, out.run_id, out.bundle, current, db_path, data_dir, cfg.accept)
    return NightlyResult(optimize=out, service=service)
