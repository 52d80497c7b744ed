"""Depthwise causal conv1d (Mamba, Mamba2, RecurrentGemma): prefill over a sequence and the one-token decode update.

The conv state is the last `S` inputs of each channel. HF Mamba/Mamba2 caches keep `S = K` (`conv_states`,
zero-padded on the left for short prompts); RecurrentGemma keeps `S = K - 1` (`conv1d_state`). Both layouts are
supported: `state_len` picks the prefill's returned width, the decode update reads it from `conv_state`.
Accumulation is fp32; the result is rounded to the weight dtype (HF convolves in it) before the optional SiLU,
then cast to the input dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels_runtime.ops._common import cast_out, interpreting, rnd

# Config space for the searcher (the launchers take these as kwargs; no autotune: the decode update writes state
# in place, and the prefill is cheap enough that a hand-picked default is within noise of the best).
CAUSAL_CONV1D_CONFIGS: list[dict] = [
    {"BLOCK_C": bc, "BLOCK_L": bl, "num_warps": w}
    for bc in (16, 32, 64)
    for bl in (32, 64, 128)
    for w in (2, 4)
]
CAUSAL_CONV1D_UPDATE_CONFIGS: list[dict] = [{"BLOCK_C": bc, "num_warps": w} for bc in (64, 128, 256) for w in (1, 2, 4)]


@triton.jit
def _causal_conv1d_kernel(
    # Pointers
    x_ptr, w_ptr, bias_ptr, y_ptr, state_ptr,
    # Matrix dimensions
    C, L, S,
    # Strides
    stride_xb, stride_xc, stride_xl,
    stride_wc, stride_wk,
    stride_yb, stride_yc, stride_yl,
    stride_sb, stride_sc, stride_ss,
    # Meta-parameters
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_STATE: tl.constexpr, RNE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    pid_l = tl.program_id(2)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    mask_c = offs_c < C
    x_base = x_ptr + pid_b * stride_xb + offs_c[:, None] * stride_xc
    acc = tl.zeros((BLOCK_C, BLOCK_L), dtype=tl.float32)
    for k in tl.static_range(K):
        # y[t] = sum_k w[k] * x[t - (K - 1) + k]; positions before 0 are the zero padding
        src = offs_l - (K - 1) + k
        m = mask_c[:, None] & (src[None, :] >= 0) & (src[None, :] < L)
        xk = tl.load(x_base + src[None, :] * stride_xl, mask=m, other=0.0).to(tl.float32)
        wk = tl.load(w_ptr + offs_c * stride_wc + k * stride_wk, mask=mask_c, other=0.0).to(tl.float32)
        acc += wk[:, None] * xk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[:, None]
    # HF convolves in the weight dtype (the result rounded to it), then applies the SiLU to that tensor
    acc = rnd(acc, w_ptr.dtype.element_ty)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    y_ptrs = y_ptr + pid_b * stride_yb + offs_c[:, None] * stride_yc + offs_l[None, :] * stride_yl
    tl.store(y_ptrs, cast_out(acc, y_ptr.dtype.element_ty, RNE), mask=mask_c[:, None] & (offs_l[None, :] < L))
    if HAS_STATE:
        if pid_l == 0:
            # final state: the last S inputs, zero where the sequence is shorter than S
            offs_s = tl.arange(0, BLOCK_S)
            src_s = L - S + offs_s
            m_s = mask_c[:, None] & (src_s[None, :] >= 0) & (offs_s[None, :] < S)
            xs = tl.load(x_base + src_s[None, :] * stride_xl, mask=m_s, other=0.0)
            s_ptrs = state_ptr + pid_b * stride_sb + offs_c[:, None] * stride_sc + offs_s[None, :] * stride_ss
            tl.store(s_ptrs, xs.to(state_ptr.dtype.element_ty), mask=mask_c[:, None] & (offs_s[None, :] < S))


@triton.jit
def _causal_conv1d_update_kernel(
    # Pointers
    x_ptr, state_ptr, w_ptr, bias_ptr, y_ptr,
    # Matrix dimensions
    C, S,
    # Strides
    stride_xb, stride_xc,
    stride_sb, stride_sc, stride_ss,
    stride_wc, stride_wk,
    stride_yb, stride_yc,
    # Meta-parameters
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, RNE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    x = tl.load(x_ptr + pid_b * stride_xb + offs_c * stride_xc, mask=mask_c, other=0.0)  # [BLOCK_C]
    s_base = state_ptr + pid_b * stride_sb + offs_c[:, None] * stride_sc
    # window = (old state, x)[S + 1 - K:], i.e. the last K of the S + 1 values
    offs_k = tl.arange(0, BLOCK_K)
    idx = S + 1 - K + offs_k
    mk = mask_c[:, None] & (offs_k[None, :] < K) & (idx[None, :] < S)
    win = tl.load(s_base + idx[None, :] * stride_ss, mask=mk, other=0.0).to(tl.float32)
    win = tl.where(idx[None, :] == S, x.to(tl.float32)[:, None], win)
    w = tl.load(w_ptr + offs_c[:, None] * stride_wc + offs_k[None, :] * stride_wk,
                mask=mask_c[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
    acc = tl.sum(win * w, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    # HF convolves in the weight dtype (the result rounded to it), then applies the SiLU to that tensor
    acc = rnd(acc, w_ptr.dtype.element_ty)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + pid_b * stride_yb + offs_c * stride_yc, cast_out(acc, y_ptr.dtype.element_ty, RNE), mask=mask_c)
    # shift the state left by one and append x, in place: every thread's loads of the row before any thread's store
    # (the shift moves values across threads; a program owns whole rows, so programs do not race)
    offs_s = tl.arange(0, BLOCK_S)
    ms = mask_c[:, None] & (offs_s[None, :] < S)
    shifted = tl.load(s_base + (offs_s[None, :] + 1) * stride_ss, mask=ms & (offs_s[None, :] + 1 < S), other=0.0)
    shifted = tl.where(offs_s[None, :] == S - 1, x[:, None].to(shifted.dtype), shifted)
    tl.debug_barrier()
    tl.store(s_base + offs_s[None, :] * stride_ss, shifted, mask=ms)


def causal_conv1d_ref(x, weight, bias=None, silu=False, state_len=None):
    """x: [B, C, L], weight: [C, K], bias: [C] or None -> (y [B, C, L] in x.dtype, state [B, C, S] in x.dtype).

    Mirrors HF `causal_conv1d_fn` (conv in the weight dtype, then the optional SiLU, cast to x.dtype) and the cache's
    conv state (the last `S` inputs, zero-padded on the left; `S = state_len or K`)."""
    _, C, L = x.shape
    K = weight.shape[-1]
    S = K if state_len is None else state_len
    y = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, padding=K - 1, groups=C)[:, :, :L]
    if silu:
        y = F.silu(y)
    state = F.pad(x, (max(S - L, 0), 0))[:, :, -S:] if S > 0 else x[:, :, :0]
    return y.to(x.dtype), state.contiguous()


def causal_conv1d_update_ref(x, conv_state, weight, bias=None, silu=False):
    """x: [B, C], conv_state: [B, C, S] (S >= K - 1, updated in place), weight: [C, K], bias: [C] -> y [B, C].

    Mirrors HF `causal_conv1d_update`: the conv result rounded to the weight dtype, then the optional SiLU."""
    K = weight.shape[-1]
    full = torch.cat([conv_state, x[:, :, None]], dim=-1)  # [B, C, S + 1]
    conv_state.copy_(full[:, :, 1:])
    y = (full[:, :, -K:].float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    y = y.to(weight.dtype).float()  # HF convolves in the weight dtype, then applies the SiLU to that result
    if silu:
        y = F.silu(y)
    return y.to(x.dtype)


def _check_conv_args(x, weight, bias, C):
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"causal_conv1d: expected weight [C={C}, K], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"causal_conv1d: expected bias [{C}], got {tuple(bias.shape)}")
    if x.device != weight.device:
        raise ValueError(f"causal_conv1d: expected x and weight on one device, got {x.device} and {weight.device}")


def causal_conv1d(x, weight, bias=None, silu=False, state_len=None, *, BLOCK_C=32, BLOCK_L=64, num_warps=4):
    """x: [B, C, L] (any strides), weight: [C, K], bias: [C] or None -> (y [B, C, L], state [B, C, S]).

    `state_len` (default K) is the width of the returned conv state: K for HF Mamba/Mamba2, K - 1 for
    RecurrentGemma. Pass `state_len=0` to skip the state."""
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: expected x [B, C, L], got {tuple(x.shape)}")
    B, C, L = x.shape
    _check_conv_args(x, weight, bias, C)
    K = weight.shape[-1]
    S = K if state_len is None else state_len
    y = torch.empty((B, C, L), device=x.device, dtype=x.dtype)
    state = torch.empty((B, C, S), device=x.device, dtype=x.dtype)
    grid = (B, triton.cdiv(C, BLOCK_C), triton.cdiv(L, BLOCK_L))
    _causal_conv1d_kernel[grid](
        x, weight, bias if bias is not None else weight, y, state,
        C, L, S,
        *x.stride(), *weight.stride(), *y.stride(), *state.stride(),
        K=K, HAS_BIAS=bias is not None, SILU=silu, HAS_STATE=S > 0, RNE=interpreting(),
        BLOCK_C=BLOCK_C, BLOCK_L=BLOCK_L, BLOCK_S=triton.next_power_of_2(max(S, 1)), num_warps=num_warps,
    )
    return y, state


def causal_conv1d_update(x, conv_state, weight, bias=None, silu=False, *, BLOCK_C=128, num_warps=2):
    """x: [B, C], conv_state: [B, C, S] updated in place (S >= K - 1), weight: [C, K], bias: [C] -> y [B, C].

    Not autotuned: the kernel shifts `conv_state` in place, so repeated tuning launches would corrupt it."""
    if x.dim() != 2:
        raise ValueError(f"causal_conv1d_update: expected x [B, C], got {tuple(x.shape)}")
    B, C = x.shape
    _check_conv_args(x, weight, bias, C)
    K = weight.shape[-1]
    if conv_state.dim() != 3 or conv_state.shape[:2] != (B, C) or conv_state.shape[2] < K - 1:
        raise ValueError(f"causal_conv1d_update: expected conv_state [{B}, {C}, >= {K - 1}], got {tuple(conv_state.shape)}")
    S = conv_state.shape[2]
    y = torch.empty((B, C), device=x.device, dtype=x.dtype)
    grid = (B, triton.cdiv(C, BLOCK_C))
    _causal_conv1d_update_kernel[grid](
        x, conv_state, weight, bias if bias is not None else weight, y,
        C, S,
        *x.stride(), *conv_state.stride(), *weight.stride(), *y.stride(),
        K=K, HAS_BIAS=bias is not None, SILU=silu, RNE=interpreting(),
        BLOCK_C=BLOCK_C, BLOCK_S=triton.next_power_of_2(S), BLOCK_K=triton.next_power_of_2(K), num_warps=num_warps,
    )
    return y
