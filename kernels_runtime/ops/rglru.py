"""RecurrentGemma RG-LRU (real-gated linear recurrent unit): the prefill scan and the one-token decode step.

Semantics are HF `RecurrentGemmaRglru` (transformers 5.17), per channel:
    i_t = sigmoid(x_t W_i + b_i),  r_t = sigmoid(x_t W_a + b_a)   (block-diagonal: one [w, w] matrix per head)
    log a_t = -8 r_t softplus(param),  m_t = sqrt(1 - a_t^2) (1 at a reset),  h_t = a_t (0 at a reset) h_{t-1} + m_t i_t x_t
with a reset where position_ids == 0. The state h is fp32 (HF keeps it so); the elementwise chain rounds to the input
dtype where HF's torch ops do. The two block-diagonal gate matmuls run as one torch `baddbmm` (cuBLAS) before the
kernel; the kernel fuses everything after them, and optionally the recurrent block's `* y_branch` multiply.
The recurrent block's temporal conv is `causal_conv1d(..., silu=False, state_len=K - 1)` (RecurrentGemma caches
K - 1 inputs, always has a bias and no activation) and `causal_conv1d_update` for decode.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels_runtime.ops._common import _TL, rnd, softplus

# Config space for the searcher. Not autotuned: the kernel writes the recurrent state, and decode calls update it in
# place (tuning launches would advance it several times).
RGLRU_CONFIGS: list[dict] = [{"BLOCK_W": bw, "num_warps": w} for bw in (64, 128, 256, 512) for w in (1, 2, 4)]


@triton.jit
def _rglru_kernel(
    # Pointers
    x_ptr, gi_ptr, ga_ptr, param_ptr, pos_ptr, h0_ptr, mul_ptr, y_ptr, hT_ptr,
    # Matrix dimensions
    L, W,
    # Strides
    stride_xb, stride_xl, stride_xw,
    stride_gb, stride_gl, stride_gw,
    stride_pb, stride_pl,
    stride_mb, stride_ml, stride_mw,
    stride_yb, stride_yl, stride_yw,
    stride_hb, stride_hw,
    # Meta-parameters
    HAS_H0: tl.constexpr, HAS_MUL: tl.constexpr, DTYPE: tl.constexpr, PDTYPE: tl.constexpr, ADTYPE: tl.constexpr,
    INPLACE: tl.constexpr, BLOCK_W: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask_w = offs_w < W
    # softplus(param) in the parameter's dtype; the decay chain in the promoted dtype ADTYPE (torch promotion)
    sp = rnd(softplus(tl.load(param_ptr + offs_w, mask=mask_w, other=0.0).to(tl.float32)), PDTYPE)
    if HAS_H0:
        h = tl.load(h0_ptr + pid_b * stride_hb + offs_w * stride_hw, mask=mask_w, other=0.0).to(tl.float32)
    else:
        h = tl.zeros((BLOCK_W,), dtype=tl.float32)
    for t in range(L):
        x = tl.load(x_ptr + pid_b * stride_xb + t * stride_xl + offs_w * stride_xw, mask=mask_w, other=0.0).to(tl.float32)
        g_offs = pid_b * stride_gb + t * stride_gl + offs_w * stride_gw
        gi = rnd(tl.sigmoid(tl.load(gi_ptr + g_offs, mask=mask_w, other=0.0).to(tl.float32)), DTYPE)
        ga = rnd(tl.sigmoid(tl.load(ga_ptr + g_offs, mask=mask_w, other=0.0).to(tl.float32)), DTYPE)
        reset = tl.load(pos_ptr + pid_b * stride_pb + t * stride_pl) == 0
        log_a = rnd(-8.0 * ga * sp, ADTYPE)
        a = rnd(tl.exp(log_a), ADTYPE)
        mult = rnd(tl.sqrt(rnd(1.0 - rnd(tl.exp(2.0 * log_a), ADTYPE), ADTYPE)), ADTYPE)
        mult = tl.where(reset, 1.0, rnd(mult, DTYPE))
        xn = rnd(rnd(x * gi, DTYPE) * mult, DTYPE)
        h = tl.where(reset, 0.0, a) * h + xn
        out = rnd(h, DTYPE)
        if HAS_MUL:
            out = out * tl.load(mul_ptr + pid_b * stride_mb + t * stride_ml + offs_w * stride_mw, mask=mask_w,
                                other=0.0).to(tl.float32)
        tl.store(y_ptr + pid_b * stride_yb + t * stride_yl + offs_w * stride_yw, out.to(y_ptr.dtype.element_ty),
                 mask=mask_w)
    if INPLACE:  # hT is h0: its load above before this store, whatever layout each one uses
        tl.debug_barrier()
    tl.store(hT_ptr + pid_b * stride_hb + offs_w * stride_hw, h, mask=mask_w)


def _gates(x, input_gate_weight, input_gate_bias, recurrent_gate_weight, recurrent_gate_bias):
    # x: [B, L, W] -> pre-sigmoid gates (HF's two baddbmm calls): 2 x [B, L, W]
    Bsz, L, W = x.shape
    H, bw = input_gate_bias.shape
    xh = x.reshape(Bsz * L, H, bw).permute(1, 0, 2)  # [H, B*L, bw]
    gi = torch.baddbmm(input_gate_bias[:, None, :], xh, input_gate_weight)
    ga = torch.baddbmm(recurrent_gate_bias[:, None, :], xh, recurrent_gate_weight)
    return gi.transpose(0, 1).reshape(Bsz, L, W), ga.transpose(0, 1).reshape(Bsz, L, W)


def rglru_ref(x, position_ids, recurrent_param, input_gate_weight, input_gate_bias, recurrent_gate_weight,
              recurrent_gate_bias, state=None, y_branch=None):
    """x: [B, L, W]; position_ids: [B, L]; recurrent_param: [W]; *_gate_weight: [H, W/H, W/H]; *_gate_bias: [H, W/H];
    state: [B, W] fp32 or None (zeros); y_branch: [B, L, W] or None -> (y [B, L, W] in x.dtype, state [B, W] fp32).

    HF `RecurrentGemmaRglru.forward` + `_rnn_scan` op for op (a decode step is L == 1 with a state), plus the
    optional `* y_branch` of the recurrent block."""
    reset = position_ids[:, :, None] == 0
    gi, ga = _gates(x, input_gate_weight, input_gate_bias, recurrent_gate_weight, recurrent_gate_bias)
    input_gate, recurrent_gate = torch.sigmoid(gi), torch.sigmoid(ga)
    log_a = -8.0 * recurrent_gate * F.softplus(recurrent_param)
    a = torch.exp(log_a)
    multiplier = torch.sqrt(1 - torch.exp(2 * log_a))
    multiplier = reset + ~reset * multiplier
    xn = (x * input_gate) * multiplier.type(x.dtype)
    a = a * ~reset
    h = torch.zeros(x[:, 0].shape, dtype=torch.float32, device=x.device) if state is None else state.float()
    y = torch.zeros_like(xn)
    for t in range(x.shape[1]):
        h = a[:, t].float() * h + xn[:, t].float()
        y[:, t] = h.type(x.dtype)
    if y_branch is not None:
        y = y * y_branch
    return y, h


def rglru(x, position_ids, recurrent_param, input_gate_weight, input_gate_bias, recurrent_gate_weight,
          recurrent_gate_bias, state=None, y_branch=None, *, BLOCK_W=128, num_warps=2, inplace=False):
    """x: [B, L, W]; position_ids: [B, L]; recurrent_param: [W]; *_gate_weight: [H, W/H, W/H]; *_gate_bias: [H, W/H];
    state: [B, W] (fp32) or None; y_branch: [B, L, W] or None (fused `* y_branch`)
    -> (y [B, L, W] in x.dtype, new state [B, W] fp32). Prefill and decode (L == 1) alike; `state` is read, never
    written: the new state is returned (HF replaces its `recurrent_states` tensor the same way), or with
    inplace=True written over `state` (contiguous fp32) and returned: no copy for whoever holds it."""
    if x.dim() != 3 or tuple(position_ids.shape) != tuple(x.shape[:2]):
        raise ValueError(f"rglru: expected x [B, L, W] and position_ids [B, L], got {tuple(x.shape)}, "
                         f"{tuple(position_ids.shape)}")
    Bsz, L, W = x.shape
    H, bw = input_gate_bias.shape
    if H * bw != W or tuple(input_gate_weight.shape) != (H, bw, bw) or tuple(recurrent_param.shape) != (W,):
        raise ValueError(f"rglru: expected gate weights [H, {W}/H, {W}/H], biases [H, {W}/H], param [{W}], got "
                         f"{tuple(input_gate_weight.shape)}, {tuple(input_gate_bias.shape)}, {tuple(recurrent_param.shape)}")
    if state is not None and tuple(state.shape) != (Bsz, W):
        raise ValueError(f"rglru: expected state [{Bsz}, {W}], got {tuple(state.shape)}")
    if inplace and (state is None or state.dtype != torch.float32 or not state.is_contiguous()):
        raise ValueError("rglru: inplace=True needs a contiguous fp32 state, got "
                         + ("none" if state is None else f"{state.dtype} strides {state.stride()}"))
    gi, ga = _gates(x, input_gate_weight, input_gate_bias, recurrent_gate_weight, recurrent_gate_bias)
    y = torch.empty((Bsz, L, W), device=x.device, dtype=x.dtype)
    hT = state if inplace else torch.empty((Bsz, W), device=x.device, dtype=torch.float32)
    mul = y_branch if y_branch is not None else x
    grid = (Bsz, triton.cdiv(W, BLOCK_W))
    _rglru_kernel[grid](
        x, gi, ga, recurrent_param, position_ids, state if state is not None else hT, mul, y, hT,
        L, W,
        *x.stride(), *gi.stride(), *position_ids.stride(), *mul.stride(), *y.stride(), *hT.stride(),
        HAS_H0=state is not None, HAS_MUL=y_branch is not None, DTYPE=_TL[x.dtype], PDTYPE=_TL[recurrent_param.dtype],
        ADTYPE=_TL[torch.promote_types(x.dtype, recurrent_param.dtype)], INPLACE=inplace,
        BLOCK_W=BLOCK_W, num_warps=num_warps,
    )
    return y, hT
