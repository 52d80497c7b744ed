"""RMSNorm over the last dim, optionally fused with the residual add that precedes it in a decoder layer.

Numerics follow Hugging Face's LlamaRMSNorm / Qwen3RMSNorm (transformers 5.17): the sum of squares and the
scaling run in fp32, the normalized value is rounded to the input dtype, then multiplied by the weight (and
rounded again). The fused residual add rounds `x + residual` to the input dtype first, as the eager `+` does.
`gemma=True` follows Gemma's (RecurrentGemmaRMSNorm, Gemma2/3): everything in fp32, scaled by `1 + weight`, rounded
once to the input dtype at the end.
`rmsnorm_rows` computes `rmsnorm` with several rows a program; `gated_rmsnorm` is Mamba2's MambaRMSNormGated
(`w * rmsnorm(x * silu(z)).to(x.dtype)`, normalised over the whole last dim), also several rows a program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_runtime.ops._common import _TL, cast_out, interpreting, rnd

# The whole row lives in one tile; above this, registers spill and a two-pass kernel would be needed.
MAX_HIDDEN = 65536

CONFIG_SPACE: dict[str, list] = {"num_warps": [1, 2, 4, 8, 16]}
CONFIGS: list[dict] = [{"num_warps": w} for w in CONFIG_SPACE["num_warps"]]


@triton.jit
def _rmsnorm_kernel(
    # Pointers
    X, R, W, Y, RES_OUT,
    # Matrix dimensions
    N, eps,
    # Strides
    stride_x_row, stride_r_row, stride_y_row, stride_res_row,
    # Meta-parameters
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GEMMA: tl.constexpr = False,
    IN_DTYPE: tl.constexpr = None,
    RNE: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x_row + cols, mask=mask, other=0.0)  # [BLOCK_N]
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r_row + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(RES_OUT + row * stride_res_row + cols, x, mask=mask)
    xf = x.to(tl.float32)
    if IN_DTYPE is not None:  # x.to(IN_DTYPE) first (HF's Mamba blocks: the fp32 residual stream into a bf16 norm)
        xf = rnd(xf, IN_DTYPE)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:  # (x * rstd) * (1 + w) in fp32, one rounding
        y = (xf * rstd) * (1.0 + w)
    elif IN_DTYPE is not None:  # rounded to the input dtype, then scaled
        y = w * rnd(xf * rstd, IN_DTYPE)
    else:
        y = w * (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y_row + cols, cast_out(y, Y.dtype.element_ty, RNE), mask=mask)


@triton.jit
def _rmsnorm_rows_kernel(
    # Pointers
    X, W, Y,
    # Matrix dimensions
    n_rows, N, eps,
    # Strides
    stride_x, stride_y,
    # Meta-parameters
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # ROWS rows per program: small hidden sizes (and decode's few rows) need fewer, fuller programs
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)  # [ROWS, BLOCK_N]
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)  # [ROWS]
    xn = (xf * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], (w[None, :] * xn).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rmsnorm_kernel(
    # Pointers
    X, Z, W, Y,
    # Matrix dimensions
    n_rows, N, eps,
    # Strides
    stride_x, stride_z, stride_y,
    # Meta-parameters
    HAS_Z: tl.constexpr, IN_DTYPE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # h = x * silu(z) in fp32; y = w * (h * rsqrt(mean(h^2) + eps)).to(x.dtype)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(Z + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = h * (z * tl.sigmoid(z))
    rstd = tl.rsqrt(tl.sum(h * h, axis=1) / N + eps)  # [ROWS]
    hn = rnd(h * rstd[:, None], IN_DTYPE)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], (w[None, :] * hn).to(Y.dtype.element_ty), mask=mask)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x: [..., N], weight: [N] -> [..., N] in promote(x.dtype, weight.dtype)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(input_dtype)


def rmsnorm_gemma_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Gemma's RMSNorm: x: [..., N], weight: [N] -> [..., N] in x.dtype; fp32 throughout, scaled by (1 + weight)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def rmsnorm_residual_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., N], weight: [N] -> (normed [..., N], new_residual = x + residual [..., N])."""
    new_residual = residual + x
    return rmsnorm_ref(new_residual, weight, eps), new_residual


