"""The repository a stage is handed for what it reads and writes (issue 41: each stage one function, a repository
passed in for writes): storage.repo's queries on one database path, each call in its own short session (DuckDB has
one writer per file, so no call holds the database between a stage's steps). Plain rows in, plain rows out: the core
never imports storage, it calls these methods on the object it is given."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from storage import repo
from storage.db import Database


class Store:
    """storage.repo on the database at `db_path` (None: the default database)."""

    def __init__(self, db_path: str | None = None):
        self.db_path = db_path

    def __repr__(self) -> str:
        return f"Store({self.db_path!r})"

    # ---- runs: profile, extract, end
    def has_run(self, run_id: str) -> bool:
        with Database(self.db_path) as db:
            return repo.get_run(db, run_id) is not None

    def record_profile_run(self, payload: dict, result, run_id: str, started: str, profile_of: str | None,
                           artifact_dir: str, kind: str, flow_run_id: str | None, workload: dict) -> None:
        """The run's `runs` row and its profile rows (`result`: a llm4llm.records.ProfileResult), in one
        transaction."""
        from storage.rows import profile_row, run_row

        run = run_row(payload, result, run_id, started, profile_of, artifact_dir, kind, flow_run_id)
        with Database(self.db_path) as db:
            repo.record_profile_run(db, run, workload, [profile_row(r) for r in result.records])

    def record_task_index(self, index_path: str, run_id: str) -> int:
        """The run's task index (`tasks.json`) as `tasks` rows; returns how many."""
        from storage.rows import task_row

        index = json.loads(Path(index_path).read_text())
        with Database(self.db_path) as db:
            return repo.record_tasks(db, run_id, [task_row(t) for t in index])

    def finish_run(self, run_id: str, error: BaseException | None = None) -> None:
        """The run ends: ok, failed (an exception) or stopped (Ctrl-C, a cancelled flow run), with the error's first
        line."""
        status = "ok" if error is None else "failed" if isinstance(error, Exception) else "stopped"
        first = str(error).splitlines()[0] if error is not None and str(error) else ""
        text = None if error is None else (type(error).__name__ + (f": {first}" if first else ""))[:500]
        with Database(self.db_path) as db:
            repo.finish_run(db, run_id, status, text)

    # ---- search
    @contextmanager
    def search_recorder(self) -> Iterator:
        """A SearchRecorder (llm4llm.stages.search) writing each row as it happens, on a session held for the
        search."""
        from storage.recorders import DuckDBSearchRecorder

        with Database(self.db_path) as db:
            yield DuckDBSearchRecorder(db)

    def record_search_rows(self, rows: dict, data_dir: str) -> dict:
        """Write what a search away from the flow returned (storage.recorders.SearchRows), in the flow: sources and
        transcripts under the data dir (where a local search puts them), then every row in one transaction. Returns
        the search's summary."""
        search, task_id = rows["search"], rows["search"]["task_id"]
        cand_dir = Path(data_dir) / "candidates" / task_id
        archive = Path(data_dir) / "searches" / search["search_id"]
        cand_dir.mkdir(parents=True, exist_ok=True)
        archive.mkdir(parents=True, exist_ok=True)
        candidates = []
        for c in rows["candidates"]:
            src = cand_dir / f"{c['row']['candidate_id']}.py"
            src.write_text(c["source"])
            candidates.append({**c["row"], "source_path": str(src)})
        episodes = []
        for e in rows["episodes"]:
            row = dict(e["row"])
            if e["transcript_name"] and e["transcript"] is not None:
                (archive / e["transcript_name"]).write_text(e["transcript"])
                row["transcript_path"] = str(archive / e["transcript_name"])
            episodes.append((row, e["experience"]))
        for name, text in rows.get("files", {}).items():
            (archive / name).write_text(text)
        with Database(self.db_path) as db:
            repo.record_search_result(db, search, candidates, episodes, rows["llm_calls"])
        return rows["summary"]

    def experience_records(self, task_id: str) -> list[dict]:
        with Database(self.db_path) as db:
            return repo.experience_records(db, task_id)

    def template_check_records(self, task_ids: list[str], code_version: str | None = None) -> list[dict]:
        with Database(self.db_path) as db:
            return repo.template_check_rows(db, task_ids, code_version).to_dict("records")

    def record_template_checks(self, rows: Iterable[dict]) -> None:
        with Database(self.db_path) as db:
            repo.record_template_checks(db, rows)

    def task_rows(self, run_id: str | None = None):
        """The run's `tasks` rows (a DataFrame)."""
        with Database(self.db_path) as db:
            return repo.task_rows(db, run_id)

    def coverage_rows(self, run_id: str):
        """(the run's coverage rows, its tasks' template checks), both DataFrames."""
        with Database(self.db_path) as db:
            cov = repo.coverage_rows(db, run_id)
            return cov, repo.template_check_rows(db, list(cov["task_id"]))

    # ---- KernelBench
    def candidate_rows(self, search_id: str):
        with Database(self.db_path) as db:
            return repo.candidate_rows(db, search_id=search_id)

    def record_kb_result(self, row: dict) -> None:
        with Database(self.db_path) as db:
            repo.record_kb_result(db, row)

    # ---- plan
    def family_best_speedups(self, gpu_name: str) -> list[dict]:
        with Database(self.db_path) as db:
            return repo.family_best_speedups(db, gpu_name)

    def last_stage_seconds(self, workload_name: str, device_kind: str) -> dict[str, float]:
        with Database(self.db_path) as db:
            return repo.last_stage_seconds(db, workload_name, device_kind)

    def record_plan_step(self, run_id: str, rows: list[dict]) -> None:
        """The plan's rows as the run's next step."""
        with Database(self.db_path) as db:
            step = repo.plan_steps(db, run_id)
            repo.record_plan(db, [r | {"step": step} for r in rows])

    def record_stage_times(self, run_id: str, workload_name: str, device_kind: str, spans: list[dict]) -> None:
        """The run's finished stage spans (llm4llm.planner.Clock.spans) as `stage_times` rows."""
        from datetime import datetime, timezone

        rows = [{"run_id": run_id, "workload_name": workload_name, "device": device_kind, "seq": k,
                 "stage": s["stage"], "note": s.get("note") or "", "start_s": s["start_s"],
                 "seconds": s["end_s"] - s["start_s"], "trials": s.get("trials"),
                 "started_at": datetime.fromtimestamp(s["started_at"], timezone.utc).replace(tzinfo=None)}
                for k, s in enumerate(spans) if s.get("end_s") is not None]
        with Database(self.db_path) as db:
            repo.record_stage_times(db, rows)

    # ---- accept
    def best_candidates(self, run_id: str, min_utility: float = 0.0):
        with Database(self.db_path) as db:
            return repo.best_candidates(db, run_id, min_utility)

    def record_decision(self, run_id: str, decision) -> None:
        """One acceptance decision (llm4llm.accept.Decision) as it is made: a run stopped later keeps it; the
        step's record_acceptance writes it again (the same row)."""
        from storage.rows import decision_row

        with Database(self.db_path) as db:
            repo.record_acceptance(db, decision_row(decision, run_id))

    def record_bundle(self, run_id: str, workload_hash: str, bundle_path: str, manifest: dict) -> None:
        """The run's bundle as an acceptance step has written it so far (a stopped step leaves it; the step's end
        writes its final bundle over the same row)."""
        from storage.rows import patch_row

        with Database(self.db_path) as db:
            repo.record_patch_bundle(db, patch_row(run_id, workload_hash, bundle_path, manifest))

    def record_acceptance(self, outcome) -> None:
        """An acceptance step's rows (llm4llm.stages.accept.AcceptOutcome): one per decision, one `episodes` row with
        its experience per rejection (the run's pseudo-search `accept-<run id>`), and the bundle."""
        from storage.rows import decision_rows, patch_row, rejection_episode_row

        result, run_id = outcome.result, outcome.run_id
        with Database(self.db_path) as db:
            for row in decision_rows(result, run_id):
                repo.record_acceptance(db, row)
            for i, task_id, experience in outcome.rejections:
                repo.record_episode(db, rejection_episode_row(run_id, i), experience, task_id)
            if result.bundle_dir:
                repo.record_patch_bundle(db, patch_row(run_id, outcome.workload_hash, result.bundle_dir,
                                                       outcome.manifest))

    # ---- the nightly service
    def current_bundle(self, workload_name: str) -> dict | None:
        with Database(self.db_path) as db:
            return repo.current_bundle(db, workload_name)

    def bundle_versions(self, workload_name: str) -> list[dict]:
        with Database(self.db_path) as db:
            return repo.bundle_versions(db, workload_name)

    def next_bundle_version(self, workload_name: str) -> int:
        with Database(self.db_path) as db:
            return repo.next_bundle_version(db, workload_name)

    def enter_service(self, row: dict) -> None:
        with Database(self.db_path) as db:
            repo.record_bundle_version(db, row)

    def record_night(self, validations: list[dict], decision: dict) -> None:
        """The night's validations and decision, and the workload's `current` pointer moved to its to_version."""
        with Database(self.db_path) as db:
            repo.record_service_night(db, validations, decision)
            repo.set_current_bundle(db, decision["workload_name"], decision["to_version"], decision["run_id"])

    # ---- evaluate
    @staticmethod
    def e2e_rows(run_id: str, workload_hash: str, measured: list) -> list[dict]:
        """Measurements (llm4llm.stages.evaluate.E2ERow, typed; not imported: storage imports nothing of the core)
        as `e2e_results` rows; writes nothing."""
        from storage.rows import e2e_row

        return [e2e_row(run_id, workload_hash, m) for m in measured]

    def record_e2e(self, rows: list[dict]) -> None:
        with Database(self.db_path) as db:
            repo.record_e2e(db, rows)
