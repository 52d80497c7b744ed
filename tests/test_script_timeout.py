"""A workload script whose run() never returns: the command that runs it stops after the workload's
script_timeout_s with one error line and exit status 3, and leaves nothing behind (a process the script started,
Prefect's temporary server). Before the limit existed it hung with no end."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = '''
import subprocess, time
import torch


def build(workload):
    child = subprocess.Popen(["sleep", "600"])  # something the script started
    open(workload.script.parent / "child.pid", "w").write(str(child.pid))
    return torch.nn.Linear(4, 4)


def inputs(workload):
    return {"x": torch.ones(1, 4)}


def run(model, workload, inputs):
    while True:  # never returns
        time.sleep(0.2)
'''

TOML = '''name = "hangs"
script = "hangs.py"
prompt_len = 4
decode_len = 2
script_timeout_s = 4

[model]
model_type = "llama"
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _with_env(key: str, value: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if f"{key}={value}".encode() in f.read().split(b"\0"):
                        out.append(int(d))
            except OSError:
                pass
    return out


def test_a_run_that_never_returns_is_stopped_with_everything_it_started(tmp_path):
    (tmp_path / "hangs.py").write_text(SCRIPT)
    (tmp_path / "hangs.toml").write_text(TOML)
    home = tmp_path / "prefect-home"
    env = {**os.environ, "PREFECT_HOME": str(home), "LLM4LLM_HOME": str(tmp_path / "l4l")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "llm4llm.cli", "profile", str(tmp_path / "hangs.toml"),
                           "--db", str(tmp_path / "l4l.duckdb")], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=400)
    took = time.monotonic() - t0
    assert proc.returncode == 3, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert errors == ["error: the workload script's run() did not return within 4 s (script_timeout_s in the "
                      "workload TOML); stopped with every process it started"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while (_alive(child) or _with_env("PREFECT_HOME", str(home))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(child), "the process the script started outlived the limit"
    assert _with_env("PREFECT_HOME", str(home)) == [], "a process of this run (Prefect's server?) outlived it"
    assert took < 300


def test_where_now_names_a_running_threads_innermost_frames_first():
    """The heartbeat's `now in` part: the frames of another thread as it runs, innermost first; '' once it ended."""
    import threading

    from llm4llm.workload import where_now

    go, done = threading.Event(), threading.Event()

    def inner():
        go.set()
        done.wait(10)

    def outer():
        inner()

    t = threading.Thread(target=outer)
    t.start()
    go.wait(10)
    try:
        now = where_now(t.ident, frames=4)
    finally:
        done.set()
        t.join()
    assert now.split(" < ")[2:] == [f"test_script_timeout.py:{inner.__code__.co_firstlineno + 2} inner",
                                    f"test_script_timeout.py:{outer.__code__.co_firstlineno + 1} outer"], now
    assert now.startswith("threading.py:"), now  # done.wait, inside the standard library
    assert where_now(t.ident) == ""
