"""While a run is going in another process, `llm4llm runs`, `sql` and `report` answer: the run holds the DuckDB file
only while it writes (storage.db), not through its search."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "workloads" / "tiny-llama.toml"
RUN_LIMIT_S = 240  # the run's start, profile, extraction and template checks on a loaded 2-core CI machine


def _workload(tmp_path: Path) -> Path:
    p = tmp_path / "tiny.toml"
    p.write_text(TINY.read_text().replace('script = "', f'script = "{TINY.parent}/'))
    return p


def _start_run(tmp_path: Path, db: Path) -> tuple[subprocess.Popen, "queue.Queue[str]"]:
    """`llm4llm optimize` on tiny-llama up to a search long enough to read during (its lines go to the queue)."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value() or "", "COLUMNS": "200"}
    args = [sys.executable, "-m", "llm4llm.cli", "optimize", str(_workload(tmp_path)), "--db", str(db),
            "--data-dir", str(tmp_path / "data"), "--stages", "profile,extract,search", "--family", "norm",
            "--top", "1", "--budget", "8", "--time-budget", "off"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    return proc, lines


def _wait_for(lines: "queue.Queue[str]", proc: subprocess.Popen, marker, seen: list[str]) -> None:
    deadline = time.monotonic() + RUN_LIMIT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            assert proc.poll() is None, "".join(seen)[-3000:]
            continue
        seen.append(line)
        if marker(line):
            return
    pytest.fail(f"no search started within {RUN_LIMIT_S} s:\n" + "".join(seen)[-3000:])


def _cli(*args: str) -> str:
    res = CliRunner().invoke(app, list(args), env={"COLUMNS": "120"})
    assert res.exit_code == 0, res.output
    return res.output


def test_runs_sql_and_report_answer_while_a_run_searches(tmp_path, prefect_harness):
    db, seen = tmp_path / "db.duckdb", []
    proc, lines = _start_run(tmp_path, db)
    try:
        _wait_for(lines, proc, lambda ln: "search " in ln and ": started" in ln, seen)
        runs = _cli("runs", "--db", str(db))
        assert "tiny-llama" in runs and "running" in runs  # the run is listed as going
        assert "1" in _cli("sql", "select count(*) AS n from runs", "--db", str(db))
        assert "report of run" in _cli("report", "--db", str(db), "--out", str(tmp_path / "r.html"))
        while not lines.empty():
            seen.append(lines.get())
        assert proc.poll() is None and not any("search " in ln and ": done" in ln for ln in seen), \
            "the search ended before the reads: they did not overlap it\n" + "".join(seen)[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
