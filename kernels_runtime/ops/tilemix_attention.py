"""TileMix: causal prefill flash-attention whose tile groups each take a 16-bit or an INT8 score path.

Every (query block, key block) tile of the score matrix is routed by a packed bitmask (`tilemix_masks.TileMask`,
one bit per tile group). A 16-bit tile computes S = Q K^T with a bf16/fp16 `tl.dot`; an INT8 tile computes it with
an int8 `tl.dot` accumulating in int32 on Q and K quantised symmetrically per block of `quant_block` tokens per head
(scale = max|x| / 127), dequantised by the two blocks' scales. Both feed one online-softmax state (log2 domain,
fp32), and P V stays in the 16-bit dtype. A mask with no INT8 bit compiles without the INT8 path (HAS_INT8) and is
this project's plain bf16 flash kernel: bit for bit `attention_prefill` at the same tile config under the
interpreter; on the GPU within one bf16 ulp of it (its fully visible tiles skip the causal `where`, which the
compiler contracts differently). All INT8 is uniform INT8 attention.

Sequences: a padded batch q [B, Hq, S, D] (optional `seq_lens`), or a packed varlen batch q [T, Hq, D] with
`cu_seqlens` [B + 1]; k, v alike with Hkv heads (GQA: Hq % Hkv == 0). Queries and keys of a sequence coincide
(self-attention prefill without a cached past). An INT8 KV cache goes in as k, v int8 with `k_scale`, `v_scale`
[B, Hkv, ceil(S / quant_block)] fp32: its 16-bit tiles and P V run on the dequantised values.

Work per program: one query block of one head. Its fully visible key blocks are visited through two lists built
from the mask (INT8 blocks, then 16-bit blocks, each ascending), so no routing branch sits in the pipelined loops;
the diagonal blocks follow, causally masked, each reading its bit from the packed mask. With TMA (the default on
sm_90+ for head_dim 65-128) the fully visible blocks' K, INT8 K and V tiles come by host-made TMA descriptors,
pipelined on mbarriers; the pointer path loads the same tiles with the same bits.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels_runtime.ops._common import interpreting
from kernels_runtime.ops.tilemix_masks import TileMask

# Tile configs tried per shape (tune=True); BLOCK_M must divide the mask's group_m and BLOCK_N its group_n. int8
# wgmma needs K (head_dim) a multiple of 32 and BLOCK_M a multiple of 64 per warpgroup (m64nNk32). Compiled for sm_90
# by Triton 3.9 at 0 % coverage, the pointer path loads its fully visible K/V tiles with plain global loads (no
# cp.async: the route index feeds their address); the TMA path's are bulk-tensor copies pipelined on mbarriers.
CONFIGS: list[dict] = [
    # K/V tiles by TMA (host-made descriptors; where TMA cannot run, the pointer path of the same tiles). At 16k
    # and 32k tokens, batch 8, qwen3-4b's heads, 128 x 128 in 3 stages was the fastest TMA point at
    # 75 and 100 % (level with 2 stages at 0 %), 1.23-1.30x the pointer path's 128 x 64 default; at 0 % the tuner
    # found the pointer path at 128 x 128 level with it: TMA pays where the INT8 path runs
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "TMA": True},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "TMA": True},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "TMA": True},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 4, "TMA": True},
    # K/V tiles by pointers (the default before TMA, and every GPU before sm_90)
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
]
POINTER_DEFAULT = CONFIGS[4]
QUANT_BLOCK = 128  # tokens per quantisation scale (per head), for Q and K alike; a multiple of BLOCK_N keeps the
# key scale one number per tile
# How the int32 scores become fp32: "magic" (integer add + exact subtract) or "cvt" (the conversion instruction)
INT8_DEQUANT = "magic"
_LOG2E = 1.4426950408889634
_MAX_GRID_Y = 65535
_TUNED: dict[tuple, dict] = {}
# Prompts longer than this share the tile config tuned at their first call (a 32k batch of 8 costs ~0.2 s a call,
# so tuning there costs seconds; past a few thousand tokens the kernel is compute-bound and the choice settles).
TUNE_MAX_TOKENS = 8192


@triton.jit
def _quantize_int8_kernel(
    # Pointers
    X, X8, XS, SEQ_START, SEQ_LEN,
    # Matrix dimensions
    H, D,
    # Strides
    stride_xb, stride_xh, stride_xs, stride_xd, stride_8b, stride_8h, stride_8s, stride_8d, stride_sb, stride_sh,
    # Meta-parameters
    QB: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one block of QB tokens of one head: scale = max|x| / 127 (1 for an all-zero block), x8 = round(x / scale)
    blk = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    b, h = pid // H, pid % H
    start, L = tl.load(SEQ_START + b).to(tl.int64), tl.load(SEQ_LEN + b)
    offs_s = blk * QB + tl.arange(0, QB)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_s[:, None] < L) & (offs_d[None, :] < D)
    x = tl.load(X + b * stride_xb + h * stride_xh + (start + offs_s[:, None]) * stride_xs + offs_d[None, :] * stride_xd,
                mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = tl.where(amax > 0, amax / 127.0, 1.0)
    y = x * (1.0 / scale)
    x8 = (y + tl.where(y >= 0, 0.5, -0.5)).to(tl.int8)  # round half away from zero (the cast truncates)
    tl.store(X8 + b * stride_8b + h * stride_8h + (start + offs_s[:, None]) * stride_8s + offs_d[None, :] * stride_8d,
             x8, mask=ok)
    if blk * QB < L:
        tl.store(XS + b * stride_sb + h * stride_sh + blk, scale)


@triton.jit
def _tile(acc, m_i, l_i, q, q8, qs, k_base, k8_base, v_base, ks_base, vs_base, dk, dk8, dv, kv_row, kv_col,
          start_n, offs_m, offs_d, L, D, qk_scale, stride_ks, stride_kd, stride_k8s, stride_k8d, stride_vs, stride_vd,
          INT8: tl.constexpr, MASKED: tl.constexpr, KV_INT8: tl.constexpr, QB: tl.constexpr,
          BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
          SCALAR_KS: tl.constexpr, MAGIC_CVT: tl.constexpr, DESC: tl.constexpr):
    # one key block into the online-softmax state (m_i, l_i, acc); scores in the log2 domain as raw * row (row: the
    # per-query-row factor that scales a raw score). DESC (a fully visible block of a 16-bit K/V, TMA on): K, K8 and
    # V come by their host-made descriptors at row kv_row + start_n, column kv_col
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kv_ok = offs_n < L
    mask_d = offs_d < D
    if KV_INT8 or (INT8 and not SCALAR_KS):
        ks = tl.load(ks_base + offs_n // QB, mask=kv_ok, other=0.0)  # [BLOCK_N] per-key (per-block) scales
    if INT8:
        if DESC:
            kt8 = dk8.load([kv_row + start_n, kv_col]).T
        else:
            kt8 = tl.load(k8_base + offs_n[None, :] * stride_k8s + offs_d[:, None] * stride_k8d,
                          mask=kv_ok[None, :] & mask_d[:, None], other=0)  # [BLOCK_D, BLOCK_N] int8
        if UPCAST_DOT:  # the interpreter's int8 dot: exact in fp32 (|sum| <= D * 127^2 < 2^24)
            s = tl.dot(q8.to(tl.float32), kt8.to(tl.float32), input_precision="ieee").to(tl.int32)
        else:
            s = tl.dot(q8, kt8, out_dtype=tl.int32)
        if MAGIC_CVT:  # |s| <= D * 127^2 < 2^22: 1.5 * 2^23 + s has s's float bits, and the subtraction is exact:
            # two full-rate ALU ops per score instead of an int->float conversion (I2FP)
            raw = (s + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        else:
            raw = s.to(tl.float32)
        if SCALAR_KS:  # BLOCK_N divides QB: one key scale per tile, folded into the per-row factor
            row = qs * (tl.load(ks_base + start_n // QB) * qk_scale)  # [BLOCK_M], > 0
        else:
            raw = raw * (qs[:, None] * (ks * qk_scale)[None, :])
            row = tl.full(offs_m.shape, 1.0, tl.float32)
    else:
        if DESC:
            kt = dk.load([kv_row + start_n, kv_col]).T
        elif KV_INT8:
            kt = tl.load(k8_base + offs_n[None, :] * stride_k8s + offs_d[:, None] * stride_k8d,
                         mask=kv_ok[None, :] & mask_d[:, None], other=0)
            kt = (kt.to(tl.float32) * ks[None, :]).to(q.dtype)
        else:
            kt = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                         mask=kv_ok[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        if UPCAST_DOT:
            kt = kt.to(tl.float32)
        raw = tl.dot(q, kt, input_precision=DOT_PRECISION)
        row = tl.full(offs_m.shape, qk_scale, tl.float32)
    if DESC:
        v = dv.load([kv_row + start_n, kv_col])
    else:
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                    mask=kv_ok[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    if KV_INT8:
        vsc = tl.load(vs_base + offs_n // QB, mask=kv_ok, other=0.0)
        v = (v.to(tl.float32) * vsc[:, None]).to(q.dtype)
    if UPCAST_DOT:
        v = v.to(tl.float32)
    if MASKED:
        qk = tl.where((offs_m[:, None] >= offs_n[None, :]) & kv_ok[None, :], raw * row[:, None], float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp2(qk - m_new[:, None])
    else:  # every score visible: the row factor is positive, so max(raw * row) = max(raw) * row (the same bits),
        # and the scale and the max's subtraction fuse into one FMA per score
        m_new = tl.maximum(m_i, tl.max(raw, axis=1) * row)
        p = tl.exp2(raw * row[:, None] - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _tilemix_attention_kernel(
    # Pointers
    Q, K, V, Q8, QS, K8, KS, VS, O, SEQ_START, SEQ_LEN, ROUTE_IDX, ROUTE_CNT, MASK, DK, DK8, DV,
    # Matrix dimensions
    Hq, Hkv, D, GROUP, qk_scale, n_m, n_n, mask_words, GROUP_M, GROUP_N, ROW_B, ROW_H, COL_H,
    # Strides
    stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd, stride_ob, stride_oh, stride_os, stride_od,
    stride_q8b, stride_q8h, stride_q8s, stride_q8d, stride_k8b, stride_k8h, stride_k8s, stride_k8d,
    stride_scb, stride_sch, stride_kscb, stride_ksch,
    # Meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, QB: tl.constexpr,
    HAS_INT8: tl.constexpr, KV_INT8: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SCALAR_KS: tl.constexpr, MAGIC_CVT: tl.constexpr, TMA: tl.constexpr,
):
    start_m = n_m - 1 - tl.program_id(0)  # the longest causal rows first
    pid = tl.program_id(1).to(tl.int64)
    b, hq = pid // Hq, pid % Hq
    hkv = hq // GROUP
    start, L = tl.load(SEQ_START + b).to(tl.int64), tl.load(SEQ_LEN + b)
    if start_m * BLOCK_M < L:
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = (offs_m[:, None] < L) & (offs_d[None, :] < D)
        q = tl.load(Q + b * stride_qb + hq * stride_qh + (start + offs_m[:, None]) * stride_qs
                    + offs_d[None, :] * stride_qd, mask=row_ok, other=0.0)  # [BLOCK_M, BLOCK_D]
        if UPCAST_DOT:
            q = q.to(tl.float32)
        q8 = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.int8)
        qs = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if HAS_INT8:
            q8 = tl.load(Q8 + b * stride_q8b + hq * stride_q8h + (start + offs_m[:, None]) * stride_q8s
                         + offs_d[None, :] * stride_q8d, mask=row_ok, other=0)
            qs = tl.load(QS + b * stride_scb + hq * stride_sch + offs_m // QB, mask=offs_m < L, other=0.0)
        k_base = K + b * stride_kb + hkv * stride_kh + start * stride_ks
        k8_base = K8 + b * stride_k8b + hkv * stride_k8h + start * stride_k8s
        v_base = V + b * stride_vb + hkv * stride_vh + start * stride_vs
        ks_base = KS + b * stride_kscb + hkv * stride_ksch
        vs_base = VS + b * stride_kscb + hkv * stride_ksch
        # TMA: the descriptors' coordinates of this sequence's key 0 (row) and of its kv head (column)
        kv_row = (b * ROW_B + hkv * ROW_H + start).to(tl.int32)
        kv_col = (hkv * COL_H).to(tl.int32)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        n8, n16 = tl.load(ROUTE_CNT + 2 * start_m), tl.load(ROUTE_CNT + 2 * start_m + 1)
        idx_row = ROUTE_IDX + start_m.to(tl.int64) * n_n
        if HAS_INT8:
            for t in range(0, n8):  # fully visible INT8 blocks
                acc, m_i, l_i = _tile(acc, m_i, l_i, q, q8, qs, k_base, k8_base, v_base, ks_base, vs_base,
                                      DK, DK8, DV, kv_row, kv_col, tl.load(idx_row + t) * BLOCK_N, offs_m, offs_d,
                                      L, D, qk_scale, stride_ks, stride_kd, stride_k8s, stride_k8d, stride_vs,
                                      stride_vd, True, False, KV_INT8, QB, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
                                      SCALAR_KS, MAGIC_CVT, TMA)
        for t in range(n8, n8 + n16):  # fully visible 16-bit blocks
            acc, m_i, l_i = _tile(acc, m_i, l_i, q, q8, qs, k_base, k8_base, v_base, ks_base, vs_base,
                                  DK, DK8, DV, kv_row, kv_col, tl.load(idx_row + t) * BLOCK_N, offs_m, offs_d,
                                  L, D, qk_scale, stride_ks, stride_kd, stride_k8s, stride_k8d, stride_vs,
                                  stride_vd, False, False, KV_INT8, QB, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
                                  SCALAR_KS, MAGIC_CVT, TMA)
        hi = tl.minimum((start_m + 1) * BLOCK_M, L)
        lo = (start_m * BLOCK_M) // BLOCK_N * BLOCK_N
        if HAS_INT8:
            for start_n in range(lo, hi, BLOCK_N):  # the diagonal, masked; its routing read from the packed mask
                col = start_n // GROUP_N
                word = tl.load(MASK + ((start_m * BLOCK_M) // GROUP_M) * mask_words + col // 32)
                if ((word >> (col % 32)) & 1) != 0:
                    acc, m_i, l_i = _tile(acc, m_i, l_i, q, q8, qs, k_base, k8_base, v_base, ks_base, vs_base,
                                          DK, DK8, DV, kv_row, kv_col, start_n, offs_m, offs_d, L, D, qk_scale,
                                          stride_ks, stride_kd, stride_k8s, stride_k8d, stride_vs, stride_vd,
                                          True, True, KV_INT8, QB, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
                                          SCALAR_KS, MAGIC_CVT, False)
                else:
                    acc, m_i, l_i = _tile(acc, m_i, l_i, q, q8, qs, k_base, k8_base, v_base, ks_base, vs_base,
                                          DK, DK8, DV, kv_row, kv_col, start_n, offs_m, offs_d, L, D, qk_scale,
                                          stride_ks, stride_kd, stride_k8s, stride_k8d, stride_vs, stride_vd,
                                          False, True, KV_INT8, QB, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
                                          SCALAR_KS, MAGIC_CVT, False)
        else:
            for start_n in range(lo, hi, BLOCK_N):  # the diagonal, masked
                acc, m_i, l_i = _tile(acc, m_i, l_i, q, q8, qs, k_base, k8_base, v_base, ks_base, vs_base,
                                      DK, DK8, DV, kv_row, kv_col, start_n, offs_m, offs_d, L, D, qk_scale,
                                      stride_ks, stride_kd, stride_k8s, stride_k8d, stride_vs, stride_vd,
                                      False, True, KV_INT8, QB, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
                                      SCALAR_KS, MAGIC_CVT, False)
        acc = acc / l_i[:, None]
        o_ptrs = (O + b * stride_ob + hq * stride_oh + (start + offs_m[:, None]) * stride_os
                  + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok)


def _quantize_ref(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [H, L, D] -> (int8 values as fp32 [H, L, D], fp32 scales [H, ceil(L / block)]): symmetric per block."""
    H, L, D = x.shape
    nb = -(-L // block)
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, nb * block - L)).view(H, nb, block, D)
    amax = xf.abs().amax(dim=(2, 3))
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    y = xf * (1.0 / scale)[:, :, None, None]
    x8 = torch.trunc(y + torch.where(y >= 0, 0.5, -0.5))
    return x8.view(H, nb * block, D)[:, :L], scale


