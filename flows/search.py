from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.profile import _defaults
from llm4llm import pipeline
from tasks.search import search_task, searchable_tasks


@flow(name="search-tasks", log_prints=True)
def search_tasks(run_id: str, db_path: str | None = None, data_dir: str | None = None, mode: str = "episodic",
                 budget: int = 15, proposer: str = "library", device: str = "cpu", timeout_s: float = 120.0,
                 seed: int = 0, task_ids: list[str] | None = None, families: list[str] | None = None,
                 top: int | None = None, llm: dict | None = None, decode_timing: str = "launch") -> list[dict]:
    """Fan out one search per task of a run. Timing is one job per GPU at a time: all searches share the device's
    single verifier worker, whose lock serializes them. decode_timing: "launch" (back to back), "graph" (GPU time
    under CUDA-graph replay, for a run whose decode steps replay from graphs) or "graph_prefill" (prefill tasks too,
    where the prompt forward replays from graphs as well)."""
    data_dir = _defaults(data_dir)
    dirs = searchable_tasks(run_id, db_path, task_ids, families, top, proposer, device, timeout_s, decode_timing)
    try:
        futures = [search_task.submit(d, db_path, data_dir, mode, budget, proposer, device, timeout_s, seed, run_id,
                                      llm, decode_timing) for d in dirs]
        results = [f.result() for f in futures]
    finally:
        pipeline.close_pools()
    if results:
        create_table_artifact(key="search", table=[{k: r[k] for k in ("task_id", "trials", "pass_rate",
                                                                      "best_utility", "ended_by")} for r in results],
                              description=f"Search results of run {run_id} ({mode}, budget {budget})")
    return results
