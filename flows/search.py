from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.profiling import _defaults
from flows.progress import run_log
from llm4llm.config import SearchSettings
from llm4llm.llm.config import LLMConfig
from llm4llm.scale import ScaleOut
from tasks.search import (SearchSummary, close_pools, record_search, remote_search_input, search_task,
                          search_task_remote, searchable_tasks)


@flow(name="search-tasks", log_prints=True)
def search_tasks(run_id: str, settings: SearchSettings | None = None, db_path: str | None = None,
                 data_dir: str | None = None, device: str = "cpu", task_ids: list[str] | None = None,
                 llm: LLMConfig | dict | None = None, scale: ScaleOut | None = None) -> list[SearchSummary]:
    """Fan out one search per task of a run (`settings`: llm4llm.config.SearchSettings; its families and top pick
    the tasks unless task_ids names them). Timing is one job per GPU at a time: all searches share the device's
    single verifier worker, whose lock serializes them (the settings' decode_timing says how it times). With
    `scale.task_runner == "ray"` (run this flow through `search_flow(scale)`), each search is a Ray task holding its
    own GPU and verifier worker, and returns its rows, which this flow writes: DuckDB keeps one writer."""
    with run_log():  # each trial's line in the search task run's Prefect log
        return _search_tasks(run_id, settings, db_path, data_dir, device, task_ids, llm, scale)


def _search_tasks(run_id: str, settings: SearchSettings | None, db_path: str | None, data_dir: str | None,
                  device: str, task_ids: list[str] | None, llm: LLMConfig | dict | None,
                  scale: ScaleOut | None) -> list[SearchSummary]:
    s = settings if settings is not None else SearchSettings(top=None)
    data_dir = _defaults(data_dir)
    llm = llm.model_dump() if isinstance(llm, LLMConfig) else llm
    ray = scale is not None and scale.task_runner == "ray"
    dirs = searchable_tasks(run_id, db_path, s, device, task_ids, searched_here=not ray)
    if ray:
        kw = dict(settings=s, device=device, run_id=run_id, llm=llm)
        results = _search_remote(dirs, scale, db_path, data_dir, kw)
    else:
        try:
            futures = [search_task.submit(d, s, db_path, data_dir, device, run_id, llm) for d in dirs]
            results = [f.result() for f in futures]
        finally:
            close_pools()
    if results:
        create_table_artifact(key="search", table=[{"task_id": r.task_id, "trials": r.trials, "pass_rate": r.pass_rate,
                                                    "best_utility": r.best_utility, "ended_by": r.ended_text}
                                                   for r in results],
                              description=f"Search results of run {run_id} ({s.mode}, budget {s.trials()})")
    return results


def _search_remote(dirs: list[str], scale: ScaleOut, db_path: str | None, data_dir: str,
                   kw: dict) -> list[SearchSummary]:
    """Every search as a Ray task with `gpus_per_eval` GPUs; rows written here as each search comes back."""
    from prefect_ray.context import remote_options

    _check_cluster(scale)
    with remote_options(num_gpus=scale.gpus_per_eval, num_cpus=scale.cpus_per_eval):
        futures = [search_task_remote.submit(**remote_search_input(d, db_path), **kw) for d in dirs]
    return [record_search(f.result(), db_path, data_dir) for f in futures]


def _check_cluster(scale: ScaleOut) -> None:
    """A search asking for more GPUs than the cluster has would wait forever: fail at once instead."""
    import ray

    from llm4llm.errors import Llm4llmError

    have = ray.cluster_resources().get("GPU", 0.0)
    if scale.gpus_per_eval > have:
        raise Llm4llmError(f"ray cluster: expected at least {scale.gpus_per_eval:g} GPU for one search, got {have:g} "
                           "(--ray-gpus-per-eval 0 runs CPU workloads on a cluster without GPUs)")


def search_flow(scale: ScaleOut | None = None):
    """search_tasks with the task runner `scale` asks for: as it is (local), or on prefect-ray's RayTaskRunner
    joined to `scale.ray_address` (None: a local Ray instance that lives as long as the flow run)."""
    if scale is None or scale.task_runner == "local":
        return search_tasks
    from prefect_ray import RayTaskRunner

    return search_tasks.with_options(task_runner=RayTaskRunner(address=scale.ray_address,
                                                               init_kwargs=dict(scale.ray_init)))
