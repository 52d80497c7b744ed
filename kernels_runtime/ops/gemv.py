"""Decode GEMVs that stream the weights once, with the work around them fused into a prologue and an epilogue.

At decode batches (1 to a few dozen rows) a projection `x @ W.T` is bound by reading W: the kernel exists to keep
HBM busy, and reads each weight tile once for every row of the batch (the FMA reduction up to MAX_FMA_M rows,
tl.dot tiles of 16..MAX_ROWS rows past it).
`_gemv_kernel` is one weight-streaming pass over up to three weights laid side by side along N (q/k/v, or gate/up):
each program picks its weight by its program id (no concatenated copy), reads a [BLOCK_N, BLOCK_K] tile of it per
step with 16-byte loads along K (rows contiguous, no mask along K when the split divides K), and accumulates
`w * x` elementwise in fp32 registers, reducing over K once after the loop (no shuffles inside it). K is split over
SPLIT_K programs so that narrow outputs still give every SM several programs; the split partial sums go to an fp32
buffer [SPLIT_K, M, N_total] and a second, tiny launch adds them in a fixed order (deterministic, no atomics) and
runs the epilogue:
- `gemv`: plain, or `residual + out` (an o_proj / down_proj with the block's residual add); the lm_head;
- `gemv_residual_rmsnorm`: `h = residual + out` and the next RMSNorm of h (one program per row: it needs the row);
- `gate_up_swiglu`: gate and up in one pass, `silu(gate) * up` in the reduction (`act="gelu_tanh"`: Gemma's
  `gelu_pytorch_tanh(gate) * up`);
- `qkv_norm_rope`: q, k, v in one pass; per head the Qwen3 q/k RMSNorm and the rotary embedding in the reduction.
A `norm_w` prologue (RMSNorm of x folded into the GEMV: each program reads the whole x row from L2 for its rstd)
removes the norm launch in front of a projection (post_attention_layernorm before gate/up). Gemma's RMSNorm (fp32
inside, scaled by 1 + w, rounded once) where a launcher takes `gemma` / `gemma_norm`: Gemma-2's decoder layer.

Numerics follow transformers 5.17 (LlamaAttention / Qwen3Attention / LlamaMLP, bf16 modules): each nn.Linear
output is rounded to the activation dtype before the next op, each elementwise op of the eager code rounds.
The accumulation order differs from cuBLAS's (fp32 either way).

This module is the public one (templates and bundles import `kernels_runtime.ops.gemv`): the references, the
launchers and `_stream`, which picks a weight pass's kernel. The kernels live by what they do: `gemv_stream.py`
(`_gemv_kernel` and its row and tile choices), `gemv_tma.py` (`_gemv_tma_kernel`, batch 1 by TMA), `gemv_reduce.py`
(the split-K reductions and their epilogues). Every launch happens here, through this module's `launch`.
The kernels' `TIMELINE` constexpr is off unless a measuring script sets `_common.TIMELINE["buf"]` (an opt-in).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels_runtime.ops._common import (_TL, TIMELINE, interpreting, l2_prefetch_on, launch, pdl_launch, pdl_on,
                                         timeline_rows)
# The kernels live in modules by what they do; every launch happens here (a spy on this module's `launch` or
# `_gemv_tma_kernel` sees them all), and the names callers import from here stay importable from here.
from kernels_runtime.ops.gemv_reduce import (MAX_ROW, _qkv_reduce_kernel, _reduce_block, _reduce_kernel,
                                             _residual_rmsnorm_reduce_kernel, _split_sum, _swiglu_reduce_kernel)
from kernels_runtime.ops.gemv_stream import (DOT_MIN_M, DOT_STAGES, MAX_FMA_M, MAX_ROWS, _check_cfg, _check_rows,
                                             _dot_path, _dot_tiles, _gemv_kernel, _l2_targets, _norm_row,
                                             _row_norm_kernel, _rows_per_program, _split_of)
from kernels_runtime.ops.gemv_tma import _gemv_tma_kernel, _tma_fits, _tma_tile

# Hand-picked starting points for a 132-SM HBM3 GPU (bf16, batch 1): 16-row tiles 512 deep are 16 KB a step per
# program.
CONFIG_SPACE: dict[str, list] = {"BLOCK_N": [4, 8, 16, 32, 64], "BLOCK_K": [64, 128, 256, 512, 1024, 2048, 4096],
                                 "SPLIT_K": [1, 2, 4, 8, 16], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3]}
DEFAULT = {"BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1}


# ----------------------------------------------------------------------------------------------------------------
# References (pure PyTorch, the eager modules' op order and roundings)


def gemv_ref(x, w, residual=None, norm_w=None, eps=1e-6):
    """x: [..., K] (RMSNorm'd by norm_w first when given), w: [N, K] -> x @ w.T (+ residual, in its dtype)."""
    if norm_w is not None:
        x = _rmsnorm_ref(x, norm_w, eps)
    y = torch.nn.functional.linear(x.float(), w.float()).to(x.dtype)
    return y if residual is None else (residual.float() + y.float()).to(residual.dtype)


def _rmsnorm_ref(x, w, eps, gemma=False):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:  # Gemma's: (x * rstd) * (1 + w) in fp32, rounded once
        return (h * (1.0 + w.float())).to(x.dtype)
    return w * h.to(x.dtype)


def gemv_residual_rmsnorm_ref(x, w, residual, norm_w, eps=1e-6, out_norm_w=None, out_eps=1e-6, gemma=False):
    """-> (h = residual + x @ w.T, RMSNorm(h) * norm_w or None without norm_w); out_norm_w: x @ w.T RMSNorm'd
    before the add (Gemma-2's sandwich norms); gemma: Gemma's norms."""
    y = gemv_ref(x, w)
    if out_norm_w is not None:
        y = _rmsnorm_ref(y, out_norm_w, out_eps, gemma)
    h = (residual.float() + y.float()).to(residual.dtype)
    return h, None if norm_w is None else _rmsnorm_ref(h, norm_w, eps, gemma)


ACTS = {"silu": torch.nn.functional.silu,  # gate_up_swiglu's `act`: LlamaMLP's, Gemma's gelu_pytorch_tanh
        "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh")}


