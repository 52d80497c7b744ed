"""Opt-in speed-ups for Triton's interpreter (TRITON_INTERPRET=1, the CPU path).

`import kernels_runtime` (or any of its ops) leaves Triton as it found it. A process that runs kernels under the
interpreter and wants them faster asks for it once, before its first launch:

    from kernels_runtime.interp import enable_fast_interpreter
    enable_fast_interpreter()          # under TRITON_INTERPRET=1: the fixes in ops/_interp_fast.py, same bits

llm4llm's own CPU paths opt in: `interpret_without_gpu()` (the CLI, a served flow run, sandboxed children), the
verifier's CPU workers, the test suite (tests/conftest.py) and the scripts' CPU smoke runs.
LLM4LLM_FAST_INTERP=0, read at the call, declines it (Triton's own interpreter, to compare against or rule out).
"""
from __future__ import annotations

import os


def fast_interpreter_wanted() -> bool:
    """Whether `enable_fast_interpreter()` installs: under the interpreter, unless LLM4LLM_FAST_INTERP=0."""
    from kernels_runtime.ops._common import interpreting

    return interpreting() and os.environ.get("LLM4LLM_FAST_INTERP", "1") != "0"


def enable_fast_interpreter() -> bool:
    """Patch Triton's interpreter with kernels_runtime/ops/_interp_fast.py's two fixes (idempotent); True when they
    are in place. Does nothing off the interpreter (on the GPU neither patched code path runs) or with
    LLM4LLM_FAST_INTERP=0, and where this Triton lacks what the fixes replace."""
    if not fast_interpreter_wanted():
        return False
    from kernels_runtime.ops import _interp_fast

    return _interp_fast.install()


def fast_interpreter_enabled() -> bool:
    """Whether this process's Triton interpreter carries the fixes."""
    from kernels_runtime.ops import _interp_fast

    return _interp_fast.installed()


def interpret_without_gpu() -> None:
    """Make Triton run under its interpreter when this process has no GPU (must run before triton compiles
    anything), with the speed-ups above when it does. The CLI, a served flow run and the sandboxed
    acceptance/evaluation subprocess call this."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    enable_fast_interpreter()
