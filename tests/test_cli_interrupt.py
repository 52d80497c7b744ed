"""A workload script whose run() does not return: while it runs the command prints a heartbeat (stage, call,
elapsed, the limit, where the call is now), and stopping the command (SIGTERM from a scheduler, SIGINT from Ctrl-C) ends every process it
started, Prefect's ephemeral API server (uvicorn) included."""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time

from test_script_timeout import ROOT, SCRIPT, TOML, _alive, _with_env


def test_a_stopped_profile_leaves_no_process_and_beats_while_it_runs(tmp_path):
    """SIGTERM only: one CLI run with its Prefect server costs about a minute on a loaded 2-core machine. Ctrl-C
    takes the KeyboardInterrupt path, and the same exit sweep (cli._end_children) ends what is left."""
    (tmp_path / "hangs.py").write_text(SCRIPT)
    (tmp_path / "hangs.toml").write_text(TOML.replace("script_timeout_s = 4", "script_timeout_s = 600\n"
                                                      "script_heartbeat_s = 1"))
    home = tmp_path / "prefect-home"
    env = {**os.environ, "PREFECT_HOME": str(home), "LLM4LLM_HOME": str(tmp_path / "l4l")}
    proc = subprocess.Popen([sys.executable, "-m", "llm4llm.cli", "profile", str(tmp_path / "hangs.toml"),
                             "--db", str(tmp_path / "l4l.duckdb")], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    beats, seen = [], []
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    deadline = time.monotonic() + 240
    try:
        while len(beats) < 2 and time.monotonic() < deadline and proc.poll() is None:
            if sel.select(timeout=1.0):
                line = proc.stderr.readline()
                seen.append(line)
                if line.startswith("llm4llm: profile: the workload script's run() still running after"):
                    beats.append(line)
        assert len(beats) == 2, "".join(seen)[-3000:]
        assert "stopped at 600 s (script_timeout_s)" in beats[0]
        # where the call is now, innermost frame first: the script's own loop
        line = SCRIPT.splitlines().index("        time.sleep(0.2)") + 1
        assert f"; now in hangs.py:{line} run < workload.py:" in beats[0], beats[0]
        server = [p for p in _with_env("PREFECT_HOME", str(home)) if p != proc.pid]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 15
    while (_alive(child) or _with_env("PREFECT_HOME", str(home))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(child), "the process the script started outlived the command"
    assert _with_env("PREFECT_HOME", str(home)) == [], f"outlived the command (its server was {server})"
