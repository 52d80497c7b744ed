"""Split-KV flash-decoding for one new token per sequence, with grouped-query attention.

Stage 1 gives each (batch, kv head, split) one program: it loads the GROUP query heads that share the kv head as one
[BLOCK_G, D] tile (padded to 16 rows for tl.dot), so each K/V tile is read once per group, and writes the split's
normalized partial output and log-sum-exp (fp32). Stage 2 merges the splits per query head.

Two entry points:
- `attention_decode`: the caller has already appended the new token's k/v (as HF's DynamicCache does); the query
  attends to the first `kv_len` cache positions (default: all of them).
- `attention_decode_update`: fused cache update for a preallocated cache. It writes `k_new`/`v_new` into
  position `cache_len` of `k_cache`/`v_cache` IN PLACE and attends to positions 0..cache_len. Because it writes
  state, it is tuned by hand (CONFIGS are for `attention_decode`), never autotuned: a re-run would rewrite the cache.
  `cache_len` may also be a one-element int tensor on the device (transformers' `StaticLayer.cumulative_length`):
  then the kernel reads it, the grid is sized for the whole cache, splits past the length write nothing to the
  result, and no host sync happens, so one CUDA graph serves every length. A length at or past the cache's end
  writes nothing (never out of bounds) and attends to the whole cache.
Padded batches: both take `kv_mask` [B, S_kv] (nonzero: row b attends key j), the decode row of HF's 4-D mask
(left padding's zeros on the pad keys), read by the kernel; a row with every key masked gets zeros, as SDPA gives.
Limits: one `kv_len`/`cache_len` for the whole batch (per-row padding through the key mask); with a host int the
grid depends on it, so a CUDA graph captured at one length is not valid at another (use the device-tensor form).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_runtime.hardware import target_programs
from kernels_runtime.ops._common import interpreting

CONFIG_SPACE: dict[str, list] = {
    "BLOCK_N": [16, 32, 64, 128],
    "num_splits": [None, 1, 2, 4, 8, 16, 32],  # None: `default_num_splits`
    "num_warps": [2, 4, 8],
    "num_stages": [1, 2, 3],
}
CONFIGS: list[dict] = [
    {"BLOCK_N": bn, "num_splits": None, "num_warps": w, "num_stages": s}
    for bn in CONFIG_SPACE["BLOCK_N"] for w in CONFIG_SPACE["num_warps"] for s in CONFIG_SPACE["num_stages"]
]
_LOG2E = 1.4426950408889634
# Aim for a few waves of programs on the target GPU's SMs (kernels_runtime.hardware); a split never goes below one
# BLOCK_N tile.
TARGET_PROGRAMS = target_programs()
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows; smaller query groups are padded


@triton.jit
def _attention_decode_kernel(
    # Pointers
    Q, K, V, K_NEW, V_NEW, O_PART, LSE_PART, LEN_PTR, KV_MASK,
    # Matrix dimensions
    Hkv, KV_LEN, SPLIT_LEN, NUM_SPLITS, GROUP, D, qk_scale,
    # Strides
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_knb, stride_knh, stride_knd,
    stride_vnb, stride_vnh, stride_vnd,
    stride_mb, stride_mk,
    # Meta-parameters
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NEW_KV: tl.constexpr,
    DEVICE_LEN: tl.constexpr,
    HAS_MASK: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b, hkv = pid_bh // Hkv, pid_bh % Hkv
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g, mask_d = offs_g < GROUP, offs_d < D
    hq = hkv * GROUP + offs_g
    q_ptrs = Q + b * stride_qb + hq[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if UPCAST_DOT:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + hkv * stride_kh
    v_base = V + b * stride_vb + hkv * stride_vh
    S_MAX = KV_LEN
    if DEVICE_LEN:  # KV_LEN is the cache's size; the valid length is on the device (no host sync, graph-safe)
        new_pos = tl.load(LEN_PTR).to(tl.int32)
        KV_LEN = tl.minimum(new_pos + 1, S_MAX) if HAS_NEW_KV else tl.minimum(new_pos, S_MAX)
    else:
        new_pos = KV_LEN - 1
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, KV_LEN)
    if HAS_NEW_KV:
        # The split that holds the new position writes it; every read of that slot is replaced by the new value,
        # so no program depends on the order of the write and the reads. A position past the cache is not written.
        k_new = tl.load(K_NEW + b * stride_knb + hkv * stride_knh + offs_d * stride_knd, mask=mask_d, other=0.0)
        v_new = tl.load(V_NEW + b * stride_vnb + hkv * stride_vnh + offs_d * stride_vnd, mask=mask_d, other=0.0)
        if (new_pos >= start) & (new_pos < end):
            tl.store(k_base + new_pos * stride_ks + offs_d * stride_kd, k_new, mask=mask_d)
            tl.store(v_base + new_pos * stride_vs + offs_d * stride_vd, v_new, mask=mask_d)

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_ok = offs_n < end
        if HAS_MASK:  # the row's pad keys: neither loaded nor attended
            kv_ok &= tl.load(KV_MASK + b * stride_mb + offs_n * stride_mk, mask=kv_ok, other=0) != 0
        kt = tl.load(  # [BLOCK_D, BLOCK_N]
            k_base + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd,
            mask=kv_ok[None, :] & mask_d[:, None], other=0.0,
        )
        v = tl.load(  # [BLOCK_N, BLOCK_D]
            v_base + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
            mask=kv_ok[:, None] & mask_d[None, :], other=0.0,
        )
        if HAS_NEW_KV:
            is_new = offs_n == new_pos
            kt = tl.where(is_new[None, :], k_new[:, None], kt)
            v = tl.where(is_new[:, None], v_new[None, :], v)
        if UPCAST_DOT:
            kt, v = kt.to(tl.float32), v.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N], log2 domain
        qk = tl.where(kv_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of pad keys only: no -inf - -inf
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    # With a host length no split is empty (the launcher sizes them); with a device length the splits past it are,
    # and write a zero partial with weight zero (lse -inf) for the merge.
    rows = (b * Hkv * GROUP + hq) * NUM_SPLITS + split  # [BLOCK_G] into [B, Hq, NUM_SPLITS]
    some = l_i > 0
    tl.store(O_PART + rows[:, None] * D + offs_d[None, :], acc / tl.where(some, l_i, 1.0)[:, None],
             mask=mask_g[:, None] & mask_d[None, :])
    tl.store(LSE_PART + rows, tl.where(some, m_i + tl.log2(tl.where(some, l_i, 1.0)), float("-inf")), mask=mask_g)


@triton.jit
def _attention_decode_reduce_kernel(
    # Pointers
    O_PART, LSE_PART, O,
    # Matrix dimensions
    Hq, NUM_SPLITS, D,
    # Strides
    stride_ob, stride_oh, stride_od,
    # Meta-parameters
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # b * Hq + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    lse = tl.load(LSE_PART + pid * NUM_SPLITS + offs_s, mask=mask_s, other=float("-inf"))  # [BLOCK_S]
    top = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # every split empty (all keys masked): w = 0
    o_ptrs = O_PART + (pid * NUM_SPLITS + offs_s)[:, None] * D + offs_d[None, :]
    o = tl.load(o_ptrs, mask=mask_s[:, None] & (offs_d[None, :] < D), other=0.0)  # [BLOCK_S, BLOCK_D]
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    b, h = pid // Hq, pid % Hq
    tl.store(O + b * stride_ob + h * stride_oh + offs_d * stride_od, out.to(O.dtype.element_ty), mask=offs_d < D)


def attention_decode_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float | None = None, kv_len: int | None = None,
    kv_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, Hq, 1, D], k_cache/v_cache: [B, Hkv, S_kv, D], attend to the first kv_len (default S_kv) positions,
    kv_mask [B, S_kv] (nonzero: attend; None: every key) -> [B, Hq, 1, D]. SDPA over K/V repeated to Hq heads with
    the mask, as transformers 5.17's default attention does (zeros on a row with every key masked)."""
    kv_len = k_cache.shape[2] if kv_len is None else kv_len
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache[:, :, :kv_len].repeat_interleave(group, dim=1)
    v = v_cache[:, :, :kv_len].repeat_interleave(group, dim=1)
    mask = None if kv_mask is None else (kv_mask[:, None, None, :kv_len] != 0)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def attention_decode_update_ref(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cache_len: int, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q: [B, Hq, 1, D], k_new/v_new: [B, Hkv, 1, D], k_cache/v_cache: [B, Hkv, S_max, D] holding cache_len valid
    positions -> (out [B, Hq, 1, D], k_cache_out, v_cache_out) with the new token at position cache_len.
    Does not modify its inputs."""
    k_out, v_out = k_cache.clone(), v_cache.clone()
    k_out[:, :, cache_len], v_out[:, :, cache_len] = k_new[:, :, 0], v_new[:, :, 0]
    return attention_decode_ref(q, k_out, v_out, scale, cache_len + 1), k_out, v_out


def default_num_splits(batch_kv_heads: int, kv_len: int, block_n: int) -> int:
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, batch_kv_heads), triton.cdiv(kv_len, block_n)))


def _check(q, k_cache, v_cache, kv_len) -> None:
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"attention_decode: expected q [B, Hq, 1, D], caches [B, Hkv, S, D], "
            f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    B, Hq, S_q, D = q.shape
    if S_q != 1:
        raise ValueError(f"attention_decode: expected q_len == 1 (decode), got q_len == {S_q}; use attention_prefill")
    if k_cache.shape[0] != B or k_cache.shape[3] != D or k_cache.shape[1] == 0 or Hq % k_cache.shape[1]:
        raise ValueError(
            f"attention_decode: expected caches [{B}, Hkv dividing {Hq}, S, {D}], got {tuple(k_cache.shape)}"
        )
    if not 1 <= kv_len <= k_cache.shape[2]:
        raise ValueError(f"attention_decode: expected 1 <= kv_len <= {k_cache.shape[2]}, got {kv_len}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"attention_decode: expected {name} {q.dtype} on {q.device}, got {t.dtype} on {t.device}")


def _mask_arg(kv_mask: torch.Tensor | None, q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor | None:
    """The key mask as the kernel reads it (bool viewed as bytes, no copy), after checking it."""
    if kv_mask is None:
        return None
    want = (q.shape[0], k_cache.shape[2])
    if tuple(kv_mask.shape) != want or kv_mask.is_floating_point() or kv_mask.device != q.device:
        raise ValueError(f"attention_decode: expected kv_mask a {list(want)} bool or integer tensor on {q.device}, "
                         f"got {tuple(kv_mask.shape)} {kv_mask.dtype} on {kv_mask.device}")
    return kv_mask.view(torch.uint8) if kv_mask.dtype == torch.bool else kv_mask


def _launch(q, k_cache, v_cache, k_new, v_new, kv_len, scale, BLOCK_N, num_splits, num_warps, num_stages,
            len_tensor=None, kv_mask=None):
    """kv_len: the attended length, or with `len_tensor` (the device-side cache length) the cache's size."""
    B, Hq, _, D = q.shape
    Hkv = k_cache.shape[1]
    n_splits = num_splits or default_num_splits(B * Hkv, kv_len, BLOCK_N)
    split_len = triton.cdiv(triton.cdiv(kv_len, n_splits), BLOCK_N) * BLOCK_N
    n_splits = triton.cdiv(kv_len, split_len)  # after rounding to whole tiles, no split is empty
    o_part = torch.empty((B, Hq, n_splits, D), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, Hq, n_splits), dtype=torch.float32, device=q.device)
    o = torch.empty((B, Hq, 1, D), dtype=q.dtype, device=q.device)
    has_new = k_new is not None
    kn, vn = (k_new, v_new) if has_new else (k_cache, v_cache)
    block_d = max(16, triton.next_power_of_2(D))
    _attention_decode_kernel[(B * Hkv, n_splits)](
        q, k_cache, v_cache, kn, vn, o_part, lse_part, len_tensor if len_tensor is not None else o_part,
        o_part if kv_mask is None else kv_mask,
        Hkv, kv_len, split_len, n_splits, Hq // Hkv, D, (D**-0.5 if scale is None else scale) * _LOG2E,
        q.stride(0), q.stride(1), q.stride(3), *k_cache.stride(), *v_cache.stride(),
        kn.stride(0), kn.stride(1), kn.stride(3), vn.stride(0), vn.stride(1), vn.stride(3),
        *(kv_mask.stride() if kv_mask is not None else (0, 0)), BLOCK_G=max(MIN_DOT_ROWS, triton.next_power_of_2(Hq // Hkv)), BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        HAS_NEW_KV=has_new, DEVICE_LEN=len_tensor is not None, HAS_MASK=kv_mask is not None,
        UPCAST_DOT=interpreting(),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    _attention_decode_reduce_kernel[(B * Hq,)](
        o_part, lse_part, o, Hq, n_splits, D, o.stride(0), o.stride(1), o.stride(3),
        BLOCK_S=triton.next_power_of_2(n_splits), BLOCK_D=block_d, num_warps=4,
    )
    return o


def attention_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float | None = None, *,
    kv_len: int | None = None, kv_mask: torch.Tensor | None = None, BLOCK_N: int = 64, num_splits: int | None = None,
    num_warps: int = 4, num_stages: int = 2,
) -> torch.Tensor:
    """q: [B, Hq, 1, D], k_cache/v_cache: [B, Hkv, S_kv, D] already holding the new token (any strides),
    attend to the first kv_len (default S_kv) positions that kv_mask [B, S_kv] (any strides, None: all) lets each
    row see, scale (default D**-0.5) -> [B, Hq, 1, D] in q's dtype."""
    kv_len = k_cache.shape[2] if kv_len is None else kv_len
    _check(q, k_cache, v_cache, kv_len)
    kv_mask = _mask_arg(kv_mask, q, k_cache)
    return _launch(q, k_cache, v_cache, None, None, kv_len, scale, BLOCK_N, num_splits, num_warps, num_stages,
                   kv_mask=kv_mask)


def attention_decode_update(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cache_len: int | torch.Tensor, scale: float | None = None, *, kv_mask: torch.Tensor | None = None,
    BLOCK_N: int = 64, num_splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
) -> torch.Tensor:
    """q: [B, Hq, 1, D], k_new/v_new: [B, Hkv, 1, D], k_cache/v_cache: [B, Hkv, S_max, D] preallocated with
    cache_len valid positions. Writes k_new/v_new at position cache_len of the caches IN PLACE and returns
    attention over positions 0..cache_len -> [B, Hq, 1, D]. cache_len as a one-element integer tensor on the
    caches' device is read by the kernel (no host sync; one CUDA graph for every length; it is not advanced here).
    kv_mask [B, S_max] (None: every key): the keys each row attends, as `attention_decode`."""
    device_len = isinstance(cache_len, torch.Tensor)
    if device_len:
        if cache_len.numel() != 1 or cache_len.is_floating_point() or cache_len.device != k_cache.device:
            raise ValueError(f"attention_decode_update: expected cache_len an int or a one-element integer tensor on "
                             f"{k_cache.device}, got {cache_len.dtype} {tuple(cache_len.shape)} on {cache_len.device}")
        _check(q, k_cache, v_cache, k_cache.shape[2])
    else:
        if not 0 <= cache_len < k_cache.shape[2]:
            raise ValueError(f"attention_decode_update: expected 0 <= cache_len < {k_cache.shape[2]}, got {cache_len}")
        _check(q, k_cache, v_cache, cache_len + 1)
    Hkv, D = k_cache.shape[1], k_cache.shape[3]
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if t.shape != (q.shape[0], Hkv, 1, D) or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"attention_decode_update: expected {name} ({q.shape[0]}, {Hkv}, 1, {D}) {q.dtype}, "
                f"got {tuple(t.shape)} {t.dtype}"
            )
    kv_mask = _mask_arg(kv_mask, q, k_cache)
    if device_len:
        return _launch(q, k_cache, v_cache, k_new, v_new, k_cache.shape[2], scale, BLOCK_N, num_splits, num_warps,
                       num_stages, len_tensor=cache_len.reshape(1), kv_mask=kv_mask)
    return _launch(q, k_cache, v_cache, k_new, v_new, cache_len + 1, scale, BLOCK_N, num_splits, num_warps, num_stages,
                   kv_mask=kv_mask)
