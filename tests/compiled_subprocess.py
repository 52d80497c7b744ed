"""Run Python in a subprocess without TRITON_INTERPRET, so that Triton kernels are compiled objects there (the
sm_90 compile checks); the rest of the test session runs under the interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_compiled(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`python ARGS` from the repository root, the project importable, TRITON_INTERPRET unset."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
