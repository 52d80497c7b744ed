"""`llm4llm kernelbench`'s database side: each problem searched and recorded like any local search
(llm4llm.stages.search.search_recorded, from scratch), its best trial read back, its `kernelbench_results` row written."""
from __future__ import annotations

from pathlib import Path


def run_kernelbench(directory: str, *, problems: str | None = None, budget: int = 4, modes: list[str] | None = None,
                    proposer: str = "library", device: str = "cpu", db_path: str | None = None,
                    data_dir: str | None = None, timeout_s: float = 600.0, seed: int = 0, llm=None,
                    kb_run_id: str | None = None, on_problem=None) -> tuple[str, list[dict]]:
    """KernelBench problems through the search and the verifier (llm4llm.kernelbench.run.run_problems), every
    trial a `candidates` row, every problem a `kernelbench_results` row. Returns (kb run id, the problems' rows)."""
    from llm4llm.config import SearchSettings
    from llm4llm.kernelbench.run import run_problems
    from llm4llm.stages.search import search_recorded
    from storage import repo
    from storage.db import Database, data_home
    from storage.store import Store

    data = str(Path(data_dir) if data_dir else data_home())

    def search(task_dir: str, *, device: str, run_id: str, proposer_obj, **options) -> dict:
        # no prior experience: each problem is searched from scratch
        settings = SearchSettings(warm_start=False, **options)
        return search_recorded(task_dir, Store(db_path), data, settings, device=device, run_id=run_id,
                               proposer_obj=proposer_obj)

    def trials(search_id: str):
        with Database(db_path) as db:
            return repo.candidate_rows(db, search_id=search_id)

    def record(row: dict) -> None:
        with Database(db_path) as db:
            repo.record_kb_result(db, row)

    return run_problems(directory, data, search, trials, record, problems=problems, budget=budget, modes=modes,
                        proposer=proposer, device=device, timeout_s=timeout_s, seed=seed, llm=llm,
                        kb_run_id=kb_run_id, on_problem=on_problem)
