"""`llm4llm kernelbench`'s stage: each problem searched and recorded like any local search (search_recorded, from
scratch), its best trial read back, its `kernelbench_results` row written, all through the repository handed in
(KernelBenchRepository: storage.store.Store on DuckDB)."""
from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel, ConfigDict

from llm4llm.kernelbench.run import KernelBenchProblem
from llm4llm.stages.search import SearchRepository


class KernelBenchRepository(SearchRepository, Protocol):
    """What a KernelBench run reads and writes besides its searches' rows."""

    def candidate_rows(self, search_id: str):
        """A search's `candidates` rows (a DataFrame)."""

    def record_kb_result(self, row: dict) -> None: ...


class KernelBenchResult(BaseModel):
    """A KernelBench run as the stage returns it to the CLI (frozen: handed on unchanged). run_id: the kernelbench
    run id (`kernelbench_results.kb_run_id`; shards of one run share it); problems: each problem's
    KernelBenchProblem per mode, in the order they ran, as the repository recorded them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    problems: tuple[KernelBenchProblem, ...] = ()


def run_kernelbench(directory: str, repo: KernelBenchRepository, data_dir: str, *, problems: str | None = None,
                    budget: int = 4, modes: list[str] | None = None, proposer: str = "library", device: str = "cpu",
                    timeout_s: float = 600.0, seed: int = 0, llm=None, kb_run_id: str | None = None,
                    on_problem=None) -> KernelBenchResult:
    """KernelBench problems through the search and the verifier (llm4llm.kernelbench.run.run_problems), every
    trial a `candidates` row, every problem a `kernelbench_results` row (its KernelBenchProblem, dumped only here,
    where the repository writes it). on_problem(problem): told of each KernelBenchProblem as it is recorded."""
    from llm4llm.config import SearchSettings
    from llm4llm.kernelbench.run import run_problems
    from llm4llm.stages.search import search_recorded

    def search(task_dir: str, *, device: str, run_id: str, proposer_obj, **options) -> dict:
        # no prior experience: each problem is searched from scratch
        settings = SearchSettings(warm_start=False, **options)
        return search_recorded(task_dir, repo, data_dir, settings, device=device, run_id=run_id,
                               proposer_obj=proposer_obj)

    def record(problem: KernelBenchProblem) -> None:
        repo.record_kb_result(problem.model_dump())

    run_id, problems = run_problems(directory, data_dir, search, repo.candidate_rows, record, problems=problems,
                                    budget=budget, modes=modes, proposer=proposer, device=device, timeout_s=timeout_s,
                                    seed=seed, llm=llm, kb_run_id=kb_run_id, on_problem=on_problem)
    return KernelBenchResult(run_id=run_id, problems=tuple(problems))
