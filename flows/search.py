from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.profiling import _defaults
from llm4llm import pipeline
from llm4llm.config import SearchSettings
from llm4llm.llm.config import LLMConfig
from tasks.search import search_task, searchable_tasks


@flow(name="search-tasks", log_prints=True)
def search_tasks(run_id: str, settings: SearchSettings | None = None, db_path: str | None = None,
                 data_dir: str | None = None, device: str = "cpu", task_ids: list[str] | None = None,
                 llm: LLMConfig | dict | None = None, decode_timing: str = "launch") -> list[dict]:
    """Fan out one search per task of a run (`settings`: llm4llm.config.SearchSettings; its families and top pick
    the tasks unless task_ids names them). Timing is one job per GPU at a time: all searches share the device's
    single verifier worker, whose lock serializes them. decode_timing: "launch" (back to back), "graph" (GPU time
    under CUDA-graph replay, for a run whose decode steps replay from graphs) or "graph_prefill" (prefill tasks too,
    where the prompt forward replays from graphs as well)."""
    s = settings if settings is not None else SearchSettings(top=None)
    data_dir = _defaults(data_dir)
    llm = llm.model_dump() if isinstance(llm, LLMConfig) else llm
    dirs = searchable_tasks(run_id, db_path, task_ids, s.families, s.top, s.proposer)
    try:
        futures = [search_task.submit(d, s, db_path, data_dir, device, run_id, llm, decode_timing) for d in dirs]
        results = [f.result() for f in futures]
    finally:
        pipeline.close_pools()
    if results:
        create_table_artifact(key="search", table=[{k: r[k] for k in ("task_id", "trials", "pass_rate",
                                                                      "best_utility")} for r in results],
                              description=f"Search results of run {run_id} ({s.mode}, budget {s.budget})")
    return results