def gate_up_swiglu_ref(x, w_gate, w_up, norm_w=None, eps=1e-6, act="silu"):
    """-> act(x @ w_gate.T) * (x @ w_up.T) (act: silu or gelu_tanh), x RMSNorm'd by norm_w first when given."""
    if norm_w is not None:
        x = _rmsnorm_ref(x, norm_w, eps)
    g = torch.nn.functional.linear(x.float(), w_gate.float()).to(x.dtype)
    u = torch.nn.functional.linear(x.float(), w_up.float()).to(x.dtype)
    return ACTS[act](g) * u


def qkv_norm_rope_ref(x, wq, wk, wv, cos, sin, head_dim, q_norm_w=None, k_norm_w=None, eps=1e-6, norm_w=None,
                      norm_eps=1e-6, gemma_norm=False):
    """x: [M, K], cos/sin: [M, D] or None -> q [M, Hq, D], k [M, Hkv, D], v [M, Hkv, D] (Qwen3Attention's
    projections, q_norm/k_norm and apply_rotary_pos_emb; Llama's without the norms); x RMSNorm'd by norm_w first
    (gemma_norm: Gemma's norm)."""
    if norm_w is not None:
        x = _rmsnorm_ref(x, norm_w, norm_eps, gemma_norm)
    def proj(w):
        return torch.nn.functional.linear(x.float(), w.float()).to(x.dtype).view(x.shape[0], -1, head_dim)

    q, k, v = proj(wq), proj(wk), proj(wv)
    if q_norm_w is not None:
        q, k = _rmsnorm_ref(q, q_norm_w, eps), _rmsnorm_ref(k, k_norm_w, eps)
    if cos is not None:
        c, s = cos[:, None, :], sin[:, None, :]

        def rot(t):
            t1, t2 = t[..., : head_dim // 2], t[..., head_dim // 2:]
            return torch.cat((-t2, t1), dim=-1)

        q, k = q * c + rot(q) * s, k * c + rot(k) * s
    return q, k, v


# ----------------------------------------------------------------------------------------------------------------
# Launchers


def _rows2(t, K, name):
    t2 = t.reshape(-1, K)
    if t2.stride(-1) != 1:
        raise ValueError(f"gemv: expected {name} with a unit last stride, got strides {tuple(t.stride())}")
    return t2


def _weights(ws, K, dtype):
    for w in ws:
        if w.dim() != 2 or w.shape[1] != K:
            raise ValueError(f"gemv: expected weights [N, {K}], got {[tuple(v.shape) for v in ws]}")
        if not w.is_contiguous():
            raise ValueError("gemv: expected contiguous weights (nn.Linear layout)")
        if w.dtype != dtype:
            raise ValueError(f"gemv: expected weights in {dtype}, got {w.dtype}")


def _batch_tiles(M: int, kw: dict) -> dict:
    """A launcher's keywords with the tl.dot path's own tile (DOT_BLOCK_N, DOT_BLOCK_K, DOT_SPLIT_K; 0: the
    stage's BLOCK_N / BLOCK_K / SPLIT_K, the FMA path's) in place of the stage's where this call of M rows takes
    tl.dot (`_dot_path`): batch 1 and a batch of rows then run each at their own tile from one config."""
    dot_kw = {k: kw.pop(k, 0) for k in ("DOT_BLOCK_N", "DOT_BLOCK_K", "DOT_SPLIT_K")}
    if _dot_path(M, kw.get("DOT", False), kw.get("FMA_MAX_M", MAX_FMA_M)):
        for k, v in dot_kw.items():
            if v:
                kw[k.removeprefix("DOT_")] = v
    return kw


def _norm_pass(x2: torch.Tensor, norm_w: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """x2's rows RMSNorm'd (HF's roundings, Gemma's with `gemma`) into a new [M, K] tensor of x2's dtype, one
    program a row (`_stream`'s NORM_PASS)."""
    M, K = x2.shape
    y = torch.empty_like(x2)
    launch(_row_norm_kernel, (M,), (x2, norm_w, y, K, x2.stride(0), y.stride(0), float(eps)),
           dict(GEMMA=bool(gemma), ACT_DTYPE=_TL.get(x2.dtype, tl.float32), BLOCK=min(1024, triton.next_power_of_2(K))),
           num_warps=4)
    return y


def _stream(x2, ws, *, norm_w=None, eps=0.0, direct_out=None, residual2=None, swiglu_up=None, BLOCK_N, BLOCK_K,
            SPLIT_K, num_warps, num_stages, DOT=False, PREFETCH=False, PDL=False, l2_prefetch=(), TMA=0,
            TMA_PRE=False, TMA_LATE=False, FMA_MAX_M=MAX_FMA_M, DOT_STAGES=DOT_STAGES, act="silu", gemma=False,
            NORM_PASS=False):
    """The weight-streaming pass over ws (1-3 weights side by side): fp32 partials [split, M, sum N], or with
    `direct_out` and no split the output itself (columns side by side; a residual only with one weight), or with
    `swiglu_up` too (ws = [gate], no split) silu(x @ gate.T) * (x @ up.T). Returns (partials or direct_out,
    split, 0 when direct). DOT: tl.dot over x padded to 16..64 rows (BLOCK_N raised to 16, BLOCK_K held to
    16..256: shared-memory stages); the DOT path also takes calls of more than FMA_MAX_M rows (`_dot_path`), all
    rows of up to MAX_ROWS in one program (`_rows_per_program`), more in blocks of MAX_ROWS. PREFETCH: two
    weight tiles in flight a program; PDL (implies PREFETCH): programmatic dependent launch. l2_prefetch: up to two
    (tensor, bytes) whose first bytes the pass asks the L2 for (`_gemv_kernel`'s L2PF). TMA (a pipeline depth, 0
    off): the weight tiles by TMA (`_gemv_tma_kernel`) where the pass fits it (`_tma_fits`; l2_prefetch then
    dropped), else the register pass; TMA_PRE / TMA_LATE: that kernel's PRE and LATE (with PDL). act: the paired
    pass's activation (ACTS); gemma: norm_w is Gemma's (the register pass only). NORM_PASS: where the norm
    prologue would normalise the rows tile by tile in every program (more than one row a program), a
    one-program-a-row pass (`_row_norm_kernel`, the same roundings) writes the normalised rows first and the GEMV
    streams against them without a prologue (one more launch)."""
    _check_cfg(BLOCK_N, BLOCK_K, SPLIT_K)
    _check_rows(FMA_MAX_M)
    M, K = x2.shape
    DOT = _dot_path(M, DOT, FMA_MAX_M)
    if DOT:  # pipelined by Triton (DOT_STAGES tiles in flight), not by the register prefetch
        BLOCK_N, BLOCK_K = _dot_tiles(BLOCK_N, BLOCK_K)
        num_stages, PREFETCH = max(1, int(DOT_STAGES)), False
    ns = [w.shape[0] for w in ws] + [0] * (3 - len(ws))
    nbs = [triton.cdiv(n, BLOCK_N) for n in ns]
    ntot = sum(ns)
    split, k_per = _split_of(K, BLOCK_K, SPLIT_K)
    direct = direct_out is not None and split == 1
    swiglu = swiglu_up is not None
    if swiglu and (not direct or len(ws) != 1):
        raise ValueError("gemv: the paired gate/up pass takes one gate weight and no K split")
    if act not in ACTS:
        raise ValueError(f"gemv: expected act in {list(ACTS)}, got {act!r}")
    if TMA and _tma_fits(M, K, ws, direct, DOT, BLOCK_N, BLOCK_K, ws[0].dtype) and (
            norm_w is None or (_norm_row(True, 1, K) and not gemma)):
        n = ws[0].shape[0]
        block = [BLOCK_N, BLOCK_K]
        a_desc = TensorDescriptor.from_tensor(ws[0], block)
        b_desc = TensorDescriptor.from_tensor(swiglu_up, block) if swiglu else a_desc
        ts = None if TIMELINE["buf"] is None else timeline_rows("swiglu_tma" if swiglu else "gemv_tma",
                                                                 triton.cdiv(n, BLOCK_N))
        _gemv_tma_kernel[(triton.cdiv(n, BLOCK_N),)](
            x2, x2 if norm_w is None else norm_w, a_desc, b_desc, direct_out,
            residual2 if residual2 is not None else direct_out, x2 if ts is None else ts, n, K, float(eps),
            PRO_NORM=norm_w is not None, HAS_RES=residual2 is not None, SWIGLU=swiglu,
            ACT_DTYPE=_TL.get(x2.dtype, tl.float32), RNE=interpreting(), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            STAGES=int(TMA), NORM_ROW=_norm_row(norm_w is not None, 1, K), PDL=pdl_on(PDL),
            PRE=bool(TMA_PRE), LATE=bool(TMA_LATE) and pdl_on(PDL), TIMELINE=ts is not None,
            GELU=act == "gelu_tanh", num_warps=num_warps, **pdl_launch(PDL))
        return direct_out, 0
    block_m = _rows_per_program(M, DOT)
    out = direct_out if direct else torch.empty((split, M, ntot), device=x2.device, dtype=torch.float32)
    r2 = residual2 if residual2 is not None else out
    w0, w1, w2 = (list(ws) + [ws[0], ws[0]])[:3]
    if swiglu:
        w1 = swiglu_up
    pf = _l2_targets(l2_prefetch)
    if norm_w is not None and NORM_PASS and not _norm_row(True, block_m, K):
        x2, norm_w = _norm_pass(x2, norm_w, eps, gemma), None
    grid = (sum(nbs), split, triton.cdiv(M, block_m))
    ts = None if TIMELINE["buf"] is None else timeline_rows(  # (off: one lookup on the launch path)
        "swiglu" if swiglu else ("gemv" if direct else "gemv_split"), math.prod(grid))
    launch(_gemv_kernel, grid, (
        x2, x2 if norm_w is None else norm_w, w0, w1, w2, out, r2, *(t if t is not None else x2 for t, _ in pf),
        x2 if ts is None else ts,
        *(n for _, n in pf), M, K, k_per, ns[0], ns[1], ns[2], nbs[0], nbs[0] + nbs[1], ntot,
        x2.stride(0), out.stride(-2) if direct else ntot, r2.stride(-2) if residual2 is not None else 0, float(eps)),
        dict(PRO_NORM=norm_w is not None, DIRECT=direct, HAS_RES=direct and residual2 is not None,
             EVEN_K=K % k_per == 0, ACT_DTYPE=_TL.get(x2.dtype, tl.float32), RNE=interpreting(),
             BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT=bool(DOT), UPCAST_DOT=bool(DOT) and interpreting(),
             DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", SWIGLU=swiglu,
             PREFETCH=bool(PREFETCH or (PDL and not DOT)), PDL=pdl_on(PDL),
             NORM_ROW=_norm_row(norm_w is not None, block_m, K), ONE_TILE=k_per == BLOCK_K,
             L2PF=sum(n > 0 for _, n in pf) if l2_prefetch_on(pf[0][1]) else 0, LANES=32 * num_warps,
             TIMELINE=ts is not None, GELU=act == "gelu_tanh", GEMMA=bool(gemma)),
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(PDL))
    return out, (0 if direct else split)


def gemv(x: torch.Tensor, w: torch.Tensor, *, residual: torch.Tensor | None = None, norm_w: torch.Tensor | None = None,
         eps: float = 1e-6, BLOCK_N: int = 16, BLOCK_K: int = 512, SPLIT_K: int = 1, num_warps: int = 4,
         num_stages: int = 1, DOT: bool = False, PREFETCH: bool = False, PDL: bool = False,
         l2_prefetch=(), TMA: int = 0, TMA_PRE: bool = False, TMA_LATE: bool = False,
         FMA_MAX_M: int = MAX_FMA_M, DOT_STAGES: int = DOT_STAGES, NORM_PASS: bool = False,
         DOT_BLOCK_N: int = 0, DOT_BLOCK_K: int = 0, DOT_SPLIT_K: int = 0) -> torch.Tensor:
    """x: [..., K] (decode: a few rows), w: [N, K] -> x @ w.T [..., N] in x's dtype; `residual` [..., N]: plus the
    residual (the output then in its dtype); `norm_w` [K]: x RMSNorm'd (eps) first, inside the GEMV. PREFETCH /
    PDL: `_gemv_kernel`'s; l2_prefetch: up to two (tensor, bytes or None for all) of a later kernel that the pass
    asks the L2 for (a hint: the result does not depend on it). TMA, TMA_PRE, TMA_LATE: `_stream`'s (batch 1 only).
    FMA_MAX_M: the most rows the FMA path takes; more take tl.dot (`_dot_path`), DOT_STAGES tiles in flight.
    NORM_PASS: `_stream`'s (the rows normalised in a pass of their own). DOT_BLOCK_N, DOT_BLOCK_K, DOT_SPLIT_K: the
    tile and K split where the call takes tl.dot (`_batch_tiles`; 0: BLOCK_N, BLOCK_K, SPLIT_K)."""
    K = x.shape[-1]
    _weights([w], K, x.dtype)
    N = w.shape[0]
    x2 = _rows2(x, K, "x")
    out_dtype = x.dtype if residual is None else residual.dtype
    r2 = None
    if residual is not None:
        if tuple(residual.shape) != (*x.shape[:-1], N):
            raise ValueError(f"gemv: expected residual {[*x.shape[:-1], N]}, got {tuple(residual.shape)}")
        r2 = _rows2(residual, N, "residual")
    y = torch.empty((x2.shape[0], N), device=x.device, dtype=out_dtype)
    if y.numel():
        kw = _batch_tiles(x2.shape[0], dict(
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, DOT=DOT, FMA_MAX_M=FMA_MAX_M, DOT_BLOCK_N=DOT_BLOCK_N,
            DOT_BLOCK_K=DOT_BLOCK_K, DOT_SPLIT_K=DOT_SPLIT_K))
        part, split = _stream(x2, [w], norm_w=norm_w, eps=eps, direct_out=y, residual2=r2, num_warps=num_warps,
                              num_stages=num_stages, PREFETCH=PREFETCH, PDL=PDL, l2_prefetch=l2_prefetch, TMA=TMA,
                              TMA_PRE=TMA_PRE, TMA_LATE=TMA_LATE, DOT_STAGES=DOT_STAGES, NORM_PASS=NORM_PASS, **kw)
        if split:
            blk = _reduce_block(N)
            launch(_reduce_kernel, (x2.shape[0], triton.cdiv(N, blk)), (
                part, y if r2 is None else r2, y, x2.shape[0], N, split, 0 if r2 is None else r2.stride(0),
                y.stride(0)), dict(HAS_RES=r2 is not None, ACT_DTYPE=_TL.get(x.dtype, tl.float32),
                                   RNE=interpreting(), BLOCK=blk, PDL=pdl_on(PDL)), **pdl_launch(PDL))
    return y.reshape(*x.shape[:-1], N)


def gemv_residual_rmsnorm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor | None,
                          eps: float = 1e-6, *, out_norm_w: torch.Tensor | None = None, out_eps: float = 1e-6,
                          gemma: bool = False, BLOCK_N: int = 16, BLOCK_K: int = 512, SPLIT_K: int = 1,
                          num_warps: int = 4, num_stages: int = 1, reduce_warps: int = 4, DOT: bool = False,
                          PREFETCH: bool = False, PDL: bool = False, l2_prefetch=(),
                          FMA_MAX_M: int = MAX_FMA_M, DOT_STAGES: int = DOT_STAGES, NORM_PASS: bool = False,
                          DOT_BLOCK_N: int = 0, DOT_BLOCK_K: int = 0, DOT_SPLIT_K: int = 0
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [..., K], w: [N, K], residual: [..., N], norm_w: [N] -> (h = residual + x @ w.T, RMSNorm(h) * norm_w),
    both in the residual's dtype: an o_proj with the residual add and post_attention_layernorm after it, or a
    down_proj with the next layer's input_layernorm. l2_prefetch: `gemv`'s. out_norm_w [N]: x @ w.T RMSNorm'd
    (out_eps) before the add (Gemma-2's post_attention / post_feedforward norm); norm_w None: no norm after it (the
    second value None); gemma: both norms Gemma's. NORM_PASS: accepted for a layer's shared stage keys; no
    prologue norm here. DOT_BLOCK_N, DOT_BLOCK_K, DOT_SPLIT_K: `gemv`'s."""
    K = x.shape[-1]
    _weights([w], K, x.dtype)
    N = w.shape[0]
    if tuple(residual.shape) != (*x.shape[:-1], N) or any(
            t is not None and t.shape != (N,) for t in (norm_w, out_norm_w)):
        raise ValueError(f"gemv_residual_rmsnorm: expected residual {[*x.shape[:-1], N]} and norm_w [{N}], got "
                         f"{tuple(residual.shape)}, {[getattr(t, 'shape', None) for t in (norm_w, out_norm_w)]}")
    if N > MAX_ROW:
        raise ValueError(f"gemv_residual_rmsnorm: expected N <= {MAX_ROW}, got {N}")
    x2, r2 = _rows2(x, K, "x"), _rows2(residual, N, "residual")
    M = x2.shape[0]
    h = torch.empty((M, N), device=x.device, dtype=residual.dtype)
    y = torch.empty((M, N), device=x.device, dtype=residual.dtype) if norm_w is not None else h
    if M:
        kw = _batch_tiles(M, dict(BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, DOT=DOT, FMA_MAX_M=FMA_MAX_M,
                                  DOT_BLOCK_N=DOT_BLOCK_N, DOT_BLOCK_K=DOT_BLOCK_K, DOT_SPLIT_K=DOT_SPLIT_K))
        part, split = _stream(x2, [w], num_warps=num_warps, num_stages=num_stages, PREFETCH=PREFETCH, PDL=PDL,
                              l2_prefetch=l2_prefetch, DOT_STAGES=DOT_STAGES, **kw)
        launch(_residual_rmsnorm_reduce_kernel, (M,), (
            part, r2, h if norm_w is None else norm_w, h if out_norm_w is None else out_norm_w, h, y, M, N, split,
            r2.stride(0), h.stride(0), y.stride(0), float(eps), float(out_eps)),
            dict(ACT_DTYPE=_TL.get(x.dtype, tl.float32), RES_DTYPE=_TL.get(residual.dtype, tl.float32),
                 RNE=interpreting(), BLOCK=triton.next_power_of_2(N), PDL=pdl_on(PDL),
                 OUT_NORM=out_norm_w is not None, HAS_NORM=norm_w is not None, GEMMA=bool(gemma)),
            num_warps=reduce_warps, **pdl_launch(PDL))
    lead = x.shape[:-1]
    return h.reshape(*lead, N), None if norm_w is None else y.reshape(*lead, N)


def gate_up_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, *, norm_w: torch.Tensor | None = None,
                   eps: float = 1e-6, BLOCK_N: int = 16, BLOCK_K: int = 512, SPLIT_K: int = 1, num_warps: int = 4,
                   num_stages: int = 1, DOT: bool = False, PREFETCH: bool = False, PDL: bool = False,
                   paired: bool = True, TMA: int = 0, TMA_PRE: bool = False, TMA_LATE: bool = False,
                   FMA_MAX_M: int = MAX_FMA_M, DOT_STAGES: int = DOT_STAGES, act: str = "silu",
                   NORM_PASS: bool = False, DOT_BLOCK_N: int = 0, DOT_BLOCK_K: int = 0,
                   DOT_SPLIT_K: int = 0) -> torch.Tensor:
    """x: [..., K], w_gate/w_up: [I, K] -> act(x @ w_gate.T) * (x @ w_up.T) [..., I], both weights in one pass
    (act: silu, or gelu_tanh for Gemma's MLP);
    `norm_w` [K]: x RMSNorm'd first inside the GEMV (post_attention_layernorm). Without a K split (FMA or tl.dot
    path alike) each program streams BLOCK_N / 2 rows of gate and the same rows of up and writes the product itself
    (`paired`: one launch, the same bytes and accumulator registers a program as an unpaired BLOCK_N-row program;
    BLOCK_N rows of each would double the fp32 accumulators and cut occupancy);
    else gate and up are blocks of one pass and a second launch takes the product of the sums. TMA (TMA_PRE,
    TMA_LATE): the paired pass's weight tiles by TMA (`_stream`'s, batch 1). NORM_PASS: `_stream`'s.
    DOT_BLOCK_N, DOT_BLOCK_K, DOT_SPLIT_K: `gemv`'s (DOT_BLOCK_N counts gate and up rows together, as BLOCK_N)."""
    K = x.shape[-1]
    _weights([w_gate, w_up], K, x.dtype)
    if w_up.shape != w_gate.shape:
        raise ValueError(f"gate_up_swiglu: expected w_up {tuple(w_gate.shape)}, got {tuple(w_up.shape)}")
    I = w_gate.shape[0]
    x2 = _rows2(x, K, "x")
    M = x2.shape[0]
    y = torch.empty((M, I), device=x.device, dtype=x.dtype)
    tiles = _batch_tiles(M, dict(BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, DOT=DOT, FMA_MAX_M=FMA_MAX_M,
                                 DOT_BLOCK_N=DOT_BLOCK_N, DOT_BLOCK_K=DOT_BLOCK_K, DOT_SPLIT_K=DOT_SPLIT_K))
    BLOCK_N, BLOCK_K, SPLIT_K = tiles["BLOCK_N"], tiles["BLOCK_K"], tiles["SPLIT_K"]
    _check_cfg(BLOCK_N, BLOCK_K, SPLIT_K)
    kw = dict(norm_w=norm_w, eps=eps, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, num_warps=num_warps,
              num_stages=num_stages, DOT=DOT, PREFETCH=PREFETCH, PDL=PDL, FMA_MAX_M=FMA_MAX_M,
              DOT_STAGES=DOT_STAGES, act=act, NORM_PASS=NORM_PASS)
    bk = _dot_tiles(BLOCK_N, BLOCK_K)[1] if _dot_path(M, DOT, FMA_MAX_M) else BLOCK_K  # the K tile _stream uses
    if M and paired and BLOCK_N >= 2 and _split_of(K, bk, SPLIT_K)[0] == 1:
        _stream(x2, [w_gate], direct_out=y, swiglu_up=w_up, **{**kw, "BLOCK_N": BLOCK_N // 2}, TMA=TMA,
                TMA_PRE=TMA_PRE, TMA_LATE=TMA_LATE)
    elif M:
        part, split = _stream(x2, [w_gate, w_up], **kw)
        blk = _reduce_block(I)
        launch(_swiglu_reduce_kernel, (M, triton.cdiv(I, blk)), (part, y, M, I, split, y.stride(0)),
               dict(ACT_DTYPE=_TL.get(x.dtype, tl.float32), RNE=interpreting(), BLOCK=blk,
                    PDL=pdl_on(PDL), GELU=act == "gelu_tanh"), **pdl_launch(PDL))
    return y.reshape(*x.shape[:-1], I)


def qkv_norm_rope(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, cos: torch.Tensor | None,
                  sin: torch.Tensor | None, head_dim: int, *, q_norm_w: torch.Tensor | None = None,
                  k_norm_w: torch.Tensor | None = None, eps: float = 1e-6, norm_w: torch.Tensor | None = None,
                  norm_eps: float = 1e-6, BLOCK_N: int = 16, BLOCK_K: int = 512,
                  SPLIT_K: int = 1, num_warps: int = 4, num_stages: int = 1, DOT: bool = False,
                  PREFETCH: bool = False, PDL: bool = False,
                  FMA_MAX_M: int = MAX_FMA_M, DOT_STAGES: int = DOT_STAGES, gemma_norm: bool = False,
                  NORM_PASS: bool = False, DOT_BLOCK_N: int = 0, DOT_BLOCK_K: int = 0, DOT_SPLIT_K: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [..., K] (M rows), wq: [Hq * D, K], wk/wv: [Hkv * D, K], cos/sin: [..., D] (the token's rotary table,
    HF's position_embeddings) or None -> q [M, Hq, D], k [M, Hkv, D], v [M, Hkv, D] (views of one buffer), with
    the per-head q/k RMSNorms (Qwen3, eps) when q_norm_w/k_norm_w [D] are given and the rotary embedding when cos
    is; `norm_w` [K]: x RMSNorm'd (norm_eps) first inside the GEMV (a decoder layer's input_layernorm). Without
    the q/k norms, the rotary embedding and a K split, the pass writes q/k/v itself (one launch). gemma_norm: the
    prologue norm is Gemma's (Gemma-2's input_layernorm). NORM_PASS: `_stream`'s. DOT_BLOCK_N, DOT_BLOCK_K,
    DOT_SPLIT_K: `gemv`'s."""
    K = x.shape[-1]
    _weights([wq, wk, wv], K, x.dtype)
    D = head_dim
    if D % 2 or wq.shape[0] % D or wk.shape[0] % D or wv.shape != wk.shape:
        raise ValueError(f"qkv_norm_rope: expected an even head_dim dividing wq {tuple(wq.shape)} and wk = wv "
                         f"{tuple(wk.shape)}, got head_dim {D}, wv {tuple(wv.shape)}")
    if (q_norm_w is None) != (k_norm_w is None) or (q_norm_w is not None and (q_norm_w.shape != (D,)
                                                                              or k_norm_w.shape != (D,))):
        raise ValueError(f"qkv_norm_rope: expected both q_norm_w and k_norm_w [{D}] or neither")
    x2 = _rows2(x, K, "x")
    M = x2.shape[0]
    hq, hkv = wq.shape[0] // D, wk.shape[0] // D
    c2 = s2 = None
    if cos is not None:
        c2, s2 = _rows2(cos, D, "cos"), _rows2(sin, D, "sin")
        if c2.shape[0] != M or s2.shape != c2.shape:
            raise ValueError(f"qkv_norm_rope: expected cos/sin [{M}, {D}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    ntot = (hq + 2 * hkv) * D
    y = torch.empty((M, ntot), device=x.device, dtype=x.dtype)
    plain = q_norm_w is None and c2 is None  # nothing per head after the projections
    if M:
        kw = _batch_tiles(M, dict(BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, DOT=DOT, FMA_MAX_M=FMA_MAX_M,
                                  DOT_BLOCK_N=DOT_BLOCK_N, DOT_BLOCK_K=DOT_BLOCK_K, DOT_SPLIT_K=DOT_SPLIT_K))
        part, split = _stream(x2, [wq, wk, wv], norm_w=norm_w, eps=norm_eps, direct_out=y if plain else None,
                              num_warps=num_warps, num_stages=num_stages, PREFETCH=PREFETCH, PDL=PDL,
                              DOT_STAGES=DOT_STAGES, gemma=gemma_norm, NORM_PASS=NORM_PASS, **kw)
    if M and split:
        launch(_qkv_reduce_kernel, (M, hq + 2 * hkv), (
            part, y if c2 is None else c2, y if s2 is None else s2, y if q_norm_w is None else q_norm_w,
            y if k_norm_w is None else k_norm_w, y, M, hq, hkv, split, ntot,
            0 if c2 is None else c2.stride(0), 0 if s2 is None else s2.stride(0), y.stride(0), float(eps), D // 2),
            dict(HAS_NORM=q_norm_w is not None, HAS_ROPE=c2 is not None, ACT_DTYPE=_TL.get(x.dtype, tl.float32),
                 RNE=interpreting(), BLOCK_H=triton.next_power_of_2(D // 2), PDL=pdl_on(PDL)),
            num_warps=1, **pdl_launch(PDL))
    q = y[:, : hq * D].view(M, hq, D)
    k = y[:, hq * D: (hq + hkv) * D].view(M, hkv, D)
    v = y[:, (hq + hkv) * D:].view(M, hkv, D)
    return q, k, v


__all__ = ["ACTS", "CONFIG_SPACE", "DEFAULT", "gate_up_swiglu", "gate_up_swiglu_ref", "gemv", "gemv_ref",
           "gemv_residual_rmsnorm", "gemv_residual_rmsnorm_ref", "qkv_norm_rope", "qkv_norm_rope_ref"]
