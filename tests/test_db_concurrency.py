"""storage.db: no connection outlives a burst of statements, so another process can read or write the file between
a run's writes; an open that meets another process's handle waits (bounded) instead of failing; a reader never
creates a file."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import pytest

from storage import repo
from storage.db import LINGER_S, Database, DatabaseError

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def _holder(path: Path, seconds: float) -> subprocess.Popen:
    """Another process that opens the file read-write and holds it for `seconds` (it prints `held` once it does)."""
    code = (f"import time, duckdb\ncon = duckdb.connect({str(path)!r})\nprint('held', flush=True)\n"
            f"time.sleep({seconds})\ncon.close()\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _e2e(run_id: str) -> dict:
    return {"run_id": run_id, "workload_hash": "w", "variant": "eager", "total_ms": 1.0}


def test_another_process_reads_and_writes_while_a_database_object_is_open(tmp_path):
    path = tmp_path / "db.duckdb"
    with Database(path) as db:
        repo.record_e2e(db, [_e2e("mine")])
        out = _python(f"""
            from storage import repo
            from storage.db import Database
            with Database({str(path)!r}, read_only=True) as db:
                print(db.query("SELECT count(*) FROM e2e_results")[0][0])
            with Database({str(path)!r}) as db:
                repo.record_e2e(db, [{_e2e("theirs")!r}])
        """)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["1"]
        repo.record_e2e(db, [_e2e("mine-again")])  # this object still writes after the other process's write
        assert sorted(r[0] for r in db.query("SELECT run_id FROM e2e_results")) == ["mine", "mine-again", "theirs"]


def test_an_open_waits_while_another_process_holds_the_file(tmp_path):
    path = tmp_path / "db.duckdb"
    Database(path).close()
    proc = _holder(path, 1.5)  # as a long write would hold it
    try:
        assert proc.stdout.readline().strip() == "held"
        start = time.monotonic()
        with Database(path, read_only=True) as db:
            assert db.query("SELECT count(*) FROM e2e_results")[0][0] == 0
        assert time.monotonic() - start > 0.5  # it waited for the holder instead of failing at once
    finally:
        proc.wait(timeout=30)


def test_a_file_held_too_long_is_one_error(tmp_path):
    path = tmp_path / "db.duckdb"
    Database(path).close()
    proc = _holder(path, 30.0)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(DatabaseError, match=r"another process held it for over 1 s"):
            Database(path, read_only=True, wait_s=1.0)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_reader_never_creates_a_file(tmp_path):
    path = tmp_path / "typo.duckdb"
    with pytest.raises(DatabaseError, match="no database at"):
        Database(path, read_only=True)
    assert not path.exists()


def test_a_session_holds_one_connection_and_releases_it(tmp_path):
    path = tmp_path / "db.duckdb"
    with Database(path) as db:
        with db.session() as a, db.session() as b:
            assert a is b
            with db.transaction() as tx:
                assert tx is a
        time.sleep(LINGER_S + 0.3)
        assert db._con is None  # released once idle, the object still usable
        assert db.query("SELECT count(*) FROM runs") == [(0,)]


def test_a_reader_in_the_same_process_waits_for_a_writers_idle_connection(tmp_path):
    path = tmp_path / "db.duckdb"
    writer = Database(path)  # its connection lingers for LINGER_S after the migration
    repo.record_e2e(writer, [_e2e("r")])
    with Database(path, read_only=True) as reader:
        assert reader.query("SELECT run_id FROM e2e_results") == [("r",)]
    repo.record_e2e(writer, [_e2e("s")])
    writer.close()

