"""Where a search's rows go as it runs (llm4llm.stages.search.SearchRecorder): written to DuckDB as they happen (a
search in the flow's process), or collected as plain rows for the flow to write (a search away from the flow: it
never opens the database)."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from storage.rows import (candidate_row, episode_rows, finished_search_row, llm_call_row, search_end,
                          search_row)


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


class DuckDBSearchRecorder:
    """Each row written as it happens, through storage.repo, on an open storage.db.Database."""

    def __init__(self, db):
        self.db = db

    def start(self, search_id: str, task_id: str, run_id: str | None, mode: str, proposer: str,
              budget: int) -> None:
        from storage import repo

        repo.record_search_start(self.db, search_row(search_id, task_id, run_id, mode, proposer, budget))

    def trial(self, candidate, verdict, task_id: str, search_id: str, episode: int, iteration: int,
              source_path: str) -> bool:
        from storage import repo

        row = candidate_row(candidate, verdict, task_id, search_id, episode, iteration, source_path)
        repo.record_candidate(self.db, row)
        return row["passed"]

    def llm_call(self, call, search_id: str, task_id: str) -> None:
        from storage import repo

        repo.record_llm_call(self.db, llm_call_row(call, search_id, task_id))

    def end(self, search_id: str, task_id: str, result) -> None:
        from storage import repo

        for row, experience in episode_rows(result, search_id):
            repo.record_episode(self.db, row, experience, task_id)
        end = search_end(result)
        repo.record_search_end(self.db, search_id, end["trials"], end["passed"], end["best_candidate_id"],
                               end["best_utility"])

    def abort(self, search_id: str, trials: int, passed: int) -> None:
        from storage import repo

        repo.record_search_end(self.db, search_id, trials, passed, None, None)


class SearchRows:
    """Every row collected as plain data (the search, its candidates with their sources, its episodes with
    experience and transcripts, LLM calls), for the flow to write with storage.store.Store.record_search_rows."""

    def __init__(self):
        self.search: dict | None = None
        self.started: datetime | None = None
        self.candidates: list[dict] = []
        self.episodes: list[dict] = []
        self.llm_calls: list[dict] = []

    def start(self, search_id: str, task_id: str, run_id: str | None, mode: str, proposer: str,
              budget: int) -> None:
        self.search, self.started = search_row(search_id, task_id, run_id, mode, proposer, budget), _now()

    def trial(self, candidate, verdict, task_id: str, search_id: str, episode: int, iteration: int,
              source_path: str) -> bool:
        row = candidate_row(candidate, verdict, task_id, search_id, episode, iteration, source_path)
        self.candidates.append({"row": row, "source": candidate.source})
        return row["passed"]

    def llm_call(self, call, search_id: str, task_id: str) -> None:
        self.llm_calls.append(llm_call_row(call, search_id, task_id))

    def end(self, search_id: str, task_id: str, result) -> None:
        for row, experience in episode_rows(result, search_id):
            t = Path(row["transcript_path"]) if row["transcript_path"] else None
            self.episodes.append({"row": row, "experience": experience, "transcript_name": t.name if t else None,
                                  "transcript": t.read_text() if t and t.exists() else None})
        self.search = finished_search_row(self.search, self.started, _now(), result)

    def abort(self, search_id: str, trials: int, passed: int) -> None:
        """Nothing to close: the flow writes a search's rows only when it came back whole."""

    def rows(self, summary: dict, files: dict) -> dict:
        return {"search": self.search, "candidates": self.candidates, "episodes": self.episodes,
                "llm_calls": self.llm_calls, "files": files, "summary": summary}
