"""SwiGLU: `silu(gate) * up` elementwise, and the gate/up projections fused into one tiled matmul with that epilogue.

Numerics follow transformers 5.17's LlamaMLP / Qwen3MLP (`act_fn(gate_proj(x)) * up_proj(x)`): each projection is
rounded to the input dtype, SiLU (computed in fp32) is rounded, and the product is rounded. The fused kernel keeps
two fp32 accumulators ([BLOCK_M, BLOCK_N] each) so x is read once for both projections; the down projection is
left to cuBLAS.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_runtime.ops._common import interpreting

SILU_MUL_CONFIG_SPACE: dict[str, list] = {"BLOCK_N": [256, 512, 1024, 2048], "num_warps": [2, 4, 8]}
SILU_MUL_CONFIGS: list[dict] = [
    {"BLOCK_N": bn, "num_warps": w}
    for bn in SILU_MUL_CONFIG_SPACE["BLOCK_N"] for w in SILU_MUL_CONFIG_SPACE["num_warps"]
]
CONFIG_SPACE: dict[str, list] = {
    "BLOCK_M": [16, 32, 64, 128],
    "BLOCK_N": [32, 64, 128],
    "BLOCK_K": [32, 64, 128],
    "GROUP_M": [8],
    "num_warps": [4, 8],
    "num_stages": [2, 3, 4],
}
# Hand-picked subset for sm_90-class GPUs (kernels_runtime.hardware): large tiles for prefill, thin-M tiles for
# decode (M = batch).
CONFIGS: list[dict] = [
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
]
# M at or below this is the decode regime (one token per sequence): thin-M tiles, more programs along N.
DECODE_MAX_M = 16


@triton.jit
def _silu_and_mul_kernel(
    # Pointers
    G, U, Y,
    # Matrix dimensions
    N,
    # Strides
    stride_g_row, stride_u_row, stride_y_row,
    # Meta-parameters
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    g = tl.load(G + row * stride_g_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u_row + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y_row + cols, (act * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_fused_kernel(
    # Pointers
    X, WG, WU, Y,
    # Matrix dimensions
    M, N, K,
    # Strides
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Grouped ordering: GROUP_M row-blocks share each weight column-block while it is in L2.
    pid = tl.program_id(0)
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group_id = pid // (GROUP_M * num_pid_n)
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    w_off = offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn  # [BLOCK_K, BLOCK_N] view of W [N, K]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & (offs_n[None, :] < N)
        wg = tl.load(WG + w_off, mask=w_mask, other=0.0)
        wu = tl.load(WU + w_off, mask=w_mask, other=0.0)
        if UPCAST_DOT:
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(x, wg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(x, wu, acc_u, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_off += BLOCK_K * stride_wk

    dt = Y.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
    y = (act * acc_u.to(dt).to(tl.float32)).to(dt)
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, y, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def silu_and_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [..., N] -> silu(gate) * up [..., N]."""
    return torch.nn.functional.silu(gate) * up


def swiglu_fused_ref(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """x: [..., K], w_gate/w_up: [N, K] (nn.Linear layout) -> silu(x @ w_gate.T) * (x @ w_up.T) [..., N]."""
    return torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def silu_and_mul(
    gate: torch.Tensor, up: torch.Tensor, *, BLOCK_N: int = 1024, num_warps: int = 4
) -> torch.Tensor:
    """gate, up: [..., N] (same shape and dtype; row-strided views such as halves of a merged projection are fine)
    -> silu(gate) * up [..., N], contiguous."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"silu_and_mul: expected up like gate {tuple(gate.shape)} {gate.dtype}, got {tuple(up.shape)} {up.dtype}"
        )
    n = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    y2 = y.view(-1, n)
    if y.numel() == 0:
        return y
    block_n = min(BLOCK_N, triton.next_power_of_2(n))
    grid = (g2.shape[0], triton.cdiv(n, block_n))
    _silu_and_mul_kernel[grid](
        g2, u2, y2, n, g2.stride(0), u2.stride(0), y2.stride(0), BLOCK_N=block_n, num_warps=num_warps
    )
    return y


def default_config(m: int) -> dict:
    return CONFIGS[4] if m <= DECODE_MAX_M else CONFIGS[0]


def swiglu_fused(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, *,
    BLOCK_M: int | None = None, BLOCK_N: int | None = None, BLOCK_K: int | None = None, GROUP_M: int = 8,
    num_warps: int | None = None, num_stages: int | None = None,
) -> torch.Tensor:
    """x: [..., K], w_gate/w_up: [N, K] (nn.Linear layout, no bias) -> silu(x @ w_gate.T) * (x @ w_up.T) [..., N].
    Config kwargs left as None take `default_config(M)`."""
    K = x.shape[-1]
    if w_gate.dim() != 2 or w_gate.shape[1] != K or w_up.shape != w_gate.shape:
        raise ValueError(
            f"swiglu_fused: expected w_gate and w_up [N, {K}], got {tuple(w_gate.shape)}, {tuple(w_up.shape)}"
        )
    for name, w in (("w_gate", w_gate), ("w_up", w_up)):
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"swiglu_fused: expected {name} {x.dtype} on {x.device}, got {w.dtype} on {w.device}")
    if w_up.stride() != w_gate.stride():  # the kernel walks both weights with one set of offsets
        w_gate, w_up = w_gate.contiguous(), w_up.contiguous()
    N = w_gate.shape[0]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    y2 = y.view(-1, N)
    if y.numel() == 0:
        return y
    cfg = default_config(M)
    bm, bn, bk = BLOCK_M or cfg["BLOCK_M"], BLOCK_N or cfg["BLOCK_N"], BLOCK_K or cfg["BLOCK_K"]
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _swiglu_fused_kernel[grid](
        x2, w_gate, w_up, y2,
        M, N, K,
        x2.stride(0), x2.stride(1), w_gate.stride(0), w_gate.stride(1), y2.stride(0), y2.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M,
        UPCAST_DOT=interpreting(), DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )
    return y
