"""storage/: a file written by an older llm4llm migrates forward on open and keeps its rows."""
from __future__ import annotations

import json
from importlib import resources

import duckdb

from storage import repo
from storage.db import Database, _migrations


def test_a_version_1_file_gains_the_e2e_samples_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))  # as the first schema left it: 001 only
    con.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, name VARCHAR, "
                "applied_at TIMESTAMP DEFAULT current_timestamp)")
    con.execute(resources.files("storage").joinpath("migrations/001_init.sql").read_text())
    con.execute("INSERT INTO schema_version (version, name) VALUES (1, 'init')")
    con.execute("INSERT INTO e2e_results (run_id, workload_hash, variant, total_ms) VALUES ('r0', 'w', 'eager', 9.5)")
    con.close()
    with Database(path) as db:
        assert db.schema_version() == max(v for v, _, _ in _migrations()) >= 2
        assert db.query("SELECT total_ms, total_samples_ms FROM e2e_results WHERE run_id = 'r0'") == [(9.5, None)]
        repo.record_e2e(db, [{"run_id": "r1", "workload_hash": "w", "variant": "eager", "total_ms": 2.0,
                              "total_samples_ms": [1.0, 2.0, 3.0], "prefill_samples_ms": [0.5]}])
        (row,) = db.query("SELECT total_samples_ms, prefill_samples_ms FROM e2e_results WHERE run_id = 'r1'")
    assert json.loads(row[0]) == [1.0, 2.0, 3.0] and json.loads(row[1]) == [0.5]
    with Database(path) as db:  # opening again applies nothing twice
        assert db.query("SELECT count(*) FROM schema_version")[0][0] == len(_migrations())
