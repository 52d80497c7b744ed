"""Causal flash-attention forward for prefill, with grouped-query attention (Hq a multiple of Hkv).

The reference is what transformers 5.17 runs by default (`attn_implementation="sdpa"`): SDPA over K/V repeated to
Hq heads, causal. Queries are aligned to the end of the keys (query i sits at position S_kv - S_q + i), so a
prefill that extends a cache (S_kv > S_q) is covered too. One new token (S_q == 1) is decode and is rejected:
`attention_decode` splits the KV sequence instead, which a one-row query tile here would not.
Sliding-window attention (Mistral, Gemma-2's sliding layers; `sliding_window` W): query i sees keys j with
0 <= i + S_kv - S_q - j < W, HF's sliding causal mask (kv > q - W); the KV tiles wholly below the window are skipped.
Distances are taken between cache indices, so a sliding cache that holds only the last W - 1 positions before the
new ones (DynamicSlidingWindowLayer) is covered too.
Padded batches: `kv_mask` [B, S_kv] (nonzero: row b's key j is a real token) excludes the pad keys of each row, on
top of the causal mask. HF builds its 4-D mask as exactly that (masking_utils: the causal mask AND the 2-D
padding mask at the key), so its last query row, a strided view, is the key mask (no window: with one the last row
is windowed too). A query row that sees no key (a left pad's own row) gets zeros, as SDPA gives.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_runtime.ops._common import interpreting

CONFIG_SPACE: dict[str, list] = {
    "BLOCK_M": [64, 128],
    "BLOCK_N": [32, 64, 128],
    "num_warps": [4, 8],
    "num_stages": [2, 3, 4],
}
CONFIGS: list[dict] = [
    {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}
    for bm in CONFIG_SPACE["BLOCK_M"] for bn in CONFIG_SPACE["BLOCK_N"]
    for w in CONFIG_SPACE["num_warps"] for s in CONFIG_SPACE["num_stages"]
]
_LOG2E = 1.4426950408889634
_MAX_GRID_Y = 65535  # CUDA limit on grid axis 1, which carries B * Hq


@triton.jit
def _attention_prefill_kernel(
    # Pointers
    Q, K, V, O, KV_MASK,
    # Matrix dimensions
    Hq, S_q, S_kv, D, GROUP, qk_scale, window,
    # Strides
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_mb, stride_mk,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b, hq = pid_bh // Hq, pid_bh % Hq
    hkv = hq // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q_ptrs = Q + b * stride_qb + hq * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < S_q) & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST_DOT:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + hkv * stride_kh
    v_base = V + b * stride_vb + hkv * stride_vh
    offset = S_kv - S_q  # query row i may see keys 0..i + offset; key 0 is always visible, so no row is empty
    # (with a window: keys i + offset - W + 1..i + offset; the row's own key is always visible)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    hi = tl.minimum(S_kv, (start_m + 1) * BLOCK_M + offset)
    lo = 0
    if HAS_WINDOW:  # the first tile that holds a key inside the window of the tile's first row
        lo = (tl.maximum(start_m * BLOCK_M + offset - window + 1, 0) // BLOCK_N) * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_ok = offs_n < S_kv
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
        if UPCAST_DOT:
            kt, v = kt.to(tl.float32), v.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
        visible = (offs_m[:, None] + offset >= offs_n[None, :]) & kv_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (offs_m[:, None] + offset - offs_n[None, :] < window)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = m_new
        if HAS_WINDOW or HAS_MASK:  # a row may have seen no key yet (its window starts further on, its keys so
            # far are pads): no -inf - -inf
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    if HAS_WINDOW or HAS_MASK:  # rows past S_q, or a pad's own row, may see no key at all: zeros, no 0 / 0
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_i[:, None]
    o_ptrs = O + b * stride_ob + hq * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=(offs_m[:, None] < S_q) & mask_d[None, :])


def attention_prefill_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
    sliding_window: int | None = None, kv_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, Hq, S_q, D], k/v: [B, Hkv, S_kv, D] (S_kv >= S_q, queries at the last S_q positions),
    scale (default D**-0.5), sliding_window W (query i sees the W keys up to its own), kv_mask [B, S_kv] (nonzero:
    a real key; None: every key) -> causal attention output [B, Hq, S_q, D] (zeros on a row that sees no key)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s_q, s_kv = q.shape[2], k.shape[2]
    if s_q == s_kv and not sliding_window and kv_mask is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    rows = torch.arange(s_q, device=q.device)[:, None] + (s_kv - s_q)
    cols = torch.arange(s_kv, device=q.device)[None, :]
    mask = rows >= cols  # [S_q, S_kv], True = attend
    if sliding_window:
        mask &= rows - cols < sliding_window
    if kv_mask is not None:
        mask = mask & (kv_mask != 0)[:, None, None, :]  # [B, 1, S_q, S_kv]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def default_config(head_dim: int) -> dict:
    return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8 if head_dim > 64 else 4, "num_stages": 3}


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"attention_prefill: expected q [B, Hq, S, D], k and v [B, Hkv, S, D], "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, Hq, S_q, D = q.shape
    if S_q == 1:
        raise ValueError("attention_prefill: expected q_len > 1 (prefill), got q_len == 1; use attention_decode")
    if k.shape[0] != B or k.shape[3] != D or k.shape[1] == 0 or Hq % k.shape[1]:
        raise ValueError(f"attention_prefill: expected k [{B}, Hkv dividing {Hq}, S, {D}], got {tuple(k.shape)}")
    if B * Hq > _MAX_GRID_Y:
        raise ValueError(f"attention_prefill: expected B * Hq <= {_MAX_GRID_Y} (grid axis 1), got {B * Hq}")
    if k.shape[2] < S_q:
        raise ValueError(f"attention_prefill: expected S_kv >= S_q = {S_q}, got {k.shape[2]}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"attention_prefill: expected {name} {q.dtype} on {q.device}, got {t.dtype} on {t.device}")


def _mask_arg(kv_mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """The key mask as the kernel reads it (bool viewed as bytes, no copy), after checking it."""
    if kv_mask is None:
        return None
    if tuple(kv_mask.shape) != (q.shape[0], k.shape[2]) or kv_mask.is_floating_point() or kv_mask.device != q.device:
        raise ValueError(f"attention_prefill: expected kv_mask a [{q.shape[0]}, {k.shape[2]}] bool or integer tensor "
                         f"on {q.device}, got {tuple(kv_mask.shape)} {kv_mask.dtype} on {kv_mask.device}")
    return kv_mask.view(torch.uint8) if kv_mask.dtype == torch.bool else kv_mask


def attention_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
    sliding_window: int | None = None, kv_mask: torch.Tensor | None = None,
    BLOCK_M: int | None = None, BLOCK_N: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> torch.Tensor:
    """q: [B, Hq, S_q, D] (S_q > 1), k/v: [B, Hkv, S_kv, D] with Hq % Hkv == 0 and S_kv >= S_q (any strides),
    scale (default D**-0.5), sliding_window W >= 1 (None: full causal), kv_mask [B, S_kv] bool or integer (any
    strides; nonzero: a real key, None: every key) -> causal attention output [B, Hq, S_q, D], contiguous, q's
    dtype."""
    _check(q, k, v)
    kv_mask = _mask_arg(kv_mask, q, k)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"attention_prefill: expected sliding_window >= 1 or None, got {sliding_window}")
    B, Hq, S_q, D = q.shape
    cfg = default_config(D)
    bm, bn = BLOCK_M or cfg["BLOCK_M"], BLOCK_N or cfg["BLOCK_N"]
    o = torch.empty((B, Hq, S_q, D), dtype=q.dtype, device=q.device)
    if o.numel() == 0:
        return o
    scale = D**-0.5 if scale is None else scale
    _attention_prefill_kernel[(triton.cdiv(S_q, bm), B * Hq)](
        q, k, v, o, o if kv_mask is None else kv_mask,
        Hq, S_q, k.shape[2], D, Hq // k.shape[1], scale * _LOG2E, sliding_window or 0,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *(kv_mask.stride() if kv_mask is not None else (0, 0)),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(16, triton.next_power_of_2(D)),
        HAS_WINDOW=sliding_window is not None, HAS_MASK=kv_mask is not None, UPCAST_DOT=interpreting(),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )
    return o


_ZERO_MASKS: dict = {}  # (prompt length, device) -> the routing with no INT8 tile


def tma_applies(q: torch.Tensor, k: torch.Tensor, sliding_window: int | None = None) -> bool:
    """Whether `attention_prefill_tma` takes this call: a prompt without a past (S_q == S_kv > 1), no window,
    16-bit, head_dim <= 128 (its three-stage 128 x 128 tiles fit shared memory up to there)."""
    return (q.dim() == 4 and k.dim() == 4 and q.shape[2] == k.shape[2] > 1 and not sliding_window
            and q.element_size() == 2 and q.shape[-1] <= 128)


def attention_prefill_tma(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
    BLOCK_M: int = 128, BLOCK_N: int = 128, num_warps: int = 8, num_stages: int = 3,
) -> torch.Tensor:
    """Causal self-attention over a prompt without a past: q [B, Hq, S, D], k/v [B, Hkv, S, D] (any strides), 16-bit,
    D <= 128 (`tma_applies`) -> [B, Hq, S, D] in q's layout. Exact: TileMix's kernel with no INT8 tile (its INT8 path
    is not compiled), this project's bf16 flash kernel, bit for bit `attention_prefill` at the same tiles under the
    interpreter; its fully visible K/V tiles come by TMA descriptors on sm_90+ (at 128 x 128 in 3 stages,
    16k and 32k tokens, batch 8, qwen3-4b's heads: 1.29x / 1.33x SDPA's flash backend)."""
    from kernels_runtime.ops.tilemix_attention import tilemix_attention
    from kernels_runtime.ops.tilemix_masks import uniform_mask

    _check(q, k, v)
    if not tma_applies(q, k):
        raise ValueError(f"attention_prefill_tma: expected a 16-bit prompt without a past (S_q == S_kv) and head_dim "
                         f"<= 128, got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}")
    key = (q.shape[2], str(q.device))
    if key not in _ZERO_MASKS:
        _ZERO_MASKS[key] = uniform_mask(False, q.shape[2], device=q.device)
    return tilemix_attention(q, k, v, _ZERO_MASKS[key], scale, TMA=True, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                             num_warps=num_warps, num_stages=num_stages)
