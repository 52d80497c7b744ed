"""Linear layer `y = act(x @ w.T + b)` (and the gated form `silu(x @ wg.T) * (x @ wu.T)`) for the projections of
attention, MLP and SSM mixers.

Two kernels: a tiled `tl.dot` GEMM for prefill-sized M, and a GEMV-style kernel for M <= GEMV_MAX_M (decode: one or
a few new tokens), where a 16-row dot tile would waste most of its work and the op is bound by reading the weight.
Accumulation is always fp32; the output takes x's dtype. fp32 inputs use IEEE dots unless a config asks for TF32
(TF32 misses the fp32 tolerance on all but tiny K: a lesson the search should be able to learn and record).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_runtime.ops._common import _TL, apply_epilogue, cast_out, gemv_store, interpreting, rnd

GEMV_MAX_M = 16  # at or below this many rows the GEMV kernel is used unless a config forces the dot path
EPILOGUES = {None: 0, "silu": 1, "gelu": 2, "gelu_tanh": 3}

# Hand-picked rather than autotuned: the search explores these (and neighbours) per task and records what wins.
CONFIGS = [
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
]
GEMV_CONFIGS = [
    dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=2),
    dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=2),
    dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=3),
    dict(BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=2),
    dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
]


@triton.jit
def _linear_kernel(
    # Pointers
    x_ptr, w_ptr, wu_ptr, b_ptr, r_ptr, y_ptr,
    # Matrix dimensions
    M, N, K,
    # Strides
    stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_ym, stride_yn,
    # Meta-parameters
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, EPILOGUE: tl.constexpr, ROUND_PRE: tl.constexpr,
    HAS_RES: tl.constexpr, ACT_DTYPE: tl.constexpr, IEEE: tl.constexpr, UPCAST_DOT: tl.constexpr, RNE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)  # [BM, BK]
        w_off = rn[None, :] * stride_wn + kk[:, None] * stride_wk
        w_mask = (rn[None, :] < N) & (kk[:, None] < K)
        w = tl.load(w_ptr + w_off, mask=w_mask, other=0.0)  # [BK, BN]
        if UPCAST_DOT:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        if GATED:
            wu = tl.load(wu_ptr + w_off, mask=w_mask, other=0.0)
            if UPCAST_DOT:
                wu = wu.to(tl.float32)
            if IEEE:
                acc_u = tl.dot(x, wu, acc_u, input_precision="ieee")
            else:
                acc_u = tl.dot(x, wu, acc_u)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    acc = apply_epilogue(acc, EPILOGUE, ROUND_PRE, ACT_DTYPE)
    if GATED:
        acc = acc * acc_u
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_RES:  # y = residual + out: out rounded to x's dtype first (nn.Linear's output), the sum in fp32
        acc = rnd(acc, ACT_DTYPE) + tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mask,
                                            other=0.0).to(tl.float32)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, cast_out(acc, y_ptr.dtype.element_ty, RNE),
             mask=mask)


@triton.jit
def _gemv_kernel(
    # Pointers
    x_ptr, w_ptr, wu_ptr, b_ptr, r_ptr, y_ptr,
    # Matrix dimensions
    M, N, K,
    # Strides
    stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_ym, stride_yn,
    # Meta-parameters
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, EPILOGUE: tl.constexpr, ROUND_PRE: tl.constexpr,
    HAS_RES: tl.constexpr, ACT_DTYPE: tl.constexpr, RNE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Grid (M, N / BLOCK_N): the rows sharing one weight block run back to back, so it is read from HBM once.
    row = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + row * stride_xm + kk * stride_xk, mask=kk < K, other=0.0).to(tl.float32)  # [BK]
        w_off = rn[:, None] * stride_wn + kk[None, :] * stride_wk
        w_mask = (rn[:, None] < N) & (kk[None, :] < K)
        w = tl.load(w_ptr + w_off, mask=w_mask, other=0.0).to(tl.float32)  # [BN, BK]
        acc += tl.sum(w * x[None, :], axis=1)
        if GATED:
            wu = tl.load(wu_ptr + w_off, mask=w_mask, other=0.0).to(tl.float32)
            acc_u += tl.sum(wu * x[None, :], axis=1)
    gemv_store(acc, acc_u, b_ptr, r_ptr, y_ptr, row, rn, N, stride_rm, stride_ym, stride_yn, HAS_BIAS, GATED,
               EPILOGUE, ROUND_PRE, HAS_RES, ACT_DTYPE, RNE)


@triton.jit
def _gemv_split_kernel(
    x_ptr, w_ptr, wu_ptr, p_ptr, pu_ptr,
    M, N, K, K_PER,
    stride_xm, stride_xk, stride_wn, stride_wk,
    GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Grid (M, N / BLOCK_N, SPLIT): program s sums k in [s * K_PER, (s + 1) * K_PER) into p[s, row, :] (fp32).
    # More programs than N / BLOCK_N alone when N is small against the SM count (decode out_proj: N = 2560).
    row = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_lo = split * K_PER
    for k0 in range(0, K_PER, BLOCK_K):
        kk = k_lo + k0 + rk
        mk = (kk < K) & (k0 + rk < K_PER)
        x = tl.load(x_ptr + row * stride_xm + kk * stride_xk, mask=mk, other=0.0).to(tl.float32)
        w_off = rn[:, None] * stride_wn + kk[None, :] * stride_wk
        w_mask = (rn[:, None] < N) & mk[None, :]
        w = tl.load(w_ptr + w_off, mask=w_mask, other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
        if GATED:
            wu = tl.load(wu_ptr + w_off, mask=w_mask, other=0.0).to(tl.float32)
            acc_u += tl.sum(wu * x[None, :], axis=1)
    offs = (split * M + row) * N + rn
    tl.store(p_ptr + offs, acc, mask=rn < N)
    if GATED:
        tl.store(pu_ptr + offs, acc_u, mask=rn < N)


@triton.jit
def _gemv_reduce_kernel(
    p_ptr, pu_ptr, b_ptr, r_ptr, y_ptr, M, N, stride_rm, stride_ym, stride_yn,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, EPILOGUE: tl.constexpr,
    ROUND_PRE: tl.constexpr, HAS_RES: tl.constexpr, ACT_DTYPE: tl.constexpr, RNE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # y[row, :] = epilogue(sum_s p[s, row, :] + bias) (* sum_s pu[s, row, :]): a fixed order, so deterministic
    row = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(SPLIT):
        offs = (s * M + row) * N + rn
        acc += tl.load(p_ptr + offs, mask=rn < N, other=0.0)
        if GATED:
            acc_u += tl.load(pu_ptr + offs, mask=rn < N, other=0.0)
    gemv_store(acc, acc_u, b_ptr, r_ptr, y_ptr, row, rn, N, stride_rm, stride_ym, stride_yn, HAS_BIAS, GATED,
               EPILOGUE, ROUND_PRE, HAS_RES, ACT_DTYPE, RNE)


def linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, epilogue: str | None = None,
               w_up: torch.Tensor | None = None, residual: torch.Tensor | None = None,
               round_pre: bool = False) -> torch.Tensor:
    """x: [..., K], w: [N, K], bias: [N] -> [..., N]; `w_up` [N, K] makes it act(x @ w.T) * (x @ w_up.T);
    `residual` [..., N]: residual + that (rounded to x's dtype), in fp32, in their promoted dtype; `round_pre`:
    x @ w.T + bias rounded to x's dtype before the epilogue."""
    y = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
    if round_pre:
        y = y.to(x.dtype).float()
    if epilogue == "silu":
        y = torch.nn.functional.silu(y)
    elif epilogue in ("gelu", "gelu_tanh"):
        y = torch.nn.functional.gelu(y, approximate="tanh" if epilogue == "gelu_tanh" else "none")
    elif epilogue is not None:
        raise ValueError(f"linear_ref: expected epilogue in {list(EPILOGUES)}, got {epilogue!r}")
    if w_up is not None:
        y = y * torch.nn.functional.linear(x.float(), w_up.float())
    if residual is not None:
        return (residual.float() + y.to(x.dtype).float()).to(torch.promote_types(x.dtype, residual.dtype))
    return y.to(x.dtype)


def _cublas_linear(x, w, bias, impl: str, fused: tuple) -> torch.Tensor:
    if impl != "cublas":
        raise ValueError(f"linear: expected impl 'triton' or 'cublas', got {impl!r}")
    if any(f is not None and f is not False for f in fused):
        raise ValueError("linear: impl='cublas' is the plain projection: expected no epilogue, w_up, residual or "
                         "round_pre")
    return torch.nn.functional.linear(x, w, bias)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, epilogue: str | None = None, *,
           w_up: torch.Tensor | None = None, gemv: bool | None = None, BLOCK_M: int = 64, BLOCK_N: int = 64,
           BLOCK_K: int = 32, num_warps: int = 4, num_stages: int = 3, TF32: bool = False,
           GEMV_BLOCK_N: int = 64, GEMV_BLOCK_K: int = 64, GEMV_SPLIT_K: int = 1,
           residual: torch.Tensor | None = None, round_pre: bool = False, impl: str = "triton") -> torch.Tensor:
    """x: [..., K], w: [N, K] (nn.Linear layout), bias: [N] -> y: [..., N] in x's dtype.

    `impl="cublas"`: the plain projection (bias at most) through torch's linear, i.e. cuBLAS on a GPU. A prefill
    projection is a large GEMM, where cuBLAS's Hopper kernels beat this Triton block kernel; a template whose work
    is elsewhere (the attention) takes it there, as the model's own modules do.

    `residual` [..., N] (last dim contiguous): y = residual + (the above, rounded to x's dtype), added in fp32 in the
    store and returned in torch.promote_types(x.dtype, residual.dtype) (a block's residual add: `residual + out`
    with an fp32 residual stream), no separate launch.

    `epilogue` in None|"silu"|"gelu"|"gelu_tanh" is applied to x @ w.T + bias; with `w_up` the output is
    epilogue(x @ w.T) * (x @ w_up.T) (gate/up projections of a gated MLP in one pass over x). `round_pre` rounds
    x @ w.T + bias to x's dtype before the epilogue, as an nn.Linear followed by an activation module does (HF's
    GELU MLPs); a no-op for fp32.
    `gemv` None picks the GEMV kernel for M <= GEMV_MAX_M; the block sizes of the chosen kernel apply.
    GEMV_SPLIT_K > 1 splits K over that many programs per output block (fp32 partial sums, then a second launch
    adds them in a fixed order with bias and epilogue): more programs where N / GEMV_BLOCK_N alone would leave SMs
    idle (decode projections of a narrow model); worth it where launches are cheap (under CUDA graphs).
    """
    if impl != "triton":
        return _cublas_linear(x, w, bias, impl, fused=(epilogue, w_up, residual, round_pre))
    if not (isinstance(GEMV_SPLIT_K, int) and GEMV_SPLIT_K >= 1):
        raise ValueError(f"linear: expected GEMV_SPLIT_K an int >= 1, got {GEMV_SPLIT_K!r}")
    if x.shape[-1] != w.shape[1] or w.dim() != 2:
        raise ValueError(f"linear: expected x [..., {w.shape[-1]}] and w [N, K], got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if w_up is not None and w_up.shape != w.shape:
        raise ValueError(f"linear: expected w_up {tuple(w.shape)}, got {tuple(w_up.shape)}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"linear: expected epilogue in {list(EPILOGUES)}, got {epilogue!r}")
    N, K = w.shape
    x2 = x.reshape(-1, K)  # [M, K]; a view whenever the leading dims allow
    M = x2.shape[0]
    out_dtype = x.dtype
    if residual is not None:
        if tuple(residual.shape) != (*x.shape[:-1], N):
            raise ValueError(f"linear: expected residual {[*x.shape[:-1], N]}, got {tuple(residual.shape)}")
        if N > 1 and residual.stride(-1) != 1:
            raise ValueError(f"linear: expected a residual with a unit last stride, got {tuple(residual.stride())}")
        out_dtype = torch.promote_types(x.dtype, residual.dtype)
    y = torch.empty((M, N), device=x.device, dtype=out_dtype)
    if M == 0:
        return y.reshape(*x.shape[:-1], N)
    r2 = residual.reshape(-1, N) if residual is not None else y
    args = (x2, w, w if w_up is None else w_up, w if bias is None else bias, r2, y, M, N, K,
            x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), r2.stride(0), y.stride(0), y.stride(1))
    meta = dict(HAS_BIAS=bias is not None, GATED=w_up is not None, EPILOGUE=EPILOGUES[epilogue],
                ROUND_PRE=bool(round_pre) and x.dtype in (torch.float16, torch.bfloat16), HAS_RES=residual is not None,
                ACT_DTYPE=_TL.get(x.dtype, tl.float32), RNE=interpreting())
    use_gemv = gemv if gemv is not None else M <= GEMV_MAX_M
    split = min(GEMV_SPLIT_K, triton.cdiv(K, GEMV_BLOCK_K))  # never a split without a K block of its own
    if use_gemv and split > 1:
        k_per = triton.cdiv(triton.cdiv(K, split), GEMV_BLOCK_K) * GEMV_BLOCK_K
        split = triton.cdiv(K, k_per)
        part = torch.empty((split, M, N), device=x.device, dtype=torch.float32)
        part_u = torch.empty_like(part) if w_up is not None else part
        _gemv_split_kernel[(M, triton.cdiv(N, GEMV_BLOCK_N), split)](
            x2, w, w if w_up is None else w_up, part, part_u, M, N, K, k_per,
            x2.stride(0), x2.stride(1), w.stride(0), w.stride(1),
            GATED=w_up is not None, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=GEMV_BLOCK_K, num_warps=num_warps,
            num_stages=num_stages)
        _gemv_reduce_kernel[(M, triton.cdiv(N, GEMV_BLOCK_N))](
            part, part_u, w if bias is None else bias, r2, y, M, N, r2.stride(0), y.stride(0), y.stride(1),
            SPLIT=split, **meta, BLOCK_N=GEMV_BLOCK_N)
    elif use_gemv:
        grid = (M, triton.cdiv(N, GEMV_BLOCK_N))
        _gemv_kernel[grid](*args, **meta, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=GEMV_BLOCK_K, num_warps=num_warps,
                           num_stages=num_stages)
    else:
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
        _linear_kernel[grid](*args, **meta, IEEE=x.dtype == torch.float32 and not TF32, UPCAST_DOT=interpreting(),
                             BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=num_warps,
                             num_stages=num_stages)
    return y.reshape(*x.shape[:-1], N)
