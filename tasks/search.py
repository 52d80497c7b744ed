"""Prefect tasks of the search: each calls the search stage (llm4llm.stages.search) with the repository it reads and
writes through (storage.store.Store; the stage opens no database). ProgressArtifact is the Prefect view of a local
search; close_pools and remote_search_input are what the search flow calls in its own process."""
from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from llm4llm import isolation
from llm4llm.config import SearchSettings
from llm4llm.stages import search as search_stage
from llm4llm.stages.search import SearchSummary
from storage.store import Store
from tasks.common import infrastructure_only


def _search_run_name(parameters: dict) -> str:
    """`search-<task id>`: the task dir's own name, not its absolute path (the UI's run list stays readable)."""
    return f"search-{Path(parameters['task_dir']).name}"


@task(name="search-task", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only,
      task_run_name=_search_run_name)
def search_task(task_dir: str, settings: SearchSettings, db_path: str | None, data_dir: str, device: str,
                run_id: str | None, llm: dict | None = None, trials: int | None = None,
                deadline: float | None = None) -> SearchSummary:
    """One task's search: `trials` (the plan's; default the settings' budget) until `deadline` (Unix time, the
    plan's share of the time budget). A failing candidate is data (a row), not a task failure: only infrastructure
    errors (the worker pool cannot start, the database is unavailable) fail and retry this task. The task run shows
    a progress artifact: trials verified of the budget, with the passes and the best so far."""
    return search_stage.search_recorded(task_dir, Store(db_path), data_dir, settings, device=device, run_id=run_id,
                                        llm=llm, trials=trials, deadline=deadline, wrap=ProgressArtifact)


class ProgressArtifact:
    """A SearchRecorder (llm4llm.stages.search) that hands every row to `inner` and keeps a Prefect progress
    artifact of the search on the current task run: trials verified of the budget, its description the passes and
    the best speedup so far; full when the search ends (a planned search may stop before its budget). The artifact
    is a view: when the API refuses it, the search goes on without it and says so once."""

    def __init__(self, inner):
        self.inner, self.artifact, self.task_id, self.budget = inner, None, "", 1
        self.trials, self.passed, self.best = 0, 0, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _show(self, fn, *args, **kwargs) -> None:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a view of the search, never a reason to stop it
            print(f"search {self.task_id}: no progress artifact ({type(e).__name__}: {e})")
            self.artifact = None

    def _describe(self) -> str:
        best = f", best {self.best:.2f}x" if self.best else ""
        return f"search {self.task_id}: {self.trials}/{self.budget} trials, {self.passed} passed{best}"

    def start(self, search_id, task_id, run_id, mode, proposer, budget) -> None:
        from prefect.artifacts import create_progress_artifact

        self.inner.start(search_id, task_id, run_id, mode, proposer, budget)
        self.task_id, self.budget = task_id, max(int(budget), 1)
        self.artifact = self._show(create_progress_artifact, 0.0, description=self._describe())

    def trial(self, candidate, verdict, *args) -> bool:
        passed = self.inner.trial(candidate, verdict, *args)
        x = search_stage.trial_speedup(verdict)
        self.trials, self.passed = self.trials + 1, self.passed + int(passed)
        if passed and x:
            self.best = max(self.best or 0.0, x)
        self._update(min(100.0, 100.0 * self.trials / self.budget))
        return passed

    def end(self, search_id, task_id, result) -> None:
        self.inner.end(search_id, task_id, result)
        self._update(100.0)

    def _update(self, percent: float) -> None:
        from prefect.artifacts import update_progress_artifact

        if self.artifact is not None:
            self._show(update_progress_artifact, self.artifact, percent, description=self._describe())


@task(name="searchable-tasks")
def searchable_tasks(run_id: str, db_path: str | None, settings: SearchSettings, device: str | None = None,
                     task_ids: list[str] | None = None, searched_here: bool = True) -> list[str]:
    """Hottest deployable tasks first; with the library proposer, those no built-in template computes (checked on
    `device` before any trial) are left out before the top N."""
    return search_stage.searchable_of_run(run_id, Store(db_path), settings, device, task_ids, searched_here)


@task(name="search-task-remote", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only,
      cache_policy=NO_CACHE, task_run_name="search-remote-{task_id}")
def search_task_remote(task_id: str, task: bytes, prior: list[dict], settings: SearchSettings, device: str,
                       run_id: str | None, llm: dict | None = None) -> dict:
    """One task's search wherever the task runner puts it (a Ray worker holding one GPU), its rows returned for the
    flow to write (llm4llm.stages.search.search_packed)."""
    from storage.recorders import SearchRows

    return search_stage.search_packed(task, SearchRows(), settings, device=device, run_id=run_id, llm=llm,
                                      prior=prior)


@task(name="record-search", retries=2, retry_delay_seconds=2, retry_condition_fn=infrastructure_only,
      cache_policy=NO_CACHE)
def record_search(rows: dict, db_path: str | None, data_dir: str) -> SearchSummary:
    """Write a remote search's rows, in the flow's process (DuckDB's one writer)."""
    return search_stage.record_packed_search(rows, Store(db_path), data_dir)


# ---- plain helpers the search flow calls in its process (not Prefect tasks: no run, retry or cache of their own)

def close_pools() -> None:
    """Close the verifier workers the flow's local searches started (llm4llm.isolation.close_pools)."""
    isolation.close_pools()


def remote_search_input(task_dir: str, db_path: str | None) -> dict:
    """What search_task_remote takes for one task, read in the flow (llm4llm.stages.search.packed_task_input)."""
    return search_stage.packed_task_input(task_dir, Store(db_path))
