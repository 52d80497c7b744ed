"""Rotary position embedding (rotate_half convention) on q and k, optionally preceded by Qwen3's per-head RMSNorm.

Numerics follow transformers 5.17: `q * cos + rotate_half(q) * sin` with every elementwise op rounded to the
input dtype (the eager ops do so), and for Qwen3 `q_norm` = fp32 RMSNorm over the head dim, rounded, times the
weight. Partial rotary (StableLM and Phi `partial_rotary_factor`, GPT-NeoX `rotary_pct`): cos/sin hold R < D
columns (HF's rotary embedding is built for R = the rotated dims); the first R columns of each head are rotated and
the last D - R pass through unchanged, as HF's `apply_rotary_pos_emb` does (`rotary_dim = cos.shape[-1]`).
One program handles one (batch, position) token: cos/sin are loaded once and reused by all q and k heads.
Outputs are new tensors laid out like q and k (HF's q/k are transposed views of the projections).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CONFIG_SPACE: dict[str, list] = {"BLOCK_H": [1, 2, 4, 8, 16], "num_warps": [1, 2, 4, 8]}
CONFIGS: list[dict] = [
    {"BLOCK_H": bh, "num_warps": w} for bh in CONFIG_SPACE["BLOCK_H"] for w in CONFIG_SPACE["num_warps"] if w <= 2 * bh
]


@triton.jit
def _rope_heads(
    X, Y, W, cos1, cos2, sin1, sin2, offs_d, mask_d,
    n_heads, eps,
    stride_xh, stride_xd, stride_yh, stride_yd,
    HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # columns [0, 2 HALF) are rotated, [2 HALF, 2 HALF + PASS) pass through (only normed, with HAS_NORM)
    dt = Y.dtype.element_ty
    offs_p = 2 * HALF + tl.arange(0, BLOCK_PASS)
    mask_p = offs_p < 2 * HALF + PASS
    if HAS_NORM:
        w1 = tl.load(W + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(W + offs_p, mask=mask_p, other=0.0).to(tl.float32)[None, :]
    for h0 in range(0, n_heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h[:, None] < n_heads) & mask_d[None, :]
        x_ptrs = X + offs_h[:, None] * stride_xh + offs_d[None, :] * stride_xd
        x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_HALF]
        x2 = tl.load(x_ptrs + HALF * stride_xd, mask=mask, other=0.0).to(tl.float32)
        y_ptrs = Y + offs_h[:, None] * stride_yh + offs_d[None, :] * stride_yd
        if PASS > 0:
            mask_hp = (offs_h[:, None] < n_heads) & mask_p[None, :]
            xp = tl.load(X + offs_h[:, None] * stride_xh + offs_p[None, :] * stride_xd, mask=mask_hp, other=0.0)
            xp = xp.to(tl.float32)  # [BLOCK_H, BLOCK_PASS]
        if HAS_NORM:
            ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
            if PASS > 0:
                ss += tl.sum(xp * xp, axis=1)
            rstd = tl.rsqrt(ss / (2 * HALF + PASS) + eps)[:, None]
            x1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            x2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            if PASS > 0:
                xp = (wp * (xp * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        if PASS > 0:
            tl.store(Y + offs_h[:, None] * stride_yh + offs_p[None, :] * stride_yd, xp.to(dt), mask=mask_hp)
        y1 = (x1 * cos1).to(dt).to(tl.float32) + (-x2 * sin1).to(dt).to(tl.float32)
        y2 = (x2 * cos2).to(dt).to(tl.float32) + (x1 * sin2).to(dt).to(tl.float32)
        tl.store(y_ptrs, y1.to(dt), mask=mask)
        tl.store(y_ptrs + HALF * stride_yd, y2.to(dt), mask=mask)


@triton.jit
def _rotary_kernel(
    # Pointers
    Q, K, COS, SIN, QW, KW, QO, KO,
    # Matrix dimensions
    S, Hq, Hkv, eps,
    # Strides
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_cb, stride_cs, stride_cd,
    stride_sb, stride_ss, stride_sd,
    stride_qob, stride_qoh, stride_qos, stride_qod,
    stride_kob, stride_koh, stride_kos, stride_kod,
    # Meta-parameters
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b, s = pid // S, pid % S
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    c_ptrs = COS + b * stride_cb + s * stride_cs + offs_d * stride_cd
    s_ptrs = SIN + b * stride_sb + s * stride_ss + offs_d * stride_sd
    cos1 = tl.load(c_ptrs, mask=mask_d, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_HALF]
    cos2 = tl.load(c_ptrs + HALF * stride_cd, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(s_ptrs, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(s_ptrs + HALF * stride_sd, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    _rope_heads(
        Q + b * stride_qb + s * stride_qs, QO + b * stride_qob + s * stride_qos, QW,
        cos1, cos2, sin1, sin2, offs_d, mask_d, Hq, eps,
        stride_qh, stride_qd, stride_qoh, stride_qod, HALF, PASS, BLOCK_PASS, HAS_NORM, BLOCK_H,
    )
    _rope_heads(
        K + b * stride_kb + s * stride_ks, KO + b * stride_kob + s * stride_kos, KW,
        cos1, cos2, sin1, sin2, offs_d, mask_d, Hkv, eps,
        stride_kh, stride_kd, stride_koh, stride_kod, HALF, PASS, BLOCK_PASS, HAS_NORM, BLOCK_H,
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Hq, S, D], k: [B, Hkv, S, D], cos/sin: [B, S, R] (R <= D: the first R columns of each head rotate,
    the rest pass through) -> (q_embed [B, Hq, S, D], k_embed [B, Hkv, S, D])."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, S, R]
    r = cos.shape[-1]

    def one(x):
        x_rot, x_pass = x[..., :r], x[..., r:]
        return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)

    return one(q), one(k)


def _head_rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def qk_norm_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3: rotary(q_norm(q), k_norm(k)). q: [B, Hq, S, D], k: [B, Hkv, S, D], cos/sin: [B, S, D],
    q_weight/k_weight: [D] -> (q_embed [B, Hq, S, D], k_embed [B, Hkv, S, D])."""
    return rotary_ref(_head_rmsnorm_ref(q, q_weight, eps), _head_rmsnorm_ref(k, k_weight, eps), cos, sin)


