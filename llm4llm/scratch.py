"""Per-process scratch directories, removed when the process exits.

Sources executed as modules (a candidate's kernels, a KernelBench problem) must live in real files while the
process runs (Triton and `inspect` read them back), but nothing needs them afterwards: one directory per process and
prefix, instead of one left in the temporary directory per module loaded."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from pathlib import Path

_DIRS: dict[tuple[int, str], Path] = {}
_LOCK = threading.Lock()


def scratch_dir(prefix: str) -> Path:
    """This process's scratch directory for `prefix` (made on first use, under TMPDIR; removed at exit). A forked
    child gets its own: the parent's is the parent's to remove."""
    key = (os.getpid(), prefix)
    with _LOCK:
        d = _DIRS.get(key)
        if d is None or not d.is_dir():
            d = _DIRS[key] = Path(tempfile.mkdtemp(prefix=prefix))
            atexit.register(_remove, key[0], d)
        return d


def _remove(pid: int, d: Path) -> None:
    if os.getpid() == pid:
        shutil.rmtree(d, ignore_errors=True)
