"""The weight-streaming GEMV kernel behind kernels_runtime.ops.gemv: `_gemv_kernel` (register FMA or tl.dot
tiles, 1-3 weights side by side, split-K partials or the output itself, the norm prologue, PDL and L2 prefetch),
the rows and tiles it takes, and the checks on them. kernels_runtime/ops/gemv.py launches it (`_stream`) and is
the public module: import from there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_runtime.ops._common import cast_out, gate_act, l2_prefetch, l2_prefetch_bytes, rms_scale, rnd, stamp

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
# would stop it; at 1 stage the pass is latency-bound (2-3x slower; docs/hardware.md names the measurement).
DOT_STAGES = 4


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
    TIMELINE: tl.constexpr = False, GELU: tl.constexpr = False, GEMMA: tl.constexpr = False,
):
    # GELU: SWIGLU's activation is GELU's tanh form (Gemma's MLP); GEMMA: the prologue norm is Gemma's (1 + w).
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
        if PRO_NORM:  # HF's RMSNorm: weight * (x * rstd).to(dtype), rounded again (GEMMA: rms_scale's)
            nw = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            x = rms_scale(x, rstd[:, None], nw[None, :], GEMMA, ACT_DTYPE)
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
    if SWIGLU:  # LlamaMLP's roundings: each projection, silu (GELU: gelu-tanh), then the product
        act = gate_act(rnd(out, ACT_DTYPE), GELU, ACT_DTYPE)
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
def _row_norm_kernel(x_ptr, nw_ptr, y_ptr, K, stride_xm, stride_ym, eps, GEMMA: tl.constexpr,
                     ACT_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    # One program a row: y = HF's RMSNorm of x (rms_scale: the prologue's roundings, so the GEMV that reads y computes
    # what its PRO_NORM prologue would), for a GEMV of several rows a program (`_stream`'s NORM_PASS): its programs
    # then stream weights against y instead of each summing and scaling the rows tile by tile.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ss = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        xs = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=(k0 + offs) < K, other=0.0).to(tl.float32)
        ss += xs * xs
    rstd = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    for k0 in range(0, K, BLOCK):
        ok = (k0 + offs) < K
        xs = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + k0 + offs, rms_scale(xs, rstd, w, GEMMA, ACT_DTYPE).to(
            y_ptr.dtype.element_ty), mask=ok)


def _check_cfg(BLOCK_N, BLOCK_K, SPLIT_K):
    for name, v in (("BLOCK_N", BLOCK_N), ("BLOCK_K", BLOCK_K)):
        if not (isinstance(v, int) and v >= 1 and v & (v - 1) == 0):
            raise ValueError(f"gemv: expected {name} a power of two, got {v!r}")
    if not (isinstance(SPLIT_K, int) and SPLIT_K >= 1):
        raise ValueError(f"gemv: expected SPLIT_K an int >= 1, got {SPLIT_K!r}")


def _check_rows(FMA_MAX_M) -> None:
    if not (isinstance(FMA_MAX_M, int) and 0 <= FMA_MAX_M <= MAX_FMA_M):
        raise ValueError(f"gemv: expected FMA_MAX_M an int in 0..{MAX_FMA_M}, got {FMA_MAX_M!r}")


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


def _norm_row(pro_norm: bool, block_m: int, K: int) -> int:
    """The norm prologue's one-load width (the row padded to a power of two) for one row up to 8192 wide (32 fp32
    registers a thread at 4 warps for 4096); 0: the per-tile loop."""
    width = triton.next_power_of_2(K)
    return width if pro_norm and block_m == 1 and width <= 8192 else 0


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
