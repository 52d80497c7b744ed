"""The TMA GEMV kernel behind kernels_runtime.ops.gemv: `_gemv_tma_kernel`, one x row whose weight tiles come by
TMA into shared memory (sm_90+, or the interpreter's emulated descriptors), and `_tma_fits`, the passes it takes.
kernels_runtime/ops/gemv.py launches it (`_stream`) and is the public module: import from there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_runtime.ops._common import cast_out, gate_act, rnd, stamp


@triton.jit
def _tma_tile(acc, acc_u, w, u, x_ptr, nw_ptr, kk, K, rstd, PRO_NORM: tl.constexpr, SWIGLU: tl.constexpr,
              ACT_DTYPE: tl.constexpr):
    # one weight tile (and its up tile) times x's slice kk, HF's RMSNorm roundings where the norm is fused
    k_ok = kk < K
    x = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
    if PRO_NORM:  # HF's RMSNorm: weight * (x * rstd).to(dtype), rounded again
        nw = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        x = rnd(nw * rnd(x * rstd, ACT_DTYPE), ACT_DTYPE)
    acc += w.to(tl.float32) * x[None, :]  # past K: the descriptor's zero fill
    if SWIGLU:
        acc_u += u.to(tl.float32) * x[None, :]
    return acc, acc_u


@triton.jit
def _gemv_tma_kernel(
    x_ptr, nw_ptr, a_desc, b_desc, y_ptr, r_ptr, ts_ptr, N, K, eps,
    PRO_NORM: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, ACT_DTYPE: tl.constexpr,
    RNE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, NORM_ROW: tl.constexpr,
    PDL: tl.constexpr = False, PRE: tl.constexpr = False, LATE: tl.constexpr = False,
    TIMELINE: tl.constexpr = False, GELU: tl.constexpr = False,
):
    # GELU: SWIGLU's activation is GELU's tanh form (Gemma's MLP); the prologue norm is Llama's only (`_stream`).
    # One x row (batch 1), no K split: y[n] = w0[n] . x (+ residual) or, SWIGLU, silu(w0[n] . x) * (w1[n] . x), with
    # `_gemv_kernel`'s roundings. The weight tiles come by TMA into shared memory, STAGES of them in flight a
    # program (Triton's pipeliner), where `_gemv_kernel` holds its tiles in registers: more bytes in flight an SM
    # (qwen3-4b's gate/up: 27.9 us against 35.2 standalone). The descriptors are
    # made on the host (kernel parameters): device-made ones sit in triton's global scratch, which the next kernel,
    # launched early by PDL, may overwrite (a PDL chain replayed from a graph hung that way).
    # PRE (with PDL): the first weight tile is loaded before the wait, as `_gemv_kernel` does, so the pass streams
    # while the kernel before drains. LATE (with PDL): the next kernel is let launch only after this one's loop, so
    # its programs do not take shared memory and SM slots while this pass still has programs to place.
    stamp(ts_ptr, tl.program_id(0), 0, TIMELINE)
    n0 = tl.program_id(0) * BLOCK_N
    if PDL and not LATE:
        tl.extra.cuda.gdc_launch_dependents()
    if PRE:
        w_first = a_desc.load([n0, 0])
        u_first = w_first
        if SWIGLU:
            u_first = b_desc.load([n0, 0])
    if PDL:
        tl.extra.cuda.gdc_wait()  # x (and the residual) are the previous kernel's output
    stamp(ts_ptr, tl.program_id(0), 1, TIMELINE)
    rstd = 0.0
    if PRO_NORM:
        rr = tl.arange(0, NORM_ROW)
        xs = tl.load(x_ptr + rr, mask=rr < K, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xs * xs, axis=0) / K + eps)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = acc
    if SWIGLU:
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = 0
    if PRE:
        acc, acc_u = _tma_tile(acc, acc_u, w_first, u_first, x_ptr, nw_ptr, rk, K, rstd, PRO_NORM, SWIGLU,
                               ACT_DTYPE)
        k_start = BLOCK_K
    for k0 in tl.range(k_start, K, BLOCK_K, num_stages=STAGES):
        w = a_desc.load([n0, k0])
        u = w
        if SWIGLU:
            u = b_desc.load([n0, k0])
        acc, acc_u = _tma_tile(acc, acc_u, w, u, x_ptr, nw_ptr, k0 + rk, K, rstd, PRO_NORM, SWIGLU, ACT_DTYPE)
    if PDL and LATE:
        tl.extra.cuda.gdc_launch_dependents()
    out = tl.sum(acc, axis=1)
    rn = n0 + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    if SWIGLU:
        act = gate_act(rnd(out, ACT_DTYPE), GELU, ACT_DTYPE)
        out = act * rnd(tl.sum(acc_u, axis=1), ACT_DTYPE)
    elif HAS_RES:
        out = rnd(out, ACT_DTYPE) + tl.load(r_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, cast_out(out, y_ptr.dtype.element_ty, RNE), mask=n_ok)
    stamp(ts_ptr, tl.program_id(0), 2, TIMELINE)


def _tma_fits(M: int, K: int, ws, direct: bool, DOT: bool, BLOCK_N: int, BLOCK_K: int, dtype) -> bool:
    """The TMA pass takes one x row, a weight pass that writes its output (no K split, no DOT), weight rows of a
    multiple of 16 bytes and TMA's box limits (<= 256 a side, >= 16 bytes along K). A batch (M > 1) goes to the
    register or tl.dot pass by design, with the same fusions: `_gemv_tma_kernel` holds one x row, and whether TMA
    tiles pay against tl.dot's pipelined operand loads at M > 1 is for a GPU to measure."""
    size = torch.empty((), dtype=dtype).element_size()
    return (M == 1 and direct and not DOT and len(ws) == 1 and dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (K * size) % 16 == 0 and BLOCK_K * size >= 16 and BLOCK_K <= 256 and BLOCK_N <= 256)
