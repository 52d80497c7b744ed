"""A run's `runs` row: what started it (kind), the Prefect flow run, `running` until it ends ok, failed (with the
error's first line) or stopped."""
from __future__ import annotations

import pytest

from storage import repo
from storage.db import Database


@pytest.mark.parametrize("error, status", [(None, "ok"), (RuntimeError("the verifier died\nline 2"), "failed"),
                                           (KeyboardInterrupt(), "stopped")])
def test_a_run_is_running_until_it_ends_ok_failed_or_stopped(tmp_path, error, status):
    from llm4llm.records import PhaseInfo, ProfileResult
    from storage.rows import run_row
    from storage.store import Store

    path = tmp_path / "db.duckdb"
    result = ProfileResult(phases={"decode": PhaseInfo(phase="decode", forwards=3, time_ms=2.0, weight=1.0)}, records=[],
                           hardware={"device": "cpu"}, timer="cpu")
    row = run_row({"workload_hash": "w", "workload_name": "tiny"}, result, "r1", "2026-12-06T08:00:00", None,
                  str(tmp_path), "manual", "flow-run-1")
    with Database(path) as db:
        repo.record_profile_run(db, row, {"workload_hash": "w", "name": "tiny", "path": "t.toml", "config": {}}, [])
        assert repo.get_run(db, "r1")["status"] == "running"
    Store(str(path)).finish_run("r1", error)
    with Database(path, read_only=True) as db:
        run = repo.get_run(db, "r1")
    assert (run["status"], run["kind"], run["flow_run_id"]) == (status, "manual", "flow-run-1")
    assert run["finished_at"] is not None
    assert run["error"] == {"ok": None, "failed": "RuntimeError: the verifier died",
                            "stopped": "KeyboardInterrupt"}[status]
