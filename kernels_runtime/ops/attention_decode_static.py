"""Decode attention over transformers' static KV cache: one kernel from the raw q/k/v projections to the attention
output, replayable from a CUDA graph.

For one new token per sequence, stage 1 (one program per (batch, kv head, split)):
- loads the GROUP query heads of its kv head as one [BLOCK_G, D] tile (GQA: K/V are read once per group, never
  repeated to Hq heads), applies Qwen3's per-head RMSNorm (`q_norm`/`k_norm`, optional) and the rotary embedding
  to q and to the new k, as HF's attention forward does before `cache.update`;
- reads the write position `pos` from device memory (StaticLayer.cumulative_length, the length before this token:
  HF's `StaticLayer.update` writes at it, then advances it), writes the rotated k and the raw v at `pos` of the
  preallocated caches IN PLACE (the split that holds `pos` writes; every read of that slot takes the new value, so
  no program depends on the order of the write and the reads);
- attends over [lo, pos], lo = max(0, pos - sliding_window + 1) (HF's sliding mask: kv > q - window), with optional
  logit soft-capping (Gemma-2: cap * tanh(s / cap)), and writes the split's normalized partial output and
  log-sum-exp (fp32);
- with a key mask (padded batches: `kv_mask[b, j]` nonzero where row b attends key j, e.g. the decode row of the
  4-D mask HF builds for the static cache, left padding's zeros on the pad positions), excludes every masked key.
  The mask is read from device memory by the kernel, so a graph replayed with new mask values stays valid. A row
  whose keys are all masked gets zeros, as SDPA gives (with left padding the decode query always sees itself).
Stage 2 merges the splits per query head and advances the length by one (program 0), as `StaticLayer.update` does.
With one split (the batch's KV heads alone fill the GPU, or a one-tile cache) stage 1 writes the output itself and a
one-program kernel advances the length instead (a one-split layer on qwen3-4b lost 9-16 us a layer).

The grid is sized for the whole cache (S_max), never for the current length: splits past `pos` or below the window
write an empty partial (lse -inf). Nothing reads the length on the host, so every pointer and the grid are the same
at every step and one captured graph serves every length. A `pos` at or past S_max writes nothing, attends to the
whole cache and does not advance (never out of bounds).
Not autotuned: it writes the cache and the length in place, so a re-run by an autotuner would corrupt them; the
search tunes BLOCK_N / splits / warps by hand (CONFIG_SPACE).
Partial rotary (cos/sin narrower than the head, R < D): the first R columns rotate, the rest pass through.
Rotary positions need nothing here: the caller's cos/sin are per row ([B, 1, R]), as HF's position_ids
(cumsum(mask) - 1 under left padding) make them.
Limits: one write position for the whole batch (padding is expressed by the key mask, as HF's static cache does);
an even head_dim.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_runtime.hardware import target_programs
from kernels_runtime.ops._common import (TIMELINE, interpreting, l2_prefetch, l2_prefetch_on, pdl_launch, pdl_on,
                                         pdl_wait, rnd, stamp, timeline_rows)
from kernels_runtime.ops._common import l2_prefetch_bytes as _l2_bytes  # the launcher's argument takes the name

CONFIG_SPACE: dict[str, list] = {
    "BLOCK_N": [16, 32, 64, 128],
    "num_splits": [None, 4, 8, 16, 32, 64],  # None: `default_num_splits`
    "num_warps": [2, 4, 8],
    "num_stages": [1, 2, 3],
}
_LOG2E = 1.4426950408889634
TARGET_PROGRAMS = target_programs()  # a few waves on the target GPU's SMs (kernels_runtime.hardware)
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows; smaller query groups are padded


@triton.jit
def _norm_rope(x, x_rot, w, w_r, sign, cos, sin, eps, D, HAS_NORM: tl.constexpr, DTYPE: tl.constexpr):
    # x, x_rot: fp32 [..., BLOCK_D] (x_rot = x at the rotate_half partner column); w, w_r: the norm weight at the
    # columns and at their partners (fp32); HF's roundings to DTYPE
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=-1) / D + eps)
        x = rnd(w * rnd(x * tl.expand_dims(rstd, -1), DTYPE), DTYPE)
        x_rot = rnd(w_r * rnd(x_rot * tl.expand_dims(rstd, -1), DTYPE), DTYPE)
    return rnd(rnd(x * cos, DTYPE) + rnd(sign * x_rot * sin, DTYPE), DTYPE)


@triton.jit
def _attention_decode_static_kernel(
    # Pointers
    Q, K_NEW, V_NEW, K, V, COS, SIN, QW, KW, LEN, O_PART, LSE_PART, PF, O, TS, KV_MASK,
    # Matrix dimensions
    PF_BYTES, Hkv, S_MAX, SPLIT_LEN, NUM_SPLITS, GROUP, D, ROT, qk_scale, eps, window, softcap,
    # Strides
    stride_qb, stride_qh, stride_qd,
    stride_knb, stride_knh, stride_knd,
    stride_vnb, stride_vnh, stride_vnd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_cb, stride_sb,
    stride_ob, stride_oh, stride_od,
    stride_mb, stride_mk,
    # Meta-parameters
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_MASK: tl.constexpr,
    DTYPE: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    L2PF: tl.constexpr = False, LANES: tl.constexpr = 128, DIRECT_OUT: tl.constexpr = False,
    TIMELINE: tl.constexpr = False,
):
    # DIRECT_OUT (one split: the program covers [lo, pos] whole): the normalized output goes to O in its dtype, no
    # partials and no merge
    pid_bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    pid_ts = pid_bh * NUM_SPLITS + split  # TIMELINE's row
    stamp(TS, pid_ts, 0, TIMELINE)
    b, hkv = pid_bh // Hkv, pid_bh % Hkv
    offs_g, offs_d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    mask_g, mask_d = offs_g < GROUP, offs_d < D
    # What no kernel of this step writes before this one: the length (advanced by the last step's merge) and the
    # cache below it. The first K/V tile is loaded before waiting on the previous kernel (PDL), the rest one tile
    # ahead; the slot at `pos` is read stale and replaced by the new token's k/v below.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    k_base = K + b * stride_kb + hkv * stride_kh
    v_base = V + b * stride_vb + hkv * stride_vh
    pos = tl.load(LEN).to(tl.int32)  # the write position: the length before this token
    kv_end = tl.minimum(pos + 1, S_MAX)
    s_start = split * SPLIT_LEN
    s_end = tl.minimum(s_start + SPLIT_LEN, kv_end)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    start = tl.maximum(s_start, (lo // BLOCK_N) * BLOCK_N)  # whole tiles below the window are skipped
    offs_n = start + tl.arange(0, BLOCK_N)
    kv_ok = (offs_n < s_end) & (offs_n >= lo)
    m_base = KV_MASK + b * stride_mb
    # The pad keys are neither loaded nor attended. A tile's key mask is loaded two tiles ahead of its use and its
    # K/V one tile ahead, so no K/V load waits on a mask load in the loop (each tile had cost two round trips).
    pad_cur = kv_ok
    pad_nxt = kv_ok
    if HAS_MASK:
        pad_cur = tl.load(m_base + offs_n * stride_mk, mask=kv_ok, other=0) != 0
        kv_ok &= pad_cur
        offs_n1 = offs_n + BLOCK_N
        pad_nxt = tl.load(m_base + offs_n1 * stride_mk, mask=(offs_n1 < s_end) & (offs_n1 >= lo), other=0) != 0
    kt_nxt = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd,  # [BLOCK_D, BLOCK_N]
                     mask=kv_ok[None, :] & mask_d[:, None], other=0.0)
    v_nxt = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,  # [BLOCK_N, BLOCK_D]
                    mask=kv_ok[:, None] & mask_d[None, :], other=0.0)
    # the first ROT columns rotate (partial rotary: ROT < D); the others pass through as x * 1 + x * 0, exact
    half = ROT // 2
    offs_r = tl.where(offs_d < half, offs_d + half, tl.where(offs_d < ROT, offs_d - half, offs_d))  # the partner
    sign = tl.where(offs_d < half, -1.0, 1.0)
    # the rotary table and the q/k norm weights are no kernel's output in this step either: loaded before the wait
    cos = tl.load(COS + b * stride_cb + offs_d, mask=offs_d < ROT, other=1.0).to(tl.float32)
    sin = tl.load(SIN + b * stride_sb + offs_d, mask=offs_d < ROT, other=0.0).to(tl.float32)
    if HAS_NORM:
        qw = tl.load(QW + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        qw_r = tl.load(QW + offs_r, mask=mask_d, other=0.0).to(tl.float32)
        kw = tl.load(KW + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        kw_r = tl.load(KW + offs_r, mask=mask_d, other=0.0).to(tl.float32)
    else:
        qw, qw_r, kw, kw_r = cos, cos, cos, cos  # unused
    if L2PF:  # the next kernel's weights (o_proj) into L2 while this latency-bound kernel leaves HBM idle
        l2_prefetch(PF, PF_BYTES, pid_bh * NUM_SPLITS + split, tl.num_programs(0) * NUM_SPLITS, LANES)
    if PDL:
        tl.extra.cuda.gdc_wait()  # q/k/v are the previous kernel's output
    stamp(TS, pid_ts, 1, TIMELINE)

    hq = hkv * GROUP + offs_g
    q_rows = Q + b * stride_qb + hq[:, None] * stride_qh
    mask_q = mask_g[:, None] & mask_d[None, :]
    # every read of the previous kernel's output issued at once (one L2 round trip), then the arithmetic
    q = tl.load(q_rows + offs_d[None, :] * stride_qd, mask=mask_q, other=0.0).to(tl.float32)  # [BLOCK_G, BLOCK_D]
    q_r = tl.load(q_rows + offs_r[None, :] * stride_qd, mask=mask_q, other=0.0).to(tl.float32)
    kn_row = K_NEW + b * stride_knb + hkv * stride_knh
    k_new = tl.load(kn_row + offs_d * stride_knd, mask=mask_d, other=0.0).to(tl.float32)  # [BLOCK_D]
    k_new_r = tl.load(kn_row + offs_r * stride_knd, mask=mask_d, other=0.0).to(tl.float32)
    v_new = tl.load(V_NEW + b * stride_vnb + hkv * stride_vnh + offs_d * stride_vnd, mask=mask_d, other=0.0)
    q = _norm_rope(q, q_r, qw, qw_r, sign, cos, sin, eps, D, HAS_NORM, DTYPE)
    k_new = _norm_rope(k_new, k_new_r, kw, kw_r, sign, cos, sin, eps, D, HAS_NORM, DTYPE).to(DTYPE)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    else:
        q = q.to(DTYPE)

    if (pos >= s_start) & (pos < s_end):
        tl.store(k_base + pos * stride_ks + offs_d * stride_kd, k_new, mask=mask_d)
        tl.store(v_base + pos * stride_vs + offs_d * stride_vd, v_new, mask=mask_d)

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for start_n in range(start, s_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_ok = (offs_n < s_end) & (offs_n >= lo)
        if HAS_MASK:
            kv_ok &= pad_cur
        kt, v = kt_nxt, v_nxt
        offs_nn = offs_n + BLOCK_N  # the next tile (an empty mask past the split)
        nn_ok = (offs_nn < s_end) & (offs_nn >= lo)
        if HAS_MASK:
            nn_ok &= pad_nxt  # loaded a tile ago
            offs_n2 = offs_nn + BLOCK_N  # the mask of the tile after: used by the next iteration's K/V loads
            pad_cur = pad_nxt
            pad_nxt = tl.load(m_base + offs_n2 * stride_mk, mask=(offs_n2 < s_end) & (offs_n2 >= lo), other=0) != 0
        kt_nxt = tl.load(k_base + offs_nn[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                         mask=nn_ok[None, :] & mask_d[:, None], other=0.0)
        v_nxt = tl.load(v_base + offs_nn[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                        mask=nn_ok[:, None] & mask_d[None, :], other=0.0)
        is_new = offs_n == pos
        kt = tl.where(is_new[None, :], k_new[:, None], kt)
        v = tl.where(is_new[:, None], v_new[None, :], v)
        if UPCAST_DOT:
            kt, v = kt.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
        if HAS_SOFTCAP:  # cap * tanh(s * scale / cap), tanh from exp (exact enough, no libdevice)
            t = tl.exp(-2.0 * tl.abs(s * qk_scale / softcap))
            s = softcap * tl.where(s >= 0, 1.0, -1.0) * (1.0 - t) / (1.0 + t) * 1.4426950408889634
        else:
            s = s * (qk_scale * 1.4426950408889634)  # log2 domain
        s = tl.where(kv_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of pad keys only: no -inf - -inf
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    some = l_i > 0
    if DIRECT_OUT:
        out = acc / tl.where(some, l_i, 1.0)[:, None]
        tl.store(O + b * stride_ob + hq[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(O.dtype.element_ty), mask=mask_q)
    else:
        rows = (b * Hkv * GROUP + hq) * NUM_SPLITS + split  # [BLOCK_G] into [B, Hq, NUM_SPLITS]
        tl.store(O_PART + rows[:, None] * D + offs_d[None, :], acc / tl.where(some, l_i, 1.0)[:, None], mask=mask_q)
        tl.store(LSE_PART + rows, tl.where(some, m_i + tl.log2(tl.where(some, l_i, 1.0)), float("-inf")),
                 mask=mask_g)
    stamp(TS, pid_ts, 2, TIMELINE)


@triton.jit
def _merge_advance_kernel(
    # Pointers
    O_PART, LSE_PART, O, LEN, TS,
    # Matrix dimensions
    Hq, NUM_SPLITS, D, S_MAX,
    # Strides
    stride_ob, stride_oh, stride_od,
    # Meta-parameters
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ADVANCE: tl.constexpr, PDL: tl.constexpr = False,
    TIMELINE: tl.constexpr = False,
):
    pid = tl.program_id(0).to(tl.int64)  # b * Hq + h
    stamp(TS, pid, 0, TIMELINE)
    pdl_wait(PDL)
    stamp(TS, pid, 1, TIMELINE)
    offs_s, offs_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    lse = tl.load(LSE_PART + pid * NUM_SPLITS + offs_s, mask=mask_s, other=float("-inf"))  # [BLOCK_S]
    top = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # every split empty (all keys masked): w = 0
    o = tl.load(O_PART + (pid * NUM_SPLITS + offs_s)[:, None] * D + offs_d[None, :],
                mask=mask_s[:, None] & (offs_d[None, :] < D), other=0.0)  # [BLOCK_S, BLOCK_D]
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    b, h = pid // Hq, pid % Hq
    tl.store(O + b * stride_ob + h * stride_oh + offs_d * stride_od, out.to(O.dtype.element_ty), mask=offs_d < D)
    if ADVANCE:  # StaticLayer.update's cumulative_length.add_(1); stage 1 has finished reading it
        if pid == 0:
            n = tl.load(LEN)
            tl.store(LEN, tl.where(n < S_MAX, n + 1, n))
    stamp(TS, pid, 2, TIMELINE)


@triton.jit
def _advance_kernel(LEN, S_MAX, PDL: tl.constexpr = False):
    # StaticLayer.update's cumulative_length.add_(1), after stage 1 (one split, DIRECT_OUT) finished reading it
    pdl_wait(PDL)
    n = tl.load(LEN)
    tl.store(LEN, tl.where(n < S_MAX, n + 1, n))


def attention_decode_static_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cache_len: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float, *,
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
    sliding_window: int | None = None, softcap: float | None = None, kv_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q: [B, Hq, 1, D], k/v: [B, Hkv, 1, D] (projections, before norm and rotary), k_cache/v_cache: [B, Hkv, S_max, D]
    holding `cache_len` (one-element int tensor) positions, cos/sin: [B, 1, R] (R <= D: partial rotary, the last
    D - R columns pass through), kv_mask: [B, S_max] (nonzero: row b attends key j; None: every key up to the
    length)
    -> (out [B, Hq, 1, D], k_cache_out, v_cache_out, cache_len + 1), as HF's attention forward over a StaticLayer
    computes them (norms, rotary, `update`, SDPA over K/V repeated to Hq heads with the causal/sliding mask and the
    key mask; a row with every key masked gets zeros, as SDPA gives).
    Does not modify its inputs."""
    from kernels_runtime.ops.rotary import qk_norm_rotary_ref, rotary_ref

    if q_norm_weight is not None:
        q, k = qk_norm_rotary_ref(q, k, cos, sin, q_norm_weight, k_norm_weight, eps)
    else:
        q, k = rotary_ref(q, k, cos, sin)
    pos = int(cache_len.reshape(-1)[0])
    k_out, v_out = k_cache.clone(), v_cache.clone()
    k_out[:, :, pos], v_out[:, :, pos] = k[:, :, 0], v[:, :, 0]
    lo = max(0, pos - sliding_window + 1) if sliding_window else 0
    group = q.shape[1] // k_cache.shape[1]
    kk = k_out[:, :, lo:pos + 1].repeat_interleave(group, dim=1)
    vv = v_out[:, :, lo:pos + 1].repeat_interleave(group, dim=1)
    s = (q @ kk.transpose(-1, -2)) * scale  # [B, Hq, 1, L]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.float()
    if kv_mask is not None:
        s = s.masked_fill(kv_mask[:, None, None, lo:pos + 1] == 0, float("-inf"))
    out = torch.softmax(s, dim=-1).nan_to_num(0.0).to(q.dtype) @ vv
    return out, k_out, v_out, cache_len + 1


