"""Where the output of sandboxed children goes: a bounded log file, never the user's terminal.

Verifier workers and the acceptance and evaluation children run candidate code and libraries that print
(joblib's "operating in serial mode" once per worker, inductor's hints, a candidate's own prints, escape codes,
forged log lines). Their stdout and stderr come back through one pipe per child; a reader thread writes at most
CAP_BYTES of each child to `<LLM4LLM_HOME or ./.llm4llm>/logs/children.log` and forwards to the parent's stdout only
the lines the project's own code writes there (OWN_PREFIXES), each distinct line once.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

CAP_BYTES = 1 << 20  # of one child's output in the log; the rest is counted and dropped
ROTATE_BYTES = 16 << 20  # the log is moved to children.log.1 when it grows past this
# lines of the project's own that a person should see (acceptance decisions, evaluation notes, sandbox warnings)
OWN_PREFIXES = ("accept: ", "evaluate: ", "WARNING: llm4llm ")
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|[\x00-\x08\x0b-\x1f\x7f]")
_seen: set[str] = set()
_lock = threading.Lock()


def log_path() -> Path:
    return Path(os.environ.get("LLM4LLM_HOME", ".llm4llm")).resolve() / "logs" / "children.log"


def _open_log():
    path = log_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.stat().st_size > ROTATE_BYTES:
            path.replace(path.with_suffix(".log.1"))
        return open(path, "ab")
    except OSError:  # an unwritable home: the output is dropped rather than shown
        return open(os.devnull, "ab")


def drain(stream, name: str, forward: bool = True) -> threading.Thread:
    """Read a child's merged stdout/stderr until it closes (a daemon thread): at most CAP_BYTES to the log, under
    a header naming the child; the project's own lines (forward) to this process's stdout, escape codes removed,
    each distinct line once."""
    def run() -> None:
        written = dropped = 0
        with _open_log() as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {name}\n".encode())
            for raw in iter(stream.readline, b""):
                if written + len(raw) <= CAP_BYTES:
                    log.write(raw)
                    written += len(raw)
                else:
                    dropped += len(raw)
                if forward:
                    _forward(raw)
            if dropped:
                log.write(f"--- {name}: {dropped} more bytes dropped (cap {CAP_BYTES})\n".encode())
        stream.close()

    t = threading.Thread(target=run, name=f"childlog-{name}", daemon=True)
    t.start()
    return t


def _forward(raw: bytes) -> None:
    line = _ESCAPES.sub("", raw[:2000].decode("utf-8", "replace")).rstrip()
    if not line.startswith(OWN_PREFIXES):
        return
    with _lock:
        if line in _seen:
            return
        _seen.add(line)
    print(line, file=sys.stdout, flush=True)
