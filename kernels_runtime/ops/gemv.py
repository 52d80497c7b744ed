"""Decode GEMVs that stream the weights once, with the work around them fused into a prologue and an epilogue.

At decode batches (1 to a few dozen rows) a projection `x @ W.T` is bound by reading W: the kernel exists to keep
HBM busy, and reads each weight tile once for every row of the batch (the FMA reduction up to MAX_FMA_M rows,
tl.dot tiles of 16..MAX_ROWS rows past it).
`_gemv_kernel` is one weight-streaming pass over up to three weights laid side by side along N (q/k/v, or gate/up):
each program picks its weight by its program id (no concatenated copy), reads a [BLOCK_N, BLOCK_K] tile of it per
step with 16-byte loads along K (rows contiguous, no mask along K when the split divides K), and accumulates
`w * x` elementwise in fp32 registers, reducing over K once after the loop (no shuffles inside it). K is split over
SPLIT_K programs so that narrow outputs still give every SM several programs; the split partial sums go to an fp32
buffer [SPLIT_K, M, N_total] and a second, tiny launch adds them in a fixed order (deterministic, no atomics) and
runs the epilogue:
- `gemv`: plain, or `residual + out` (an o_proj / down_proj with the block's residual add); the lm_head;
- `gemv_residual_rmsnorm`: `h = residual + out` and the next RMSNorm of h (one program per row: it needs the row);
- `gate_up_swiglu`: gate and up in one pass, `silu(gate) * up` in the reduction;
- `qkv_norm_rope`: q, k, v in one pass; per head the Qwen3 q/k RMSNorm and the rotary embedding in the reduction.
A `norm_w` prologue (RMSNorm of x folded into the GEMV: each program reads the whole x row from L2 for its rstd)
removes the norm launch in front of a projection (post_attention_layernorm before gate/up).

Numerics follow transformers 5.17 (LlamaAttention / Qwen3Attention / LlamaMLP, bf16 modules): each nn.Linear
output is rounded to the activation dtype before the next op, each elementwise op of the eager code rounds.
The accumulation order differs from cuBLAS's (fp32 either way).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels_runtime.ops._common import (_TL, TIMELINE, cast_out, interpreting, l2_prefetch, l2_prefetch_bytes,
                                         l2_prefetch_on, launch, pdl_launch, pdl_on, pdl_wait, rnd, stamp,
                                         timeline_rows)

# Hand-picked starting points for a 132-SM HBM3 GPU (bf16, batch 1): 16-row tiles 512 deep are 16 KB a step per
# program.
CONFIG_SPACE: dict[str, list] = {"BLOCK_N": [4, 8, 16, 32, 64], "BLOCK_K": [64, 128, 256, 512, 1024, 2048, 4096],
                                 "SPLIT_K": [1, 2, 4, 8, 16], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3]}
DEFAULT = {"BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1}
# Rows one program takes, so that each weight tile is read once for the whole decode batch. The FMA path keeps a
# [BLOCK_M, BLOCK_N, BLOCK_K] fp32 product in registers, so it takes at most MAX_FMA_M rows (FMA_MAX_M, a launcher
# argument the search tunes per batch, lowers that); more rows take the tl.dot path, whose [BLOCK_M, BLOCK_N]
# accumulator holds up to MAX_ROWS rows (a serving batch). Past MAX_ROWS (a prefill-sized call reaching a decode
# kernel) row blocks of MAX_ROWS re-read the weights: correct, at GEMM-by-GEMV speed.
MAX_FMA_M = 16
MAX_ROWS = 64
DOT_MIN_M = 16  # tl.dot's smallest tile along M: fewer rows are padded (masked) up to it
# The tl.dot path's pipeline depth (DOT_STAGES, a launcher argument): Triton's pipeliner keeps that many weight
# tiles in flight through shared memory, where the register PREFETCH of the FMA path (and PDL's early first tile)
# would stop it; at 1 stage the pass is latency-bound (docs/results/2026-12-06-h100-batch: 2-3x slower).
DOT_STAGES = 4
MAX_ROW = 16384  # the one-program-per-row epilogues (residual + RMSNorm) keep the row in registers


@triton.jit
def _gemv_kernel(
    # Pointers
    x_ptr, nw_ptr, w0_ptr, w1_ptr, w2_ptr, p_ptr, r_ptr, pf0_ptr, pf1_ptr, ts_ptr,
    # Dimensions: segment widths N0, N1, N2, their first block indices NB1 = blocks(N0), NB2 = NB1 + blocks(N1);
    # the bytes of pf0 / pf1 to prefetch into L2
    PF0_BYTES, PF1_BYTES, M, K, K_PER, N0, N1, N2, NB1, NB2, NTOT,
    # Strides
    stride_xm, stride_pm, stride_rm, eps,
    # Meta-parameters
    PRO_NORM: tl.constexpr, DIRECT: tl.constexpr, HAS_RES: tl.constexpr, EVEN_K: tl.constexpr,
    ACT_DTYPE: tl.constexpr, RNE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT: tl.constexpr = False, UPCAST_DOT: tl.constexpr = False, DOT_PRECISION: tl.constexpr = "ieee",
    SWIGLU: tl.constexpr = False, PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False,
    NORM_ROW: tl.constexpr = 0, ONE_TILE: tl.constexpr = False, L2PF: tl.constexpr = 0, LANES: tl.constexpr = 128,
    TIMELINE: tl.constexpr = False,
):
    # Grid (blocks over N0 + N1 + N2, SPLIT_K, blocks over M). DIRECT (no split): y[:, col] = out (+ residual, one
    # segment only) stored in p_ptr's dtype; else fp32 partial sums p[split, m, col]. SWIGLU (DIRECT, one segment:
    # the gate): the program also streams the same rows of the up weight (w1_ptr) and stores silu(gate) * up.
    # PREFETCH: the next weight tile is loaded before the current one is used (two tiles in flight a program).
    # ONE_TILE (a program's K range is one BLOCK_K tile): with PDL the program's whole weight slab is loaded before
    # the wait, so a GEMV behind a latency-bound kernel (o_proj behind attention) streams while that kernel runs.
    # PDL (programmatic dependent launch, sm_90+): the kernel may start while the previous one drains; it lets the
    # next kernel start the same way, loads its first weight tile (weights are never written), then waits for the
    # previous kernel before it reads anything that kernel wrote and before it writes anything.
    # L2PF (1 or 2 tensors): the programs ask the L2 for the first PF0_BYTES of pf0 (and PF1_BYTES of pf1), the
    # weights of a later kernel, before the wait: with this pass reading its own weights from L2 (prefetched by the
    # kernel before), HBM would otherwise idle.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_ts = pid_n + tl.num_programs(0) * (split + tl.num_programs(1) * tl.program_id(2))  # TIMELINE's row
    stamp(ts_ptr, pid_ts, 0, TIMELINE)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    m_ok = rm < M
    in1 = pid_n >= NB1
    in2 = pid_n >= NB2
    w_ptr = tl.where(in2, w2_ptr, tl.where(in1, w1_ptr, w0_ptr))  # this program's weight: no concatenated copy
    n_seg = tl.where(in2, N2, tl.where(in1, N1, N0))
    col0 = tl.where(in2, N0 + N1, tl.where(in1, N0, 0))
    nb = pid_n - tl.where(in2, NB2, tl.where(in1, NB1, 0))
    rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] rows of this weight
    n_ok = rn < n_seg
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K  # [BN, 1]
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    if SWIGLU:
        u_rows = w1_ptr + rn.to(tl.int64)[:, None] * K  # [BN, 1] the same rows of the up weight
    k_lo = split * K_PER
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH:  # the first tile, before waiting on the previous kernel
        if EVEN_K:
            f_ok = rk < BLOCK_K
        else:
            f_ok = ((k_lo + rk) < K) & (rk < K_PER)
        w_nxt = tl.load(w_rows + (k_lo + rk)[None, :], mask=n_ok[:, None] & f_ok[None, :], other=0.0)
        if SWIGLU:
            u_nxt = tl.load(u_rows + (k_lo + rk)[None, :], mask=n_ok[:, None] & f_ok[None, :], other=0.0)
    if L2PF > 0:
        parts = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        part = (tl.program_id(2) * tl.num_programs(1) + split) * tl.num_programs(0) + pid_n
        l2_prefetch(pf0_ptr, PF0_BYTES, part, parts, LANES)
        if L2PF > 1:
            l2_prefetch(pf1_ptr, PF1_BYTES, part, parts, LANES)
    if PDL:
        tl.extra.cuda.gdc_wait()
    stamp(ts_ptr, pid_ts, 1, TIMELINE)
    if PRO_NORM:  # rstd of each x row over all of K (from L2: every program reads the row)
        if NORM_ROW > 0:  # the whole row in one load: one L2 round trip before streaming, not one a tile
            rr = tl.arange(0, NORM_ROW)
            xs = tl.load(x_rows + rr[None, :], mask=m_ok[:, None] & (rr < K)[None, :], other=0.0).to(tl.float32)
            ss = tl.sum(xs * xs, axis=1)
        else:
            ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xs = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok[:, None] & ((k0 + rk) < K)[None, :],
                             other=0.0).to(tl.float32)
                ss += tl.sum(xs * xs, axis=1)
        rstd = tl.rsqrt(ss / K + eps)
    if DOT:  # the tensor cores over a 16..64-row x tile (rows past M masked): Triton pipelines dot operands' loads
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SWIGLU:
            acc2_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if SWIGLU:
            acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        if SWIGLU:
            acc3_u = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K_PER, BLOCK_K):
        kk = k_lo + k0 + rk
        if EVEN_K:  # the split divides K into whole tiles: no mask along K, so the loads stay 16 bytes wide
            k_ok = rk < BLOCK_K
        else:
            k_ok = (kk < K) & ((k0 + rk) < K_PER)
        if PREFETCH and ONE_TILE:  # the program's whole K slab was loaded before the wait: nothing to load ahead
            w = w_nxt
            if SWIGLU:
                u = u_nxt
        elif PREFETCH:  # this tile was loaded one step ago; load the next (a uniform mask past the split's end)
            w = w_nxt
            if EVEN_K:
                n_ok_k = rk < K_PER - k0 - BLOCK_K  # all or none: the split holds whole tiles
            else:
                n_ok_k = ((kk + BLOCK_K) < K) & ((k0 + BLOCK_K + rk) < K_PER)
            w_nxt = tl.load(w_rows + (kk + BLOCK_K)[None, :], mask=n_ok[:, None] & n_ok_k[None, :], other=0.0)
            if SWIGLU:
                u = u_nxt
                u_nxt = tl.load(u_rows + (kk + BLOCK_K)[None, :], mask=n_ok[:, None] & n_ok_k[None, :], other=0.0)
        else:
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if SWIGLU:
                u = tl.load(u_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BM, BK]
        if PRO_NORM:  # HF's RMSNorm: weight * (x * rstd).to(dtype), rounded again
            nw = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            x = rnd(nw[None, :] * rnd(x * rstd[:, None], ACT_DTYPE), ACT_DTYPE)
        if DOT:
            xd = x.to(w.dtype)  # exact: x is a value of the activation dtype (loaded, or rounded by rnd)
            if UPCAST_DOT:
                acc2 = tl.dot(xd.to(tl.float32), tl.trans(w.to(tl.float32)), acc2, input_precision="ieee")
                if SWIGLU:
                    acc2_u = tl.dot(xd.to(tl.float32), tl.trans(u.to(tl.float32)), acc2_u, input_precision="ieee")
            else:
                acc2 = tl.dot(xd, tl.trans(w), acc2, input_precision=DOT_PRECISION)
                if SWIGLU:
                    acc2_u = tl.dot(xd, tl.trans(u), acc2_u, input_precision=DOT_PRECISION)
        elif BLOCK_M == 1:
            w = w.to(tl.float32)
            acc += w * x
            if SWIGLU:
                acc_u += u.to(tl.float32) * x
        else:
            acc3 += w.to(tl.float32)[None, :, :] * x[:, None, :]
            if SWIGLU:
                acc3_u += u.to(tl.float32)[None, :, :] * x[:, None, :]
    if DOT:
        out = acc2
        if SWIGLU:
            out_u = acc2_u
    elif BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]  # [1, BN]
        if SWIGLU:
            out_u = tl.sum(acc_u, axis=1)[None, :]
    else:
        out = tl.sum(acc3, axis=2)  # [BM, BN]
        if SWIGLU:
            out_u = tl.sum(acc3_u, axis=2)
    mask = m_ok[:, None] & n_ok[None, :]
    if SWIGLU:  # LlamaMLP's roundings: each projection, silu, then the product
        g = rnd(out, ACT_DTYPE)
        act = rnd(g * tl.sigmoid(g), ACT_DTYPE)
        y = act * rnd(out_u, ACT_DTYPE)
        tl.store(p_ptr + rm[:, None] * stride_pm + rn[None, :], cast_out(y, p_ptr.dtype.element_ty, RNE), mask=mask)
    elif DIRECT:
        if HAS_RES:  # nn.Linear's output rounded first, then the residual added in fp32
            out = rnd(out, ACT_DTYPE) + tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mask,
                                                other=0.0).to(tl.float32)
        tl.store(p_ptr + rm[:, None] * stride_pm + (col0 + rn)[None, :], cast_out(out, p_ptr.dtype.element_ty, RNE),
                 mask=mask)
    else:
        offs = (split * M + rm.to(tl.int64))[:, None] * NTOT + (col0 + rn)[None, :]
        tl.store(p_ptr + offs, out, mask=mask)
    stamp(ts_ptr, pid_ts, 2, TIMELINE)


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
    TIMELINE: tl.constexpr = False,
):
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
        g = rnd(out, ACT_DTYPE)
        act = rnd(g * tl.sigmoid(g), ACT_DTYPE)
        out = act * rnd(tl.sum(acc_u, axis=1), ACT_DTYPE)
    elif HAS_RES:
        out = rnd(out, ACT_DTYPE) + tl.load(r_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, cast_out(out, y_ptr.dtype.element_ty, RNE), mask=n_ok)
    stamp(ts_ptr, tl.program_id(0), 2, TIMELINE)


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
                          ACT_DTYPE: tl.constexpr, RNE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # y = silu(gate) * up, gate = p[:, row, :N], up = p[:, row, N:]; each eager op's rounding (LlamaMLP)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = rnd(_split_sum(p_ptr, row, cols, mask, M, 2 * N, SPLIT), ACT_DTYPE)
    u = rnd(_split_sum(p_ptr, row, N + cols, mask, M, 2 * N, SPLIT), ACT_DTYPE)
    act = rnd(g * tl.sigmoid(g), ACT_DTYPE)
    tl.store(y_ptr + row * stride_ym + cols, cast_out(act * u, y_ptr.dtype.element_ty, RNE), mask=mask)


@triton.jit
def _residual_rmsnorm_reduce_kernel(p_ptr, r_ptr, nw_ptr, h_ptr, y_ptr, M, N, SPLIT, stride_rm, stride_hm,
                                    stride_ym, eps, ACT_DTYPE: tl.constexpr, RES_DTYPE: tl.constexpr,
                                    RNE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # one program per row: h = residual + out (in the residual's dtype, as the eager add), y = RMSNorm(h)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    out = rnd(_split_sum(p_ptr, row, cols, mask, M, N, SPLIT), ACT_DTYPE)
    h = rnd(out + tl.load(r_ptr + row * stride_rm + cols, mask=mask, other=0.0).to(tl.float32), RES_DTYPE)
    tl.store(h_ptr + row * stride_hm + cols, cast_out(h, h_ptr.dtype.element_ty, RNE), mask=mask)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    nw = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = nw * rnd(h * rstd, RES_DTYPE)
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


# ----------------------------------------------------------------------------------------------------------------
# References (pure PyTorch, the eager modules' op order and roundings)


def gemv_ref(x, w, residual=None, norm_w=None, eps=1e-6):
    """x: [..., K] (RMSNorm'd by norm_w first when given), w: [N, K] -> x @ w.T (+ residual, in its dtype)."""
    if norm_w is not None:
        x = _rmsnorm_ref(x, norm_w, eps)
    y = torch.nn.functional.linear(x.float(), w.float()).to(x.dtype)
    return y if residual is None else (residual.float() + y.float()).to(residual.dtype)


def _rmsnorm_ref(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def gemv_residual_rmsnorm_ref(x, w, residual, norm_w, eps=1e-6):
    """-> (h = residual + x @ w.T, RMSNorm(h) * norm_w)."""
    h = gemv_ref(x, w, residual)
    return h, _rmsnorm_ref(h, norm_w, eps)


def gate_up_swiglu_ref(x, w_gate, w_up, norm_w=None, eps=1e-6):
    """-> silu(x @ w_gate.T) * (x @ w_up.T), x RMSNorm'd by norm_w first when given."""
    if norm_w is not None:
        x = _rmsnorm_ref(x, norm_w, eps)
    g = torch.nn.functional.linear(x.float(), w_gate.float()).to(x.dtype)
    u = torch.nn.functional.linear(x.float(), w_up.float()).to(x.dtype)
    return torch.nn.functional.silu(g) * u


def qkv_norm_rope_ref(x, wq, wk, wv, cos, sin, head_dim, q_norm_w=None, k_norm_w=None, eps=1e-6, norm_w=None,
                      norm_eps=1e-6):
    """x: [M, K], cos/sin: [M, D] or None -> q [M, Hq, D], k [M, Hkv, D], v [M, Hkv, D] (Qwen3Attention's
    projections, q_norm/k_norm and apply_rotary_pos_emb; Llama's without the norms); x RMSNorm'd by norm_w first."""
    if norm_w is not None:
        x = _rmsnorm_ref(x, norm_w, norm_eps)
    def proj(w):
        return torch.nn.functional.linear(x.float(), w.float()).to(x.dtype).view(x.shape[0], -1, head_dim)

    q, k, v = proj(wq), proj(wk), proj(wv)
    if q_norm_w is not None:
        q, k = _rmsnorm_ref(q, q_norm_w, eps), _rmsnorm_ref(k, k_norm_w, eps)
    if cos is not None:
        c, s = cos[:, None, :], sin[:, None, :]

        def rot(t):
            t1, t2 = t[..., : head_dim // 2], t[..., head_dim // 2:]
            return torch.cat((-t2, t1), dim=-1)

        q, k = q * c + rot(q) * s, k * c + rot(k) * s
    return q, k, v


# ----------------------------------------------------------------------------------------------------------------
# Launchers


def _check_cfg(BLOCK_N, BLOCK_K, SPLIT_K):
    for name, v in (("BLOCK_N", BLOCK_N), ("BLOCK_K", BLOCK_K)):
        if not (isinstance(v, int) and v >= 1 and v & (v - 1) == 0):
            raise ValueError(f"gemv: expected {name} a power of two, got {v!r}")
    if not (isinstance(SPLIT_K, int) and SPLIT_K >= 1):
        raise ValueError(f"gemv: expected SPLIT_K an int >= 1, got {SPLIT_K!r}")


def _rows2(t, K, name):
    t2 = t.reshape(-1, K)
    if t2.stride(-1) != 1:
        raise ValueError(f"gemv: expected {name} with a unit last stride, got strides {tuple(t.stride())}")
    return t2


def _weights(ws, K, dtype):
    for w in ws:
        if w.dim() != 2 or w.shape[1] != K:
            raise ValueError(f"gemv: expected weights [N, {K}], got {[tuple(v.shape) for v in ws]}")
        if not w.is_contiguous():
            raise ValueError("gemv: expected contiguous weights (nn.Linear layout)")
        if w.dtype != dtype:
            raise ValueError(f"gemv: expected weights in {dtype}, got {w.dtype}")


def _tma_fits(M: int, K: int, ws, direct: bool, DOT: bool, BLOCK_N: int, BLOCK_K: int, dtype) -> bool:
    """The TMA pass takes one x row, a weight pass that writes its output (no K split, no DOT), weight rows of a
    multiple of 16 bytes and TMA's box limits (<= 256 a side, >= 16 bytes along K). A batch (M > 1) goes to the
    register or tl.dot pass by design, with the same fusions: `_gemv_tma_kernel` holds one x row, and whether TMA
    tiles pay against tl.dot's pipelined operand loads at M > 1 is for a GPU to measure."""
    size = torch.empty((), dtype=dtype).element_size()
    return (M == 1 and direct and not DOT and len(ws) == 1 and dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (K * size) % 16 == 0 and BLOCK_K * size >= 16 and BLOCK_K <= 256 and BLOCK_N <= 256)


def _split_of(K: int, BLOCK_K: int, SPLIT_K: int) -> tuple[int, int]:
    """(programs along K, K a program covers in whole BLOCK_K tiles), no empty split."""
    split = max(1, min(SPLIT_K, triton.cdiv(K, BLOCK_K)))
    k_per = triton.cdiv(triton.cdiv(K, split), BLOCK_K) * BLOCK_K
    return triton.cdiv(K, k_per), k_per


def _dot_path(M: int, DOT: bool, FMA_MAX_M: int = MAX_FMA_M) -> bool:
    """tl.dot where asked (DOT) or where M passes the FMA path's row limit (FMA_MAX_M, at most MAX_FMA_M)."""
    return bool(DOT) or M > min(FMA_MAX_M, MAX_FMA_M)


def _dot_tiles(BLOCK_N: int, BLOCK_K: int) -> tuple[int, int]:
    """The tl.dot path's weight tile: at least 16 rows, 16..256 deep (w tiles of at most 16 KB a stage)."""
    return max(16, BLOCK_N), max(16, min(BLOCK_K, 256))


def _rows_per_program(M: int, dot: bool) -> int:
    """BLOCK_M: every row of the call in one program (each weight tile read once) up to the path's limit; tl.dot's
    tile is at least DOT_MIN_M rows."""
    if dot:
        return min(MAX_ROWS, max(DOT_MIN_M, triton.next_power_of_2(M)))
    return triton.next_power_of_2(M)


def _check_rows(FMA_MAX_M) -> None:
    if not (isinstance(FMA_MAX_M, int) and 0 <= FMA_MAX_M <= MAX_FMA_M):
        raise ValueError(f"gemv: expected FMA_MAX_M an int in 0..{MAX_FMA_M}, got {FMA_MAX_M!r}")


def _norm_row(pro_norm: bool, block_m: int, K: int) -> int:
    """The norm prologue's one-load width (the row padded to a power of two) for one row up to 8192 wide (32 fp32
    registers a thread at 4 warps for 4096); 0: the per-tile loop."""
    width = triton.next_power_of_2(K)
    return width if pro_norm and block_m == 1 and width <= 8192 else 0


def _stream(x2, ws, *, norm_w=None, eps=0.0, direct_out=None, residual2=None, swiglu_up=None, BLOCK_N, BLOCK_K,
            SPLIT_K, num_warps, num_stages, DOT=False, PREFETCH=False, PDL=False, l2_prefetch=(), TMA=0,
            TMA_PRE=False, TMA_LATE=False, FMA_MAX_M=MAX_FMA_M, DOT_STAGES=DOT_STAGES):
    """The weight-streaming pass over ws (1-3 weights side by side): fp32 partials [split, M, sum N], or with
    `direct_out` and no split the output itself (columns side by side; a residual only with one weight), or with
    `swiglu_up` too (ws = [gate], no split) silu(x @ gate.T) * (x @ up.T). Returns (partials or direct_out,
    split, 0 when direct). DOT: tl.dot over x padded to 16..64 rows (BLOCK_N raised to 16, BLOCK_K held to
    16..256: shared-memory stages); the DOT path also takes calls of more than FMA_MAX_M rows (`_dot_path`), all
    rows of up to MAX_ROWS in one program (`_rows_per_program`), more in blocks of MAX_ROWS. PREFETCH: two
    weight tiles in flight a program; PDL (implies PREFETCH): programmatic dependent launch. l2_prefetch: up to two
    (tensor, bytes) whose first bytes the pass asks the L2 for (`_gemv_kernel`'s L2PF). TMA (a pipeline depth, 0
    off): the weight tiles by TMA (`_gemv_tma_kernel`) where the pass fits it (`_tma_fits`; l2_prefetch then
    dropped), else the register pass; TMA_PRE / TMA_LATE: that kernel's PRE and LATE (with PDL)."""
    _check_cfg(BLOCK_N, BLOCK_K, SPLIT_K)
    _check_rows(FMA_MAX_M)
    M, K = x2.shape
    DOT = _dot_path(M, DOT, FMA_MAX_M)
    if DOT:  # pipelined by Triton (DOT_STAGES tiles in flight), not by the register prefetch
        BLOCK_N, BLOCK_K = _dot_tiles(BLOCK_N, BLOCK_K)
        num_stages, PREFETCH = max(1, int(DOT_STAGES)), False
    ns = [w.shape[0] for w in ws] + [0] * (3 - len(ws))
    nbs = [triton.cdiv(n, BLOCK_N) for n in ns]
    ntot = sum(ns)
    split, k_per = _split_of(K, BLOCK_K, SPLIT_K)
    direct = direct_out is not None and split == 1
    swiglu = swiglu_up is not None
    if swiglu and (not direct or len(ws) != 1):
        raise ValueError("gemv: the paired gate/up pass takes one gate weight and no K split")
    if TMA and _tma_fits(M, K, ws, direct, DOT, BLOCK_N, BLOCK_K, ws[0].dtype) and (
            norm_w is None or _norm_row(True, 1, K)):
        n = ws[0].shape[0]
        block = [BLOCK_N, BLOCK_K]
        a_desc = TensorDescriptor.from_tensor(ws[0], block)
        b_desc = TensorDescriptor.from_tensor(swiglu_up, block) if swiglu else a_desc
        ts = None if TIMELINE["buf"] is None else timeline_rows("swiglu_tma" if swiglu else "gemv_tma",
                                                                 triton.cdiv(n, BLOCK_N))
        _gemv_tma_kernel[(triton.cdiv(n, BLOCK_N),)](
            x2, x2 if norm_w is None else norm_w, a_desc, b_desc, direct_out,
            residual2 if residual2 is not None else direct_out, x2 if ts is None else ts, n, K, float(eps),
            PRO_NORM=norm_w is not None, HAS_RES=residual2 is not None, SWIGLU=swiglu,
            ACT_DTYPE=_TL.get(x2.dtype, tl.float32), RNE=interpreting(), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            STAGES=int(TMA), NORM_ROW=_norm_row(norm_w is not None, 1, K), PDL=pdl_on(PDL),
            PRE=bool(TMA_PRE), LATE=bool(TMA_LATE) and pdl_on(PDL), TIMELINE=ts is not None, num_warps=num_warps,
            **pdl_launch(PDL))
        return direct_out, 0
    block_m = _rows_per_program(M, DOT)
    out = direct_out if direct else torch.empty((split, M, ntot), device=x2.device, dtype=torch.float32)
    r2 = residual2 if residual2 is not None else out
    w0, w1, w2 = (list(ws) + [ws[0], ws[0]])[:3]
    if swiglu:
        w1 = swiglu_up
    pf = _l2_targets(l2_prefetch)
    grid = (sum(nbs), split, triton.cdiv(M, block_m))
    ts = None if TIMELINE["buf"] is None else timeline_rows(  # (off: one lookup on the launch path)
        "swiglu" if swiglu else ("gemv" if direct else "gemv_split"), math.prod(grid))
    launch(_gemv_kernel, grid, (
        x2, x2 if norm_w is None else norm_w, w0, w1, w2, out, r2, *(t if t is not None else x2 for t, _ in pf),
        x2 if ts is None else ts,
        *(n for _, n in pf), M, K, k_per, ns[0], ns[1], ns[2], nbs[0], nbs[0] + nbs[1], ntot,
        x2.stride(0), out.stride(-2) if direct else ntot, r2.stride(-2) if residual2 is not None else 0, float(eps)),
        dict(PRO_NORM=norm_w is not None, DIRECT=direct, HAS_RES=direct and residual2 is not None,
             EVEN_K=K % k_per == 0, ACT_DTYPE=_TL.get(x2.dtype, tl.float32), RNE=interpreting(),
             BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT=bool(DOT), UPCAST_DOT=bool(DOT) and interpreting(),
             DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", SWIGLU=swiglu,
             PREFETCH=bool(PREFETCH or (PDL and not DOT)), PDL=pdl_on(PDL),
             NORM_ROW=_norm_row(norm_w is not None, block_m, K), ONE_TILE=k_per == BLOCK_K,
             L2PF=sum(n > 0 for _, n in pf) if l2_prefetch_on(pf[0][1]) else 0, LANES=32 * num_warps,
             TIMELINE=ts is not None),
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(PDL))
    return out, (0 if direct else split)


def _l2_targets(pairs) -> list[tuple[torch.Tensor | None, int]]:
    """Two (tensor, bytes) slots from up to two (tensor, bytes) pairs (bytes None: the whole tensor), the ones
    with bytes first; (None, 0) where empty."""
    out = []
    for t, n in pairs or ():
        n = l2_prefetch_bytes(t, n, "gemv")
        if n:
            out.append((t, n))
    if len(out) > 2:
        raise ValueError(f"gemv: expected at most two l2_prefetch tensors, got {len(out)}")
    return out + [(None, 0)] * (2 - len(out))


def _reduce_block(n: int) -> int:
    return min(1024, triton.next_power_of_2(max(n, 16)))


def gemv(x: torch.Tensor, w: torch.Tensor, *, residual: torch.Tensor | None = None, norm_w: torch.Tensor | None = None,
         eps: float = 1e-6, BLOCK_N: int = 16, BLOCK_K: int = 512, SPLIT_K: int = 1, num_warps: int = 4,
         num_stages: int = 1, DOT: bool = False, PREFETCH: bool = False, PDL: bool = False,
         l2_prefetch=(), TMA: int = 0, TMA_PRE: bool = False, TMA_LATE: bool = False,
         FMA_MAX_M: int = MAX_FMA_M, DOT_STAGES: int = DOT_STAGES) -> torch.Tensor:
    """x: [..., K] (decode: a few rows), w: [N, K] -> x @ w.T [..., N] in x's dtype; `residual` [..., N]: plus the
    residual (the output then in its dtype); `norm_w` [K]: x RMSNorm'd (eps) first, inside the GEMV. PREFETCH /
    PDL: `_gemv_kernel`'s; l2_prefetch: up to two (tensor, bytes or None for all) of a later kernel that the pass
    asks the L2 for (a hint: the result does not depend on it). TMA, TMA_PRE, TMA_LATE: `_stream`'s (batch 1 only).
    FMA_MAX_M: the most rows the FMA path takes; more take tl.dot (`_dot_path`), DOT_STAGES tiles in flight."""
    K = x.shape[-1]
    _weights([w], K, x.dtype)
    N = w.shape[0]
    x2 = _rows2(x, K, "x")
    out_dtype = x.dtype if residual is None else residual.dtype
    r2 = None
    if residual is not None:
        if tuple(residual.shape) != (*x.shape[:-1], N):
            raise ValueError(f"gemv: expected residual {[*x.shape[:-1], N]}, got {tuple(residual.shape)}")
        r2 = _rows2(residual, N, "residual")
    y = torch.empty((x2.shape[0], N), device=x.device, dtype=out_dtype)
    if y.numel():
        part, split = _stream(x2, [w], norm_w=norm_w, eps=eps, direct_out=y, residual2=r2, BLOCK_N=BLOCK_N,
                              BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, num_warps=num_warps, num_stages=num_stages, DOT=DOT,
                              PREFETCH=PREFETCH, PDL=PDL, l2_prefetch=l2_prefetch, TMA=TMA, TMA_PRE=TMA_PRE,
                              TMA_LATE=TMA_LATE, FMA_MAX_M=FMA_MAX_M, DOT_STAGES=DOT_STAGES)
        if split:
            blk = _reduce_block(N)
            launch(_reduce_kernel, (x2.shape[0], triton.cdiv(N, blk)), (
                part, y if r2 is None else r2, y, x2.shape[0], N, split, 0 if r2 is None else r2.stride(0),
                y.stride(0)), dict(HAS_RES=r2 is not None, ACT_DTYPE=_TL.get(x.dtype, tl.float32),
                                   RNE=interpreting(), BLOCK=blk, PDL=pdl_on(PDL)), **pdl_launch(PDL))
    return y.reshape(*x.shape[:-1], N)


def gemv_residual_rmsnorm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor,
                          eps: float = 1e-6, *, BLOCK_N: int = 16, BLOCK_K: int = 512, SPLIT_K: int = 1,
                          num_warps: int = 4, num_stages: int = 1, reduce_warps: int = 4, DOT: bool = False,
                          PREFETCH: bool = False, PDL: bool = False, l2_prefetch=(),
                          FMA_MAX_M: int = MAX_FMA_M, DOT_STAGES: int = DOT_STAGES
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., K], w: [N, K], residual: [..., N], norm_w: [N] -> (h = residual + x @ w.T, RMSNorm(h) * norm_w),
    both in the residual's dtype: an o_proj with the residual add and post_attention_layernorm after it, or a
    down_proj with the next layer's input_layernorm. l2_prefetch: `gemv`'s."""
    K = x.shape[-1]
    _weights([w], K, x.dtype)
    N = w.shape[0]
    if tuple(residual.shape) != (*x.shape[:-1], N) or norm_w.shape != (N,):
        raise ValueError(f"gemv_residual_rmsnorm: expected residual {[*x.shape[:-1], N]} and norm_w [{N}], got "
                         f"{tuple(residual.shape)}, {tuple(norm_w.shape)}")
    if N > MAX_ROW:
        raise ValueError(f"gemv_residual_rmsnorm: expected N <= {MAX_ROW}, got {N}")
    x2, r2 = _rows2(x, K, "x"), _rows2(residual, N, "residual")
    M = x2.shape[0]
    h = torch.empty((M, N), device=x.device, dtype=residual.dtype)
    y = torch.empty((M, N), device=x.device, dtype=residual.dtype)
    if M:
        part, split = _stream(x2, [w], BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, num_warps=num_warps,
                              num_stages=num_stages, DOT=DOT, PREFETCH=PREFETCH, PDL=PDL, l2_prefetch=l2_prefetch,
                              FMA_MAX_M=FMA_MAX_M, DOT_STAGES=DOT_STAGES)
        launch(_residual_rmsnorm_reduce_kernel, (M,), (
            part, r2, norm_w, h, y, M, N, split, r2.stride(0), h.stride(0), y.stride(0), float(eps)),
            dict(ACT_DTYPE=_TL.get(x.dtype, tl.float32), RES_DTYPE=_TL.get(residual.dtype, tl.float32),
                 RNE=interpreting(), BLOCK=triton.next_power_of_2(N), PDL=pdl_on(PDL)),
            num_warps=reduce_warps, **pdl_launch(PDL))
    lead = x.shape[:-1]
    return h.reshape(*lead, N), y.reshape(*lead, N)


def gate_up_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, *, norm_w: torch.Tensor | None = None,
                   eps: float = 1e-6, BLOCK_N: int = 16, BLOCK_K: int = 512, SPLIT_K: int = 1, num_warps: int = 4,
                   num_stages: int = 1, DOT: bool = False, PREFETCH: bool = False, PDL: bool = False,
                   paired: bool = True, TMA: int = 0, TMA_PRE: bool = False, TMA_LATE: bool = False,
                   FMA_MAX_M: int = MAX_FMA_M, DOT_STAGES: int = DOT_STAGES) -> torch.Tensor:
    """x: [..., K], w_gate/w_up: [I, K] -> silu(x @ w_gate.T) * (x @ w_up.T) [..., I], both weights in one pass;
    `norm_w` [K]: x RMSNorm'd first inside the GEMV (post_attention_layernorm). Without a K split (FMA or tl.dot
    path alike) each program streams BLOCK_N / 2 rows of gate and the same rows of up and writes the product itself
    (`paired`: one launch, the same bytes and accumulator registers a program as an unpaired BLOCK_N-row program;
    BLOCK_N rows of each would double the fp32 accumulators and cut occupancy);
    else gate and up are blocks of one pass and a second launch takes the product of the sums. TMA (TMA_PRE,
    TMA_LATE): the paired pass's weight tiles by TMA (`_stream`'s, batch 1)."""
    K = x.shape[-1]
    _weights([w_gate, w_up], K, x.dtype)
    if w_up.shape != w_gate.shape:
        raise ValueError(f"gate_up_swiglu: expected w_up {tuple(w_gate.shape)}, got {tuple(w_up.shape)}")
    I = w_gate.shape[0]
    x2 = _rows2(x, K, "x")
    M = x2.shape[0]
    y = torch.empty((M, I), device=x.device, dtype=x.dtype)
    _check_cfg(BLOCK_N, BLOCK_K, SPLIT_K)
    kw = dict(norm_w=norm_w, eps=eps, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, num_warps=num_warps,
              num_stages=num_stages, DOT=DOT, PREFETCH=PREFETCH, PDL=PDL, FMA_MAX_M=FMA_MAX_M,
              DOT_STAGES=DOT_STAGES)
    bk = _dot_tiles(BLOCK_N, BLOCK_K)[1] if _dot_path(M, DOT, FMA_MAX_M) else BLOCK_K  # the K tile _stream uses
    if M and paired and BLOCK_N >= 2 and _split_of(K, bk, SPLIT_K)[0] == 1:
        _stream(x2, [w_gate], direct_out=y, swiglu_up=w_up, **{**kw, "BLOCK_N": BLOCK_N // 2}, TMA=TMA,
                TMA_PRE=TMA_PRE, TMA_LATE=TMA_LATE)
    elif M:
        part, split = _stream(x2, [w_gate, w_up], **kw)
        blk = _reduce_block(I)
        launch(_swiglu_reduce_kernel, (M, triton.cdiv(I, blk)), (part, y, M, I, split, y.stride(0)),
               dict(ACT_DTYPE=_TL.get(x.dtype, tl.float32), RNE=interpreting(), BLOCK=blk,
                    PDL=pdl_on(PDL)), **pdl_launch(PDL))
    return y.reshape(*x.shape[:-1], I)


def qkv_norm_rope(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, cos: torch.Tensor | None,
                  sin: torch.Tensor | None, head_dim: int, *, q_norm_w: torch.Tensor | None = None,
                  k_norm_w: torch.Tensor | None = None, eps: float = 1e-6, norm_w: torch.Tensor | None = None,
                  norm_eps: float = 1e-6, BLOCK_N: int = 16, BLOCK_K: int = 512,
                  SPLIT_K: int = 1, num_warps: int = 4, num_stages: int = 1, DOT: bool = False,
                  PREFETCH: bool = False, PDL: bool = False,
                  FMA_MAX_M: int = MAX_FMA_M, DOT_STAGES: int = DOT_STAGES
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [..., K] (M rows), wq: [Hq * D, K], wk/wv: [Hkv * D, K], cos/sin: [..., D] (the token's rotary table,
    HF's position_embeddings) or None -> q [M, Hq, D], k [M, Hkv, D], v [M, Hkv, D] (views of one buffer), with
    the per-head q/k RMSNorms (Qwen3, eps) when q_norm_w/k_norm_w [D] are given and the rotary embedding when cos
    is; `norm_w` [K]: x RMSNorm'd (norm_eps) first inside the GEMV (a decoder layer's input_layernorm). Without
    the q/k norms, the rotary embedding and a K split, the pass writes q/k/v itself (one launch)."""
    K = x.shape[-1]
    _weights([wq, wk, wv], K, x.dtype)
    D = head_dim
    if D % 2 or wq.shape[0] % D or wk.shape[0] % D or wv.shape != wk.shape:
        raise ValueError(f"qkv_norm_rope: expected an even head_dim dividing wq {tuple(wq.shape)} and wk = wv "
                         f"{tuple(wk.shape)}, got head_dim {D}, wv {tuple(wv.shape)}")
    if (q_norm_w is None) != (k_norm_w is None) or (q_norm_w is not None and (q_norm_w.shape != (D,)
                                                                              or k_norm_w.shape != (D,))):
        raise ValueError(f"qkv_norm_rope: expected both q_norm_w and k_norm_w [{D}] or neither")
    x2 = _rows2(x, K, "x")
    M = x2.shape[0]
    hq, hkv = wq.shape[0] // D, wk.shape[0] // D
    c2 = s2 = None
    if cos is not None:
        c2, s2 = _rows2(cos, D, "cos"), _rows2(sin, D, "sin")
        if c2.shape[0] != M or s2.shape != c2.shape:
            raise ValueError(f"qkv_norm_rope: expected cos/sin [{M}, {D}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    ntot = (hq + 2 * hkv) * D
    y = torch.empty((M, ntot), device=x.device, dtype=x.dtype)
    plain = q_norm_w is None and c2 is None  # nothing per head after the projections
    if M:
        part, split = _stream(x2, [wq, wk, wv], norm_w=norm_w, eps=norm_eps, direct_out=y if plain else None,
                              BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, num_warps=num_warps,
                              num_stages=num_stages, DOT=DOT, PREFETCH=PREFETCH, PDL=PDL, FMA_MAX_M=FMA_MAX_M,
              DOT_STAGES=DOT_STAGES)
    if M and split:
        launch(_qkv_reduce_kernel, (M, hq + 2 * hkv), (
            part, y if c2 is None else c2, y if s2 is None else s2, y if q_norm_w is None else q_norm_w,
            y if k_norm_w is None else k_norm_w, y, M, hq, hkv, split, ntot,
            0 if c2 is None else c2.stride(0), 0 if s2 is None else s2.stride(0), y.stride(0), float(eps), D // 2),
            dict(HAS_NORM=q_norm_w is not None, HAS_ROPE=c2 is not None, ACT_DTYPE=_TL.get(x.dtype, tl.float32),
                 RNE=interpreting(), BLOCK_H=triton.next_power_of_2(D // 2), PDL=pdl_on(PDL)),
            num_warps=1, **pdl_launch(PDL))
    q = y[:, : hq * D].view(M, hq, D)
    k = y[:, hq * D: (hq + hkv) * D].view(M, hkv, D)
    v = y[:, (hq + hkv) * D:].view(M, hkv, D)
    return q, k, v


__all__ = ["CONFIG_SPACE", "DEFAULT", "gate_up_swiglu", "gate_up_swiglu_ref", "gemv", "gemv_ref",
           "gemv_residual_rmsnorm", "gemv_residual_rmsnorm_ref", "qkv_norm_rope", "qkv_norm_rope_ref"]