def gated_rmsnorm_ref(x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF's MambaRMSNormGated over the whole last dim: x, z (or None): [..., N], weight: [N]
    -> weight * rmsnorm(x * silu(z)).to(x.dtype), [..., N] in promote(x.dtype, weight.dtype)."""
    h = x.to(torch.float32)
    if z is not None:
        h = h * torch.nn.functional.silu(z.to(torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _default_num_warps(block_n: int) -> int:
    return min(16, max(1, block_n // 512))


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rmsnorm: expected weight of shape ({n},), got {tuple(weight.shape)}")
    if n > MAX_HIDDEN:
        raise ValueError(f"rmsnorm: expected hidden size <= {MAX_HIDDEN}, got {n}")
    if weight.device != x.device:
        raise ValueError(f"rmsnorm: expected weight on {x.device}, got {weight.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"rmsnorm_residual: expected residual {tuple(x.shape)} {x.dtype}, "
            f"got {tuple(residual.shape)} {residual.dtype}"
        )


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x, weight, residual, eps, num_warps, gemma=False, in_dtype=None):
    _check(x, weight, residual)
    n = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    out_dtype = x.dtype if gemma else torch.promote_types(in_dtype or x.dtype, weight.dtype)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else y
    y2, res2 = y.view(-1, n), res_out.view(-1, n)
    block_n = triton.next_power_of_2(n)
    if x2.shape[0] > 0:
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, r2, weight, y2, res2,
            n, eps,
            x2.stride(0), r2.stride(0), y2.stride(0), res2.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, GEMMA=gemma,
            IN_DTYPE=_TL[in_dtype] if in_dtype is not None else None, RNE=interpreting(),
            num_warps=num_warps or _default_num_warps(block_n),
        )
    return y, res_out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, num_warps: int | None = None,
            gemma: bool = False, in_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [..., N], weight: [N] -> [..., N] in promote(x.dtype, weight.dtype) (gemma: in x.dtype, scaled by
    1 + weight, see the module docstring). Any leading shape. `in_dtype`: normalize x.to(in_dtype), as HF's Mamba
    blocks feed their fp32 residual stream to a bf16 norm; the output is then in promote(in_dtype, weight.dtype)."""
    if in_dtype is not None and (gemma or in_dtype not in _TL):
        raise ValueError(f"rmsnorm: expected in_dtype in {list(_TL)} and gemma=False, got {in_dtype}, gemma={gemma}")
    return _launch(x, weight, None, eps, num_warps, gemma, in_dtype)[0]


def rmsnorm_residual(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, num_warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., N], weight: [N] -> (rmsnorm(x + residual), x + residual). Inputs are not modified."""
    return _launch(x, weight, residual, eps, num_warps)


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype == weight.dtype else torch.float32  # torch.promote_types for float pairs


def rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, rows: int = 4,
                 num_warps: int = 4) -> torch.Tensor:
    """x: [..., N], weight: [N] -> [..., N] in promote(x.dtype, weight.dtype): `rmsnorm`'s numerics with `rows`
    rows a program (a power of two) instead of one."""
    _check(x, weight, None)
    n = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    y2 = y.view(-1, n)
    if x2.shape[0] > 0:
        _rmsnorm_rows_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, weight, y2,
            x2.shape[0], n, eps,
            x2.stride(0), y2.stride(0),
            ROWS=rows, BLOCK_N=triton.next_power_of_2(n), num_warps=num_warps)
    return y


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6, *,
                  out_dtype: torch.dtype | None = None, rows: int = 4, num_warps: int = 4) -> torch.Tensor:
    """Mamba2's gated RMSNorm (`gated_rmsnorm_ref`): x, z (or None): [..., N], weight: [N] -> [..., N] in
    `out_dtype` (default promote(x.dtype, weight.dtype)); `rows` rows a program (a power of two)."""
    _check(x, weight, None)
    if z is not None and z.shape != x.shape:
        raise ValueError(f"gated_rmsnorm: expected z of shape {tuple(x.shape)}, got {tuple(z.shape)}")
    n = x.shape[-1]
    x2 = _rows(x)
    z2 = _rows(z) if z is not None else x2
    y = torch.empty(x.shape, dtype=_out_dtype(x, weight) if out_dtype is None else out_dtype, device=x.device)
    y2 = y.view(-1, n)
    if x2.shape[0] > 0:
        _gated_rmsnorm_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, z2, weight, y2,
            x2.shape[0], n, eps,
            x2.stride(0), z2.stride(0), y2.stride(0),
            HAS_Z=z is not None, IN_DTYPE=_TL[x.dtype], ROWS=rows, BLOCK_N=triton.next_power_of_2(n),
            num_warps=num_warps)
    return y


__all__ = ["CONFIGS", "CONFIG_SPACE", "gated_rmsnorm", "gated_rmsnorm_ref", "rmsnorm", "rmsnorm_gemma_ref",
           "rmsnorm_ref", "rmsnorm_residual", "rmsnorm_residual_ref", "rmsnorm_rows"]
