"""Falcon-Mamba's weightless RMSNorms on x_proj's output: dt_low, B and C (the segments [R | N | N] of its last dim)
each normalized on its own, `x * rsqrt(mean(x^2) + eps)` in fp32, rounded back to the input dtype
(transformers 5.17 `FalconMambaWeightlessRMSNorm`: `_norm(x.float()).type_as(x)`; its `weight` buffer is ones and
unused). The prefill path's launch after x_proj's GEMM; the fused decode step does the same inside its state-update
kernel (`mamba_decode.mamba_dt_state_update(rms_eps=...)`), where every program reads the whole row anyway.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_runtime.ops._common import cast_out, interpreting


@triton.jit
def _segment_norm(x_ptr, y_ptr, cols, n, valid, eps, RNE: tl.constexpr):
    # x_ptr, y_ptr: [ROWS, 1] row bases; cols: [1, BLOCK]; one segment of n values per row, normalized on its own
    mask = valid[:, None] & (cols < n)
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # [ROWS, BLOCK]
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n + eps)  # [ROWS]
    tl.store(y_ptr + cols, cast_out(x * rstd[:, None], y_ptr.dtype.element_ty, RNE), mask=mask)


@triton.jit
def _bcdt_rmsnorm_kernel(
    # Pointers
    P, Y,
    # Matrix dimensions
    M, R, N, eps,
    # Strides
    stride_pm, stride_ym,
    # Meta-parameters
    ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, RNE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    valid = rows < M
    p_row, y_row = P + rows[:, None] * stride_pm, Y + rows[:, None] * stride_ym  # [ROWS, 1]
    cols_r, cols_n = tl.arange(0, BLOCK_R)[None, :], tl.arange(0, BLOCK_N)[None, :]
    _segment_norm(p_row, y_row, cols_r, R, valid, eps, RNE)  # dt_low
    _segment_norm(p_row + R, y_row + R, cols_n, N, valid, eps, RNE)  # B
    _segment_norm(p_row + R + N, y_row + R + N, cols_n, N, valid, eps, RNE)  # C


def bcdt_rmsnorm_ref(p: torch.Tensor, R: int, N: int, eps: float) -> torch.Tensor:
    """p: [..., R + 2N] -> the same shape and dtype, each of [R | N | N] RMS-normalized (no weight), as HF."""
    def norm(x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    dt, b, c = torch.split(p, [R, N, N], dim=-1)
    return torch.cat([norm(dt), norm(b), norm(c)], dim=-1)


def bcdt_rmsnorm(p: torch.Tensor, R: int, N: int, eps: float, *, ROWS: int = 4, num_warps: int = 4) -> torch.Tensor:
    """p: [..., R + 2N] (unit stride in the last dim) -> a new tensor like p (see bcdt_rmsnorm_ref)."""
    if p.shape[-1] != R + 2 * N or R < 1 or N < 1:
        raise ValueError(f"bcdt_rmsnorm: expected a last dim R + 2N = {R + 2 * N}, got {tuple(p.shape)}")
    if p.stride(-1) != 1:
        raise ValueError(f"bcdt_rmsnorm: expected a unit stride in the last dim, got strides {tuple(p.stride())}")
    p2 = p.reshape(-1, p.shape[-1])
    y = torch.empty(p2.shape, dtype=p.dtype, device=p.device)
    M = p2.shape[0]
    if M:
        _bcdt_rmsnorm_kernel[(triton.cdiv(M, ROWS),)](
            p2, y, M, R, N, float(eps), p2.stride(0), y.stride(0),
            ROWS=ROWS, BLOCK_R=triton.next_power_of_2(R), BLOCK_N=triton.next_power_of_2(N), RNE=interpreting(),
            num_warps=num_warps,
        )
    return y.view(p.shape)
