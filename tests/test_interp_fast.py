"""kernels_runtime.ops._interp_fast: the interpreter's scan computed a slice at a time gives the bits of Triton's own
element-at-a-time scan (fp32, bf16, 1-D to 3-D blocks, every axis, forward and reverse, one and two carried values),
and the Mamba scan kernel gives the same bits through either; device-function calls inside a launch skip the
interpreter's re-patching of triton.language (one patch per launch), with the same bits, and a launch leaves
triton.language as it found it."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's scan")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import ScanOps  # noqa: E402

from kernels_runtime.ops import _interp_fast  # noqa: E402
from kernels_runtime.ops._common import _TL  # noqa: E402


@triton.jit
def _affine(a1, b1, a2, b2):  # Mamba's recurrence (selective_scan's _scan_combine)
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _soft(a, b):  # one carried value, a transcendental and a select
    return tl.where(a > b, a + tl.exp(b - a) * 0.5, b - a * 0.25)


@triton.jit
def _scan_kernel(a_ptr, b_ptr, x_ptr, y_ptr, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                 AXIS: tl.constexpr, REVERSE: tl.constexpr, PAIR: tl.constexpr, DTYPE: tl.constexpr):
    i = tl.arange(0, D0)[:, None, None] * (D1 * D2) + tl.arange(0, D1)[None, :, None] * D2 \
        + tl.arange(0, D2)[None, None, :]
    a = tl.load(a_ptr + i).to(DTYPE)
    b = tl.load(b_ptr + i).to(DTYPE)
    if PAIR:
        x, y = tl.associative_scan((a, b), AXIS, _affine, reverse=REVERSE)
    else:
        x = tl.associative_scan(a.to(tl.float32), AXIS, _soft, reverse=REVERSE)  # tl.exp: fp32
        y = b
    tl.store(x_ptr + i, x.to(tl.float32))
    tl.store(y_ptr + i, y.to(tl.float32))


@triton.jit
def _scan_1d_kernel(a_ptr, b_ptr, x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x, y = tl.associative_scan((tl.load(a_ptr + i), tl.load(b_ptr + i)), 0, _affine)
    tl.store(x_ptr + i, x)
    tl.store(y_ptr + i, y)


def _bits(*ts: torch.Tensor) -> list[torch.Tensor]:
    """Bit patterns (NaNs included: the interpreter's bf16 arithmetic on its uint16 storage can make some)."""
    return [t.contiguous().view(torch.int32) for t in ts]


def _both(run, everything: bool = False):
    """run() under Triton's own generic_scan (everything: and its own per-call patching), then under ours."""
    from triton.runtime import interpreter
    from triton.runtime.interpreter import GridExecutor

    assert _interp_fast.install() and ScanOps.generic_scan is _interp_fast.sliced_generic_scan
    assert interpreter._patch_lang is _interp_fast.patch_lang_once and GridExecutor.__call__ is _interp_fast.launch_call
    ScanOps.generic_scan = _interp_fast._ORIGINAL["generic_scan"]
    if everything:
        interpreter._patch_lang = _interp_fast._ORIGINAL["patch_lang"]
        GridExecutor.__call__ = _interp_fast._ORIGINAL["grid_call"]
    try:
        theirs = run()
    finally:
        ScanOps.generic_scan = _interp_fast.sliced_generic_scan
        interpreter._patch_lang = _interp_fast.patch_lang_once
        GridExecutor.__call__ = _interp_fast.launch_call
    return theirs, run()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,axis", [((8, 4, 2), 0), ((2, 8, 4), 1), ((4, 2, 8), 2), ((1, 8, 1), 1)])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("pair", [True, False])
def test_sliced_scan_gives_the_element_loops_bits(dtype, shape, axis, reverse, pair):
    g = torch.Generator().manual_seed(hash((shape, axis, reverse, pair)) % 2**31)
    a = (torch.rand(shape, generator=g) * 1.5 + 0.25).to(dtype).float()
    b = torch.randn(shape, generator=g).to(dtype).float()

    def run():
        x, y = torch.empty_like(a), torch.empty_like(a)
        _scan_kernel[(1,)](a, b, x, y, *shape, axis, reverse, pair, _TL[dtype])
        return x, y

    (x0, y0), (x1, y1) = _both(run)
    assert all(torch.equal(p, q) for p, q in zip(_bits(x0, y0), _bits(x1, y1)))
    if pair and not reverse and dtype == torch.float32:  # and both are the recurrence's scan
        h = torch.zeros_like(b.select(axis, 0))
        for t in range(shape[axis]):
            h = a.select(axis, t) * h + b.select(axis, t)
            torch.testing.assert_close(y1.select(axis, t), h)


def test_sliced_scan_of_a_1d_block():
    g = torch.Generator().manual_seed(1)
    a, b = torch.rand(16, generator=g), torch.randn(16, generator=g)

    def run():
        x, y = torch.empty_like(a), torch.empty_like(a)
        _scan_1d_kernel[(1,)](a, b, x, y, 16)
        return x, y

    (x0, y0), (x1, y1) = _both(run)
    assert all(torch.equal(p, q) for p, q in zip(_bits(x0, y0), _bits(x1, y1)))


@pytest.mark.parametrize("block_t", [8, 16])  # chunks scanned by tl.associative_scan
def test_the_mamba_scan_kernel_gives_the_same_bits_through_either(block_t):
    from kernels_runtime.ops.selective_scan import selective_scan

    g = torch.Generator().manual_seed(2)
    b_, d, t, n = 1, 16, 24, 4
    u, delta = torch.randn(b_, d, t, generator=g), torch.randn(b_, d, t, generator=g)
    A = -torch.rand(d, n, generator=g) - 0.5
    B, C = torch.randn(b_, n, t, generator=g), torch.randn(b_, n, t, generator=g)
    D, z, dt_bias = torch.randn(d, generator=g), torch.randn(b_, d, t, generator=g), torch.randn(d, generator=g)
    args = dict(D=D, z=z, delta_bias=dt_bias, delta_softplus=True, BLOCK_D=8, BLOCK_T=block_t)

    theirs, ours = _both(lambda: selective_scan(u, delta, A, B, C, **args), everything=True)
    assert len(theirs) == len(ours) == 2 and all(torch.equal(p, q) for p, q in zip(_bits(*theirs), _bits(*ours)))
    assert torch.isfinite(ours[0]).all()


def test_a_launch_patches_the_language_once_and_restores_it(monkeypatch):
    """selective_scan's kernel calls @triton.jit helpers (softplus, the scan's combine, the store's rounding) in
    every program: the interpreter's patch runs once for the launch, not per call, and tl is restored after it."""
    from triton.runtime import interpreter

    from kernels_runtime.ops.selective_scan import selective_scan

    before = {n: getattr(tl, n) for n in ("range", "static_range", "reduce", "associative_scan", "multiple_of")}
    calls = []
    real = _interp_fast._ORIGINAL["patch_lang"]
    monkeypatch.setitem(_interp_fast._ORIGINAL, "patch_lang", lambda fn: calls.append(fn) or real(fn))
    g = torch.Generator().manual_seed(3)
    u, delta = torch.randn(1, 16, 8, generator=g), torch.randn(1, 16, 8, generator=g)
    A = -torch.rand(16, 4, generator=g) - 0.5
    B, C = torch.randn(1, 4, 8, generator=g), torch.randn(1, 4, 8, generator=g)
    y, _ = selective_scan(u, delta, A, B, C, D=torch.randn(16, generator=g), delta_softplus=True, BLOCK_D=8, BLOCK_T=8)
    # 2 programs, each calling helpers: the launch's patch, and one for triton.language's own helpers (tl.zeros,
    # tl.sum: their module sees tl.core, which the kernel's does not), not one per call
    assert calls[0].__name__ == "_selective_scan_kernel" and torch.isfinite(y).all()
    assert len(calls) == len({_interp_fast._langs(f) for f in calls}) <= 2, [f.__name__ for f in calls]
    assert {n: getattr(tl, n) for n in before} == before
    assert getattr(_interp_fast._STATE, "active", None) is None
    assert getattr(_interp_fast._STATE, "pending", None) is None
    assert interpreter._patch_lang is _interp_fast.patch_lang_once


def test_importing_kernels_runtime_leaves_the_interpreter_alone_until_asked():
    """Importing kernels_runtime and its ops patches nothing in Triton; enable_fast_interpreter() does, and
    LLM4LLM_FAST_INTERP=0 declines it (a fresh process: this one's conftest has opted in)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "from triton.runtime import interpreter\n"
        "from triton.runtime.interpreter import GridExecutor, ScanOps\n"
        "before = (ScanOps.generic_scan, interpreter._patch_lang, GridExecutor.__call__)\n"
        "import kernels_runtime, kernels_runtime.ops.gemv, kernels_runtime.ops.selective_scan, kernels_runtime.patch\n"
        "from kernels_runtime.interp import enable_fast_interpreter, fast_interpreter_enabled\n"
        "assert (ScanOps.generic_scan, interpreter._patch_lang, GridExecutor.__call__) == before, 'patched on import'\n"
        "assert not fast_interpreter_enabled()\n"
        "on = kernels_runtime.enable_fast_interpreter()\n"
        "now = (ScanOps.generic_scan, interpreter._patch_lang, GridExecutor.__call__)\n"
        "print(on, fast_interpreter_enabled(), sum(a is not b for a, b in zip(now, before)))\n")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "TRITON_INTERPRET": "1"}
    env.pop("LLM4LLM_FAST_INTERP", None)
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "True", "3"]
    env["LLM4LLM_FAST_INTERP"] = "0"
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False", "False", "0"]