def _check(q, k, cos, sin, weights) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"rotary: expected q [B, Hq, S, D] and k [B, Hkv, S, D], got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    B, _, S, D = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (B, S, D):
        raise ValueError(f"rotary: expected k [{B}, Hkv, {S}, {D}], got {tuple(k.shape)}")
    if D % 2:
        raise ValueError(f"rotary: expected an even head dim, got {D}")
    R = cos.shape[-1] if cos.dim() == 3 else -1
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[:2] != (B, S) or t.shape[2] != R or not 0 < R <= D or R % 2:
            raise ValueError(f"rotary: expected {name} of shape ({B}, {S}, R) with R even and 0 < R <= {D} "
                             f"(R < {D}: partial rotary), got {tuple(t.shape)}")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)) + tuple(weights):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"rotary: expected {name} {q.dtype} on {q.device}, got {t.dtype} on {t.device}")
    for name, t in weights:
        if t.shape != (D,):
            raise ValueError(f"qk_norm_rotary: expected {name} of shape ({D},), got {tuple(t.shape)}")


def _launch(q, k, cos, sin, q_weight, k_weight, eps, BLOCK_H, num_warps):
    has_norm = q_weight is not None
    _check(q, k, cos, sin, (("q_weight", q_weight), ("k_weight", k_weight)) if has_norm else ())
    B, Hq, S, D = q.shape
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if q.numel() == 0:
        return qo, ko
    half, n_pass = cos.shape[-1] // 2, D - cos.shape[-1]
    _rotary_kernel[(B * S,)](
        q, k, cos, sin, q_weight if has_norm else q, k_weight if has_norm else k, qo, ko,
        S, Hq, k.shape[1], eps,
        *q.stride(), *k.stride(), *cos.stride(), *sin.stride(), *qo.stride(), *ko.stride(),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), PASS=n_pass,
        BLOCK_PASS=triton.next_power_of_2(max(n_pass, 1)), BLOCK_H=BLOCK_H, HAS_NORM=has_norm,
        num_warps=num_warps,
    )
    return qo, ko


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    *, BLOCK_H: int = 4, num_warps: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Hq, S, D], k: [B, Hkv, S, D], cos/sin: [B, S, R] with R even, R <= D (R < D: partial rotary, the
    last D - R columns pass through) (all one dtype, any strides) -> (q_embed [B, Hq, S, D], k_embed [B, Hkv, S, D]),
    new tensors with q's and k's layouts."""
    return _launch(q, k, cos, sin, None, None, 0.0, BLOCK_H, num_warps)


def qk_norm_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float = 1e-6,
    *, BLOCK_H: int = 4, num_warps: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's q_norm/k_norm (RMSNorm over all D columns, weights [D]) fused with rotary. Shapes as `rotary`."""
    return _launch(q, k, cos, sin, q_weight, k_weight, eps, BLOCK_H, num_warps)
