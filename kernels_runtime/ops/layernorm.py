"""LayerNorm over the last dim, with or without bias (torch.nn.LayerNorm: GPT-NeoX, Phi, StableLM, GPT-J).

Numerics follow torch's layer_norm: mean and biased variance in fp32, `(x - mean) * rstd * w + b`, one rounding to
the input dtype at the store. Several rows a program: small hidden sizes and decode's few rows need fewer, fuller
programs. The whole row lives in one tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _layernorm_rows_kernel(
    # Pointers
    X, W, B, Y,
    # Matrix dimensions
    n_rows, N, eps,
    # Strides
    stride_x, stride_y,
    # Meta-parameters
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N  # [ROWS]
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
    y = xc * rstd[:, None] * tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def layernorm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  eps: float = 1e-5) -> torch.Tensor:
    """x: [..., N], weight, bias (or None): [N] -> [..., N] in x.dtype."""
    y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(),
                                       None if bias is None else bias.float(), eps)
    return y.to(x.dtype)


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5, *,
              rows: int = 4, num_warps: int = 4) -> torch.Tensor:
    """x: [..., N], weight, bias (or None): [N] -> [..., N] in x.dtype; `rows` rows a program (a power of two)."""
    n = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != (n,):
            raise ValueError(f"layernorm: expected {name} of shape ({n},), got {tuple(t.shape)}")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, n)
    if x2.shape[0] > 0:
        _layernorm_rows_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, weight, bias if bias is not None else weight, y2,
            x2.shape[0], n, eps,
            x2.stride(0), y2.stride(0),
            HAS_BIAS=bias is not None, ROWS=rows, BLOCK_N=triton.next_power_of_2(n), num_warps=num_warps)
    return y


__all__ = ["layernorm", "layernorm_ref"]