def _sequences(x: torch.Tensor, cu_seqlens, seq_lens) -> list[torch.Tensor]:
    # each sequence as [H, L, D]
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist()
        return [x[a:b].transpose(0, 1) for a, b in zip(cu, cu[1:])]
    lens = seq_lens.tolist() if seq_lens is not None else [x.shape[2]] * x.shape[0]
    return [x[i, :, :n] for i, n in enumerate(lens)]


def tilemix_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: TileMask, scale: float | None = None, *,
    cu_seqlens: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, quant_block: int = QUANT_BLOCK,
) -> torch.Tensor:
    """As `tilemix_attention` (same layouts and arguments), in fp32 PyTorch: 16-bit tiles as fp32 products of the
    inputs, INT8 tiles as exact integer products of the quantised Q and K times their scales; the output in q's
    dtype (rows past a padded sequence's length are 0)."""
    D = q.shape[-1]
    scale = D**-0.5 if scale is None else scale
    out = torch.zeros_like(q)
    outs = _sequences(out, cu_seqlens, seq_lens)
    ks_list = [None] * len(outs) if k_scale is None else list(k_scale)
    vs_list = [None] * len(outs) if v_scale is None else list(v_scale)
    route = mask.unpack().cpu()
    for o, qb, kb, vb, ksb, vsb in zip(outs, _sequences(q, cu_seqlens, seq_lens), _sequences(k, cu_seqlens, seq_lens),
                                       _sequences(v, cu_seqlens, seq_lens), ks_list, vs_list):
        H, L, _ = qb.shape
        group = H // kb.shape[0]
        if k.dtype == torch.int8:  # INT8 KV cache: its own values and scales; 16-bit tiles see them dequantised
            k8, ks = kb.float(), ksb.float()
            kd = (k8 * ks.repeat_interleave(quant_block, 1)[:, :L, None]).to(q.dtype).float()
            vd = (vb.float() * vsb.float().repeat_interleave(quant_block, 1)[:, :L, None]).to(q.dtype).float()
        else:
            (k8, ks), kd, vd = _quantize_ref(kb, quant_block), kb.float(), vb.float()
        q8, qs = _quantize_ref(qb, quant_block)
        rep = lambda t: t.repeat_interleave(group, 0)  # noqa: E731 - GQA: kv head of each q head
        s16 = qb.float() @ rep(kd).transpose(1, 2)
        deq = qs.repeat_interleave(quant_block, 1)[:, :L, None] * rep(ks).repeat_interleave(quant_block, 1)[:, None, :L]
        s8 = (q8 @ rep(k8).transpose(1, 2)) * deq
        pos = torch.arange(L, device=q.device)
        r = route[pos.cpu() // mask.group_m][:, pos.cpu() // mask.group_n].to(q.device)
        s = torch.where(r, s8, s16) * scale
        s = s.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        o.copy_((torch.softmax(s, dim=-1) @ rep(vd)).to(q.dtype))
    return out


def quantize_int8(x: torch.Tensor, seq_start: torch.Tensor, seq_len: torch.Tensor, s_max: int,
                  block: int = QUANT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, S, D] (padded) or [T, H, D] (packed, with seq_start = cu_seqlens[:-1]) -> (int8 x in x's layout,
    fp32 scales [B, H, ceil(s_max / block)]): symmetric, one scale per block of `block` tokens per head."""
    x8 = torch.empty_like(x, dtype=torch.int8)
    B, H, D = seq_len.numel(), x.shape[-2 if x.dim() == 3 else 1], x.shape[-1]
    xs = torch.ones((B, H, triton.cdiv(s_max, block)), dtype=torch.float32, device=x.device)
    if x.numel():
        _quantize_int8_kernel[(triton.cdiv(s_max, block), B * H)](
            x, x8, xs, seq_start, seq_len, H, D, *_strides4(x), *_strides4(x8), xs.stride(0), xs.stride(1),
            QB=block, BLOCK_D=max(16, triton.next_power_of_2(D)),
        )
    return x8, xs


def _strides4(x: torch.Tensor) -> tuple[int, int, int, int]:
    # (batch, head, token, dim) strides of a padded [B, H, S, D] or a packed [T, H, D] tensor (batch stride 0)
    return tuple(x.stride()) if x.dim() == 4 else (0, x.stride(1), x.stride(0), x.stride(2))


def _routes(mask: TileMask, bm: int, bn: int, n_m: int, n_n: int, device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Per query block: its fully visible key blocks, INT8 ones then 16-bit ones (ascending), and their counts;
    built once per mask and tile config (the routing is static)."""
    key = (bm, bn, n_m, n_n, str(device))
    if key not in mask._routes:
        route = mask.unpack().to(device)
        t = route[torch.arange(n_m, device=device) * bm // mask.group_m][:, torch.arange(n_n, device=device) * bn
                                                                          // mask.group_n]
        i, j = torch.arange(n_m, device=device)[:, None], torch.arange(n_n, device=device)[None, :]
        interior = (j + 1) * bn <= i * bm
        order = torch.where(interior, torch.where(t, j, j + n_n), j + 2 * n_n)
        idx = (order.sort(dim=1).values % n_n).to(torch.int32).contiguous()
        cnt = torch.stack([(interior & t).sum(1), (interior & ~t).sum(1)], 1).to(torch.int32).contiguous()
        mask._routes[key] = (idx, cnt, bool(t.any()))
    return mask._routes[key]


@functools.lru_cache(maxsize=64)
def _padded_lengths(B: int, S: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts 0, lengths S), int32 [B], of a padded batch: the kernel only reads them, so one pair per shape and
    device serves every call (a model calls this once per layer with the same shape)."""
    return (torch.zeros(B, dtype=torch.int32, device=device),
            torch.full((B,), S, dtype=torch.int32, device=device))


def _device_bits(mask: TileMask, device: torch.device) -> torch.Tensor:
    """The mask's packed bits on `device`, copied there once per mask (a mask built on the host would otherwise
    be copied, synchronously, on every call)."""
    if mask.bits.device == device:
        return mask.bits
    key = ("bits", str(device))
    if key not in mask._routes:
        mask._routes[key] = mask.bits.to(device)
    return mask._routes[key]


def tma_ok(device: torch.device) -> bool:
    """Whether the TMA path can run on `device`: sm_90 or newer, or the interpreter (which emulates descriptors)."""
    return interpreting() or (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9)


def default_config(head_dim: int, device: torch.device | None = None) -> dict:
    """The tiles a call without explicit ones runs: CONFIGS[0] (TMA) for head_dim 65-128 where TMA runs, the
    pointer path's default where it does not or for head_dim > 128 (TMA's three-stage 128 x 128 buffers would
    overflow shared memory), small tiles for head_dim <= 64."""
    if head_dim <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    if head_dim <= 128 and device is not None and tma_ok(device):
        return dict(CONFIGS[0])
    return dict(POINTER_DEFAULT)


def _check(q, k, v, mask, cu_seqlens, seq_lens, k_scale, v_scale) -> tuple[int, int]:
    """-> (batch, longest sequence); raises ValueError naming what was expected and what was got."""
    packed = cu_seqlens is not None
    if q.dim() != (3 if packed else 4) or k.dim() != q.dim() or v.shape != k.shape:
        raise ValueError(f"tilemix_attention: expected q {'[T, Hq, D]' if packed else '[B, Hq, S, D]'} and k, v of "
                         f"one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    hq, hkv = (q.shape[1], k.shape[1])
    tok = 0 if packed else 2
    if hkv == 0 or hq % hkv or k.shape[-1] != q.shape[-1] or k.shape[tok] != q.shape[tok] or \
            (not packed and k.shape[0] != q.shape[0]):
        raise ValueError(f"tilemix_attention: expected k, v with Hkv dividing {hq}, q's tokens and head_dim, got "
                         f"{tuple(k.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or v.dtype != k.dtype or \
            (k.dtype != q.dtype and k.dtype != torch.int8):
        raise ValueError(f"tilemix_attention: expected q 16/32-bit and k, v of q's dtype or int8, got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    if (k.dtype == torch.int8) != (k_scale is not None and v_scale is not None):
        raise ValueError("tilemix_attention: expected k_scale and v_scale exactly when k and v are int8")
    if packed and seq_lens is not None:
        raise ValueError("tilemix_attention: expected cu_seqlens (packed) or seq_lens (padded), got both")
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]) if packed else seq_lens
    B = lens.numel() if lens is not None else q.shape[0]
    s_max = int(lens.max()) if lens is not None and B else (q.shape[2] if not packed else 0)
    if not packed and s_max > q.shape[2]:
        raise ValueError(f"tilemix_attention: expected seq_lens <= S = {q.shape[2]}, got max {s_max}")
    if mask.n_rows * mask.group_m < s_max or mask.n_cols * mask.group_n < s_max:
        raise ValueError(f"tilemix_attention: expected a mask covering {s_max} tokens, got "
                         f"{mask.n_rows} x {mask.n_cols} groups of {mask.group_m} x {mask.group_n}")
    if B * hq > _MAX_GRID_Y:
        raise ValueError(f"tilemix_attention: expected B * Hq <= {_MAX_GRID_Y}, got {B * hq}")
    if q.shape[-1] > 256:  # int32 scores must stay below 2^22 (D * 127^2) for the exact fp32 conversion
        raise ValueError(f"tilemix_attention: expected head_dim <= 256, got {q.shape[-1]}")
    return B, s_max


def tilemix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: TileMask, scale: float | None = None, *,
    cu_seqlens: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    k_quant: tuple[torch.Tensor, torch.Tensor] | None = None, quant_block: int = QUANT_BLOCK, tune: bool = False,
    BLOCK_M: int | None = None, BLOCK_N: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, TMA: bool | None = None,
) -> torch.Tensor:
    """Causal self-attention over q [B, Hq, S, D] (k, v [B, Hkv, S, D]; optional seq_lens [B]) or packed q
    [T, Hq, D] (k, v [T, Hkv, D]) with cu_seqlens [B + 1], routed per tile group by `mask` -> output in q's layout
    and dtype (rows past a padded sequence's length are 0). k, v int8 take k_scale, v_scale [B, Hkv,
    ceil(S / quant_block)]; `k_quant` = (k int8, scales) supplies the INT8 copy of 16-bit K (else computed here).
    tune=True times CONFIGS on the first call of each shape and routing density and keeps the fastest. TMA: the
    fully visible K/V tiles by host-made TMA descriptors (16-bit K/V whose layout `_tma_rows` maps; else pointers,
    the same bits)."""
    B, s_max = _check(q, k, v, mask, cu_seqlens, seq_lens, k_scale, v_scale)
    packed, dev = cu_seqlens is not None, q.device
    kv_int8 = k.dtype == torch.int8
    if packed:
        seq_start, seq_len = cu_seqlens[:-1].to(torch.int32), (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
    else:
        seq_start, seq_len = _padded_lengths(B, q.shape[2], dev)
        seq_len = seq_lens.to(torch.int32) if seq_lens is not None else seq_len
    o = torch.zeros_like(q) if seq_lens is not None else torch.empty_like(q)
    if q.numel() == 0 or s_max == 0:
        return o
    explicit = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "num_warps": num_warps, "num_stages": num_stages,
                "TMA": TMA}
    base = default_config(q.shape[-1], q.device)
    cfg = {kk: vv if vv is not None else base.get(kk, False) for kk, vv in explicit.items()}
    args = (q, k, v, mask, scale, seq_start, seq_len, s_max, B, k_scale, v_scale, k_quant, quant_block, kv_int8)
    if tune and not interpreting() and all(vv is None for vv in explicit.values()):
        cfg = _tuned(args, o)
    _launch(*args, o, cfg)
    return o


class _TmaRows(NamedTuple):
    """A [B, H, S, D] or [T, H, D] tensor as the 2-D matrix a TMA descriptor walks: token t of (batch b, head h) at
    row b * row_b + h * row_h + t, its D values from column h * col_h."""

    stride: int  # elements from one row to the next
    rows: int
    cols: int
    row_b: int
    row_h: int
    col_h: int


def _tma_rows(x: torch.Tensor, B: int, S: int) -> _TmaRows | None:
    """x [B, H, S, D] (padded) or [T, H, D] (packed; B = 1, S = T) as TMA rows. Two layouts fit: tokens as rows with
    the heads side by side along them (the model's [B, S, H, D] transposed, or packed), or one head's tokens after
    another (contiguous [B, H, S, D]). None where neither fits or TMA's alignment (16 bytes) does not hold."""
    sb, sh, ss, sd = _strides4(x)
    H, D, es = x.shape[-2 if x.dim() == 3 else 1], x.shape[-1], x.element_size()
    if sd != 1 or x.data_ptr() % 16 or (D * es) % 16:
        return None
    if sh < ss and (H - 1) * sh + D <= ss and sb % ss == 0:  # tokens as rows, heads along a row
        stride, row_b, row_h, col_h, cols = ss, sb // ss, 0, sh, (H - 1) * sh + D
    elif ss == D and sh % D == 0 and sb % D == 0 and sh >= S * D:  # each head's tokens one after another
        stride, row_b, row_h, col_h, cols = D, sb // D, sh // D, 0, D
    else:
        return None
    if (stride * es) % 16:
        return None
    return _TmaRows(stride, (B - 1) * row_b + (H - 1) * row_h + S, cols, row_b, row_h, col_h)


def _descriptors(k, v, k8, B, S, bn, D):
    """(DK, DK8, DV, ROW_B, ROW_H, COL_H): host-made TMA descriptors of K, its INT8 copy and V ([bn, D] boxes) when
    all three map to the same rows and columns, else Nones (the kernel then loads every tile by pointers)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    lays = [_tma_rows(t, B, S) for t in (k, k8, v)]
    if any(lay is None for lay in lays) or len({lay[3:] for lay in lays}) > 1:
        return None, None, None, 0, 0, 0
    descs = [TensorDescriptor(t, [lay.rows, lay.cols], [lay.stride, 1], [bn, D]) for t, lay in zip((k, k8, v), lays)]
    return (*descs, *lays[0][3:])


def _launch(q, k, v, mask, scale, seq_start, seq_len, s_max, B, k_scale, v_scale, k_quant, quant_block, kv_int8,
            o, cfg) -> None:
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if mask.group_m % bm or mask.group_n % bn:
        raise ValueError(f"tilemix_attention: expected BLOCK_M | {mask.group_m} and BLOCK_N | {mask.group_n} "
                         f"(the mask's tile group), got {bm}, {bn}")
    n_m, n_n = triton.cdiv(s_max, bm), triton.cdiv(s_max, bn)
    idx, cnt, has8 = _routes(mask, bm, bn, n_m, n_n, q.device)
    bits = _device_bits(mask, q.device)
    hq, hkv, D = q.shape[-2 if q.dim() == 3 else 1], k.shape[-2 if k.dim() == 3 else 1], q.shape[-1]
    if kv_int8:
        k8, ks, vs = k, k_scale, v_scale
    elif has8:
        k8, ks = k_quant if k_quant is not None else quantize_int8(k, seq_start, seq_len, s_max, quant_block)
        vs = ks
    else:
        k8, ks, vs = k, q, q  # unused: the kernel has no INT8 path
    q8, qs = quantize_int8(q, seq_start, seq_len, s_max, quant_block) if has8 else (q, q)
    ks_strides = (ks.stride(0), ks.stride(1)) if ks.dim() == 3 else (0, 0)
    qs_strides = (qs.stride(0), qs.stride(1)) if qs.dim() == 3 else (0, 0)
    scale = D**-0.5 if scale is None else scale
    block_d = max(32 if has8 else 16, triton.next_power_of_2(D))  # an int8 dot needs K >= 32
    tma = bool(cfg.get("TMA")) and not kv_int8 and block_d == D and tma_ok(q.device)
    desc = (_descriptors(k, v, k8, 1 if q.dim() == 3 else B, k.shape[0 if q.dim() == 3 else 2], bn, D) if tma
            else (None, None, None, 0, 0, 0))
    tma = desc[0] is not None
    _tilemix_attention_kernel[(n_m, B * hq)](
        q, k, v, q8, qs, k8, ks, vs, o, seq_start, seq_len, idx, cnt, bits, *desc[:3],
        hq, hkv, D, hq // hkv, scale * _LOG2E, n_m, n_n, bits.shape[1], mask.group_m, mask.group_n, *desc[3:],
        *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(o), *_strides4(q8), *_strides4(k8),
        *qs_strides, *ks_strides,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, QB=quant_block,
        HAS_INT8=has8, KV_INT8=kv_int8, UPCAST_DOT=interpreting(), SCALAR_KS=quant_block % bn == 0,
        MAGIC_CVT=INT8_DEQUANT == "magic",
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        TMA=tma,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def _tuned(args, o) -> dict:
    """The fastest of CONFIGS (fitting the mask's group) for this shape and routing density, timed once."""
    q, k, mask, s_max, B = args[0], args[1], args[3], args[7], args[8]
    cov = mask.coverage if mask.coverage is not None else 0.5
    density = "none" if cov == 0 else "all" if cov == 1 else "mixed"
    key = (B, q.shape[-2 if q.dim() == 3 else 1], k.shape[-2 if k.dim() == 3 else 1], q.shape[-1],
           min(s_max, TUNE_MAX_TOKENS), q.dtype, k.dtype, mask.group_m, mask.group_n, density)
    if key not in _TUNED:
        fits = [c for c in CONFIGS if mask.group_m % c["BLOCK_M"] == 0 and mask.group_n % c["BLOCK_N"] == 0]
        times = {}
        for i, c in enumerate(fits):
            try:
                times[i] = triton.testing.do_bench(lambda c=c: _launch(*args, o, c), warmup=5, rep=20)
            except Exception:  # noqa: BLE001 - a config that does not fit (shared memory, registers) is skipped
                continue
        if not times:
            raise RuntimeError(f"tilemix_attention: no config of CONFIGS ran for {key}")
        _TUNED[key] = fits[min(times, key=times.get)]
    return _TUNED[key]
