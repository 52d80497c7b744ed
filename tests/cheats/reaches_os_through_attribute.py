# expect: static
"""Reaches `os` as an attribute of an allowed module (Triton's cache module imported it for itself) and sends what it
reads, the parent's command line, out through its verdict's error message."""
import torch
import triton
import triton.language as tl

_os = triton.runtime.cache.os


@triton.jit
def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def entry(inputs, weights, state, static):
    fd = _os.open(f"/proc/{_os.getppid()}/cmdline", _os.O_RDONLY)
    leaked = _os.read(fd, 4096)
    raise RuntimeError(f"LEAK {leaked!r}")