def default_num_splits(batch_kv_heads: int, s_max: int, block_n: int) -> int:
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, batch_kv_heads), triton.cdiv(s_max, block_n)))


def _check(q, k, v, k_cache, v_cache, cache_len, cos, sin, norms) -> None:
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape or q.shape[2] != 1:
        raise ValueError(f"attention_decode_static: expected q [B, Hq, 1, D], caches [B, Hkv, S_max, D], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    B, Hq, _, D = q.shape
    Hkv = k_cache.shape[1]
    if k_cache.shape[0] != B or k_cache.shape[3] != D or Hkv == 0 or Hq % Hkv or D % 2:
        raise ValueError(f"attention_decode_static: expected caches [{B}, Hkv dividing {Hq}, S_max, {D}] and an "
                         f"even head dim, got {tuple(k_cache.shape)}")
    R = cos.shape[-1]
    if not 0 < R <= D or R % 2:
        raise ValueError(f"attention_decode_static: expected cos/sin [B, 1, R] with R even, 0 < R <= {D}, got "
                         f"{tuple(cos.shape)}")
    for name, t, shape in (("k", k, (B, Hkv, 1, D)), ("v", v, (B, Hkv, 1, D)), ("cos", cos, (B, 1, R)),
                           ("sin", sin, (B, 1, R)), ("k_cache", k_cache, k_cache.shape),
                           ("v_cache", v_cache, k_cache.shape),
                           *((n, w, (D,)) for n, w in norms if w is not None)):
        if tuple(t.shape) != tuple(shape) or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"attention_decode_static: expected {name} {tuple(shape)} {q.dtype} on {q.device}, "
                             f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    if cos.stride(2) != 1 or sin.stride(2) != 1:
        raise ValueError("attention_decode_static: expected cos/sin contiguous in the head dim")
    if (not isinstance(cache_len, torch.Tensor) or cache_len.numel() != 1 or cache_len.is_floating_point()
            or cache_len.device != q.device):
        raise ValueError(f"attention_decode_static: expected cache_len a one-element integer tensor on {q.device} "
                         f"(StaticLayer.cumulative_length), got {cache_len!r}")


def _check_mask(kv_mask: torch.Tensor, batch: int, s_max: int, device: torch.device) -> None:
    if (kv_mask.dim() != 2 or tuple(kv_mask.shape) != (batch, s_max) or kv_mask.is_floating_point()
            or kv_mask.is_complex() or kv_mask.device != device):
        raise ValueError(f"attention_decode_static: expected kv_mask a [{batch}, {s_max}] bool or integer tensor on "
                         f"{device} (nonzero: attend), got {tuple(kv_mask.shape)} {kv_mask.dtype} on "
                         f"{kv_mask.device}")


def attention_decode_static(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cache_len: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float, *,
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
    sliding_window: int | None = None, softcap: float | None = None, kv_mask: torch.Tensor | None = None,
    advance: bool = True, BLOCK_N: int = 64, num_splits: int | None = None, num_warps: int = 4, num_stages: int = 2, PDL: bool = False,
    l2_prefetch: torch.Tensor | None = None, l2_prefetch_bytes: int | None = None,
) -> torch.Tensor:
    """`attention_decode_static_ref`'s computation, with the caches written and (advance) `cache_len` advanced IN
    PLACE; returns out [B, Hq, 1, D] in q's dtype. q/k/v may be strided views (HF's transposed projections), and so
    may kv_mask [B, S_max] (the decode row of HF's [B, 1, 1, S_max] static-cache mask, no copy).
    PDL: both kernels launched with programmatic dependent launch: stage 1 reads the length and its first K/V tile,
    then waits for the previous kernel (the q/k/v projections); stage 2 waits first.
    l2_prefetch: a tensor the next kernel reads (o_proj's weight), whose first `l2_prefetch_bytes` (all of it when
    None) stage 1's programs ask the L2 for while they run (sm_90+; nothing under the interpreter). A hint: the
    results do not depend on it."""
    norms = (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight))
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("attention_decode_static: expected both q_norm_weight and k_norm_weight, or neither")
    _check(q, k, v, k_cache, v_cache, cache_len, cos, sin, norms)
    B, Hq, _, D = q.shape
    Hkv, s_max = k_cache.shape[1], k_cache.shape[2]
    if kv_mask is not None:
        _check_mask(kv_mask, B, s_max, q.device)
        kv_mask = kv_mask.view(torch.uint8) if kv_mask.dtype == torch.bool else kv_mask
    n_splits = num_splits or default_num_splits(B * Hkv, s_max, BLOCK_N)
    split_len = triton.cdiv(triton.cdiv(s_max, n_splits), BLOCK_N) * BLOCK_N
    n_splits = triton.cdiv(s_max, split_len)
    direct = n_splits == 1  # one program per (batch, kv head) covers the whole cache: it writes o, nothing to merge
    o = torch.empty((B, Hq, 1, D), dtype=q.dtype, device=q.device)
    o_part = o if direct else torch.empty((B, Hq, n_splits, D), dtype=torch.float32, device=q.device)
    lse_part = o if direct else torch.empty((B, Hq, n_splits), dtype=torch.float32, device=q.device)
    has_norm = q_norm_weight is not None
    block_d = max(16, triton.next_power_of_2(D))
    length = cache_len.reshape(1)
    pf_bytes = _l2_bytes(l2_prefetch, l2_prefetch_bytes, "attention_decode_static")
    ts = None if TIMELINE["buf"] is None else timeline_rows("attention", B * Hkv * n_splits)
    _attention_decode_static_kernel[(B * Hkv, n_splits)](
        q, k, v, k_cache, v_cache, cos, sin, q_norm_weight if has_norm else q, k_norm_weight if has_norm else q,
        length, o_part, lse_part, l2_prefetch if pf_bytes else q, o, q if ts is None else ts,
        length if kv_mask is None else kv_mask,
        pf_bytes, Hkv, s_max, split_len, n_splits, Hq // Hkv, D, cos.shape[-1], scale, eps, int(sliding_window or 0),
        float(softcap or 1.0),
        q.stride(0), q.stride(1), q.stride(3), k.stride(0), k.stride(1), k.stride(3),
        v.stride(0), v.stride(1), v.stride(3), *k_cache.stride(), *v_cache.stride(), cos.stride(0), sin.stride(0),
        o.stride(0), o.stride(1), o.stride(3), *(kv_mask.stride() if kv_mask is not None else (0, 0)), BLOCK_G=max(MIN_DOT_ROWS, triton.next_power_of_2(Hq // Hkv)), BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        HAS_NORM=has_norm, HAS_WINDOW=bool(sliding_window), HAS_SOFTCAP=bool(softcap), HAS_MASK=kv_mask is not None,
        DTYPE=_tl_dtype(q.dtype), UPCAST_DOT=interpreting(),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
        PDL=pdl_on(PDL), L2PF=l2_prefetch_on(pf_bytes), LANES=32 * num_warps, DIRECT_OUT=direct,
        TIMELINE=ts is not None, **pdl_launch(PDL),
    )
    if direct:
        if advance:
            _advance_kernel[(1,)](length, s_max, PDL=pdl_on(PDL), num_warps=1, **pdl_launch(PDL))
        return o
    ts = None if TIMELINE["buf"] is None else timeline_rows("merge", B * Hq)
    _merge_advance_kernel[(B * Hq,)](
        o_part, lse_part, o, length, q if ts is None else ts, Hq, n_splits, D, s_max, o.stride(0), o.stride(1),
        o.stride(3), BLOCK_S=triton.next_power_of_2(n_splits), BLOCK_D=block_d, ADVANCE=advance, num_warps=4,
        PDL=pdl_on(PDL), TIMELINE=ts is not None, **pdl_launch(PDL),
    )
    return o


def _tl_dtype(dtype: torch.dtype):
    from kernels_runtime.ops._common import _TL

    return _TL[dtype]
