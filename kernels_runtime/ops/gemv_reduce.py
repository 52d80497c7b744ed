"""The split-K reductions behind kernels_runtime.ops.gemv: the second, tiny launch that adds a weight pass's fp32
partials in a fixed order (deterministic, no atomics) and runs the epilogue: plain or with the residual
(`_reduce_kernel`), silu(gate) * up (`_swiglu_reduce_kernel`), the residual add and the next RMSNorm
(`_residual_rmsnorm_reduce_kernel`), per-head q/k RMSNorm and rotary (`_qkv_reduce_kernel`).
kernels_runtime/ops/gemv.py launches them and is the public module: import from there.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels_runtime.ops._common import cast_out, gate_act, pdl_wait, rms_scale, rnd

MAX_ROW = 16384  # the one-program-per-row epilogues (residual + RMSNorm) keep the row in registers


@triton.jit
def _split_sum(p_ptr, row, cols, mask, M, NTOT, SPLIT):
    # sum over the split partials p[s, row, cols] in a fixed order (deterministic)
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(p_ptr + (s * M + row) * NTOT + cols, mask=mask, other=0.0)
    return acc


@triton.jit
def _reduce_kernel(p_ptr, r_ptr, y_ptr, M, N, SPLIT, stride_rm, stride_ym,
                   HAS_RES: tl.constexpr, ACT_DTYPE: tl.constexpr, RNE: tl.constexpr, BLOCK: tl.constexpr,
                   PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    out = _split_sum(p_ptr, row, cols, mask, M, N, SPLIT)
    if HAS_RES:
        out = rnd(out, ACT_DTYPE) + tl.load(r_ptr + row * stride_rm + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + cols, cast_out(out, y_ptr.dtype.element_ty, RNE), mask=mask)


@triton.jit
def _swiglu_reduce_kernel(p_ptr, y_ptr, M, N, SPLIT, stride_ym,
                          ACT_DTYPE: tl.constexpr, RNE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                          GELU: tl.constexpr = False):
    pdl_wait(PDL)
    # y = silu(gate) * up (GELU: gelu-tanh), gate = p[:, row, :N], up = p[:, row, N:]; each eager op's rounding
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = rnd(_split_sum(p_ptr, row, cols, mask, M, 2 * N, SPLIT), ACT_DTYPE)
    u = rnd(_split_sum(p_ptr, row, N + cols, mask, M, 2 * N, SPLIT), ACT_DTYPE)
    act = gate_act(g, GELU, ACT_DTYPE)
    tl.store(y_ptr + row * stride_ym + cols, cast_out(act * u, y_ptr.dtype.element_ty, RNE), mask=mask)


@triton.jit
def _residual_rmsnorm_reduce_kernel(p_ptr, r_ptr, nw_ptr, on_ptr, h_ptr, y_ptr, M, N, SPLIT, stride_rm, stride_hm,
                                    stride_ym, eps, out_eps, ACT_DTYPE: tl.constexpr, RES_DTYPE: tl.constexpr,
                                    RNE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                                    OUT_NORM: tl.constexpr = False, HAS_NORM: tl.constexpr = True,
                                    GEMMA: tl.constexpr = False):
    pdl_wait(PDL)
    # one program per row: h = residual + out (in the residual's dtype, as the eager add), y = RMSNorm(h) (HAS_NORM);
    # OUT_NORM: out RMSNorm'd first (on_ptr, out_eps: Gemma-2's post_attention / post_feedforward norm, the
    # sandwich); GEMMA: both norms Gemma's (1 + w, fp32 inside, rms_scale)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    out = rnd(_split_sum(p_ptr, row, cols, mask, M, N, SPLIT), ACT_DTYPE)
    if OUT_NORM:
        ow = tl.load(on_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = rms_scale(out, tl.rsqrt(tl.sum(out * out, axis=0) / N + out_eps), ow, GEMMA, ACT_DTYPE)
    h = rnd(out + tl.load(r_ptr + row * stride_rm + cols, mask=mask, other=0.0).to(tl.float32), RES_DTYPE)
    tl.store(h_ptr + row * stride_hm + cols, cast_out(h, h_ptr.dtype.element_ty, RNE), mask=mask)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
        nw = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = rms_scale(h, rstd, nw, GEMMA, RES_DTYPE)
        tl.store(y_ptr + row * stride_ym + cols, cast_out(y, y_ptr.dtype.element_ty, RNE), mask=mask)


@triton.jit
def _qkv_reduce_kernel(p_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, y_ptr, M, HQ, HKV, SPLIT, NTOT, stride_cm,
                       stride_sm, stride_ym, eps, HALF,
                       HAS_NORM: tl.constexpr, HAS_ROPE: tl.constexpr, ACT_DTYPE: tl.constexpr, RNE: tl.constexpr,
                       BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # Grid (M, HQ + 2 HKV): one head of q, k or v. q/k: RMSNorm over the head (Qwen3's q_norm / k_norm), then
    # q * cos + rotate_half(q) * sin with rotate_half(q) = [-q2, q1] (HF's apply_rotary_pos_emb, each op rounded).
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    is_q = head < HQ
    is_v = head >= HQ + HKV
    d = tl.arange(0, BLOCK_H)
    mask = d < HALF
    c1 = head * 2 * HALF + d  # the head's first half; its second half is c1 + HALF
    x1 = rnd(_split_sum(p_ptr, row, c1, mask, M, NTOT, SPLIT), ACT_DTYPE)
    x2 = rnd(_split_sum(p_ptr, row, c1 + HALF, mask, M, NTOT, SPLIT), ACT_DTYPE)
    y1, y2 = x1, x2
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        nw_ptr = tl.where(is_q, qn_ptr, kn_ptr)
        w1 = tl.load(nw_ptr + d, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(nw_ptr + HALF + d, mask=mask, other=0.0).to(tl.float32)
        y1 = rnd(w1 * rnd(x1 * rstd, ACT_DTYPE), ACT_DTYPE)
        y2 = rnd(w2 * rnd(x2 * rstd, ACT_DTYPE), ACT_DTYPE)
    if HAS_ROPE:
        cs1 = tl.load(cos_ptr + row * stride_cm + d, mask=mask, other=0.0).to(tl.float32)
        cs2 = tl.load(cos_ptr + row * stride_cm + HALF + d, mask=mask, other=0.0).to(tl.float32)
        sn1 = tl.load(sin_ptr + row * stride_sm + d, mask=mask, other=0.0).to(tl.float32)
        sn2 = tl.load(sin_ptr + row * stride_sm + HALF + d, mask=mask, other=0.0).to(tl.float32)
        r1 = rnd(rnd(y1 * cs1, ACT_DTYPE) + rnd(-y2 * sn1, ACT_DTYPE), ACT_DTYPE)
        r2 = rnd(rnd(y2 * cs2, ACT_DTYPE) + rnd(y1 * sn2, ACT_DTYPE), ACT_DTYPE)
        y1, y2 = r1, r2
    y1 = tl.where(is_v, x1, y1)  # v: the projection only
    y2 = tl.where(is_v, x2, y2)
    dt = y_ptr.dtype.element_ty
    tl.store(y_ptr + row * stride_ym + c1, cast_out(y1, dt, RNE), mask=mask)
    tl.store(y_ptr + row * stride_ym + c1 + HALF, cast_out(y2, dt, RNE), mask=mask)


def _reduce_block(n: int) -> int:
    return min(1024, triton.next_power_of_2(max(n, 16)))
