"""Host code of the Mamba2 templates (`Mamba2Mixer` and its block): in_proj -> [gate | xBC | dt] -> causal conv +
SiLU over xBC -> the SSD scan (chunked prefill) or state update (decode) -> the gated RMSNorm -> out_proj.

Numerics follow HF's torch path: the prefill scan output stays fp32 into the gated norm, the decode update's output
is in the activation dtype; the norm normalises over the whole intermediate size. Config keys: `lin_*`, `conv_*`,
`ssd_*`, `norm_*` (the gated norm's rows and warps), and for the fused decode `in_*`, `state_inplace`,
`out_gnorm_fused` (the gated norm inside out_proj's GEMV).
"""
from __future__ import annotations

import torch

from kernels_runtime.hosts import prefixed, static_value
from kernels_runtime.hosts.blocks import block_decode, block_prefill, mixer_decode, mixer_prefill
from kernels_runtime.hosts.ssm import copy
from kernels_runtime.ops.causal_conv1d import causal_conv1d, causal_conv1d_update
from kernels_runtime.ops.linear import linear
from kernels_runtime.ops.mamba_decode import gated_norm_linear, proj_conv
from kernels_runtime.ops.mask_rows import mask_rows
from kernels_runtime.ops.neg_exp import neg_exp
from kernels_runtime.ops.rmsnorm import gated_rmsnorm
from kernels_runtime.ops.ssd import ssd, ssd_state_update


def _gated_norm(config: dict):
    rows, warps = config["norm_ROWS"], config["norm_num_warps"]

    def norm(y, z, w, eps, out_dtype):
        # y, z: [R, N] row views (unit stride along N) -> [R, N] in out_dtype
        return gated_rmsnorm(y, z, w, eps, out_dtype=out_dtype, rows=rows, num_warps=warps)
    return norm


def _dims(weights, static):
    H = weights["A_log"].shape[0]
    P = int(static_value(static, "head_dim"))
    G = int(static_value(static, "n_groups"))
    N = int(static_value(static, "ssm_state_size", "state_size"))
    I = H * P
    return H, P, G, N, I, I + 2 * G * N  # ..., conv_dim


def _eps(static):
    return float(static_value(static, "norm.variance_epsilon", "layer_norm_epsilon"))


def _dt_limit(static):
    lim = static.get("time_step_limit") or (0.0, None)
    return 0.0 if lim[0] is None else float(lim[0]), float("inf") if lim[1] is None else float(lim[1])


def prefill_step(config: dict):
    """The prefill mixer over its own weight and static names; residual: a block's residual stream, added in
    out_proj's store."""
    lin, norm = prefixed(config, "lin_"), _gated_norm(config)
    conv = {"BLOCK_C": config["conv_BLOCK_C"], "BLOCK_L": config["conv_BLOCK_L"]}
    scan = {"BLOCK_T": config["ssd_BLOCK_T"], "BLOCK_P": config["ssd_BLOCK_P"], "num_warps": config["ssd_num_warps"]}

    def step(x, mask, weights, static, residual=None):
        # x: [B, L, Hd] (the mixer's input: its dtype is the activation dtype); mask: [B, L] or None
        act = x.dtype
        x = mask_rows(x, mask)
        Bsz, L, _ = x.shape
        H, P, G, N, I, CD = _dims(weights, static)
        proj = linear(x, weights["in_proj.weight"], weights.get("in_proj.bias"), **lin)  # [B, L, I + CD + H]
        gate, xbc, dt = proj[..., :I], proj[..., I:I + CD], proj[..., I + CD:]
        conv_w = weights["conv1d.weight"]  # [CD, 1, K]
        xc, conv_state = causal_conv1d(xbc.transpose(1, 2), conv_w.view(CD, conv_w.shape[-1]),
                                       weights.get("conv1d.bias"), silu=True, **conv)  # [B, CD, L]
        xc = mask_rows(xc, mask, channels_last=False).transpose(1, 2)  # [B, L, CD] view
        y, ssm_state = ssd(xc[..., :I].view(Bsz, L, H, P), dt, weights["A_log"],
                           xc[..., I:I + G * N].view(Bsz, L, G, N), xc[..., I + G * N:].view(Bsz, L, G, N),
                           D=weights["D"], dt_bias=weights["dt_bias"], dt_softplus=True, dt_limit=_dt_limit(static),
                           out_dtype=torch.float32, **scan,
                           A_is_log=True)  # y: [B, L, H, P] fp32 (as HF), state fp32
        yn = norm(y.view(Bsz * L, I), gate.reshape(Bsz * L, I), weights["norm.weight"], _eps(static), act)
        out = linear(yn.view(Bsz, L, I), weights["out_proj.weight"], weights.get("out_proj.bias"), residual=residual,
                     **lin)  # [B, L, Hd] (+ residual)
        return out, conv_state, ssm_state
    return step


def mamba2_decode(config: dict):
    """The unfused decode: in_proj, conv update, SSD state update, gated norm, out_proj, on copies of the states."""
    lin, norm, conv_c = prefixed(config, "lin_"), _gated_norm(config), config["conv_BLOCK_C"]
    scan = {"BLOCK_P": config["ssd_BLOCK_P"], "num_warps": config["ssd_num_warps"]}

    def entry(inputs, weights, state, static):
        mask = inputs.get("attention_mask")  # [B, 1] or None
        x = mask_rows(inputs["hidden_states"], mask)  # [B, 1, Hd]
        Bsz = x.shape[0]
        H, P, G, N, I, CD = _dims(weights, static)
        proj = linear(x[:, 0], weights["in_proj.weight"], weights.get("in_proj.bias"), **lin)  # [B, I + CD + H]
        gate, xbc, dt = proj[:, :I], proj[:, I:I + CD], proj[:, I + CD:]
        conv_w = weights["conv1d.weight"]  # [CD, 1, K]
        conv_state = copy(state["conv_state"])  # [B, CD, K], advanced in place below
        xc = causal_conv1d_update(xbc, conv_state, conv_w.view(CD, conv_w.shape[-1]), weights.get("conv1d.bias"),
                                  silu=True, BLOCK_C=conv_c)  # [B, CD]
        xc = mask_rows(xc.view(Bsz, 1, CD), mask).view(Bsz, CD)
        ssm_state = copy(state["ssm_state"])  # [B, H, P, N], advanced in place below
        y = ssd_state_update(ssm_state, xc[:, :I].view(Bsz, H, P), dt, neg_exp(weights["A_log"]),
                             xc[:, I:I + G * N].view(Bsz, G, N), xc[:, I + G * N:].view(Bsz, G, N), D=weights["D"],
                             dt_bias=weights["dt_bias"], dt_softplus=True, **scan)  # [B, H, P] in x's dtype
        yn = norm(y.view(Bsz, I), gate, weights["norm.weight"], _eps(static), x.dtype)
        out = linear(yn.view(Bsz, 1, I), weights["out_proj.weight"], weights.get("out_proj.bias"), **lin)
        return {"out": out, "state_out.conv_state": conv_state, "state_out.ssm_state": ssm_state}
    return entry


def fused_step(config: dict):
    """The fused decode step over the mixer's own weight and static names: four launches ([norm +] in_proj + conv
    update over xBC + SiLU), the SSD state update (A = -exp(A_log) in-kernel), the gated RMSNorm, out_proj; three
    with out_gnorm_fused. norm_w: a block's RMSNorm, folded into in_proj's kernel."""
    lin, norm, inplace, gnorm_fused = (prefixed(config, "lin_"), _gated_norm(config), config["state_inplace"],
                                       config["out_gnorm_fused"])
    in_conv = {"BLOCK_C": config["in_BLOCK_C"], "BLOCK_H": config["in_BLOCK_H"], "num_warps": config["in_num_warps"]}
    scan = {"BLOCK_P": config["ssd_BLOCK_P"], "num_warps": config["ssd_num_warps"]}
    gemv = {"GEMV_BLOCK_N": lin["GEMV_BLOCK_N"], "GEMV_BLOCK_K": lin["GEMV_BLOCK_K"],
            "num_warps": lin["num_warps"]} if gnorm_fused else {}

    def step(x, mask, weights, state, static, norm_w=None, norm_eps=0.0, residual=None):
        # x: [B, 1, Hd]; mask: [B, 1] or None
        Bsz = x.shape[0]
        act = norm_w.dtype if norm_w is not None else x.dtype  # the mixer's activation dtype
        H, P, G, N, I, CD = _dims(weights, static)
        conv_w = weights["conv1d.weight"]  # [CD, 1, K]
        proj, conv_state = proj_conv(x[:, 0], weights["in_proj.weight"], weights.get("in_proj.bias"),
                                     state["conv_state"], conv_w.view(CD, conv_w.shape[-1]), weights.get("conv1d.bias"),
                                     mask, conv_start=I, **in_conv, inplace=inplace, norm_w=norm_w, norm_eps=norm_eps)
        # proj: [B, I + CD + H]: gate | silu(conv(xBC)) | dt
        gate, xc, dt = proj[:, :I], proj[:, I:I + CD], proj[:, I + CD:]
        ssm_in = state["ssm_state"]
        ssm_state = ssm_in if inplace else torch.empty_like(ssm_in)
        y = ssd_state_update(ssm_in, xc[:, :I].view(Bsz, H, P), dt, weights["A_log"],
                             xc[:, I:I + G * N].view(Bsz, G, N), xc[:, I + G * N:].view(Bsz, G, N), D=weights["D"],
                             dt_bias=weights["dt_bias"], dt_softplus=True, out_state=None if inplace else ssm_state,
                             A_is_log=True, **scan)  # [B, H, P] in act
        if gnorm_fused:  # the gated norm inside out_proj's GEMV (+ the block's residual): one launch
            out = gated_norm_linear(y.view(Bsz, I), gate, weights["norm.weight"], _eps(static),
                                    weights["out_proj.weight"], weights.get("out_proj.bias"),
                                    None if residual is None else residual.view(Bsz, -1), out_dtype=act,
                                    **gemv).view(Bsz, 1, -1)
            return out, conv_state, ssm_state
        yn = norm(y.view(Bsz, I), gate, weights["norm.weight"], _eps(static), act)
        out = linear(yn.view(Bsz, 1, I), weights["out_proj.weight"], weights.get("out_proj.bias"), residual=residual,
                     **lin)  # [+ residual]: a block's add, in the store
        return out, conv_state, ssm_state
    return step


def mamba2_prefill(config: dict):
    return mixer_prefill(prefill_step(config))


def mamba2_block_prefill(config: dict, prefix: str = "mixer."):
    return block_prefill(prefill_step(config), prefix)


def mamba2_decode_fused(config: dict):
    return mixer_decode(fused_step(config))


def mamba2_block_decode_fused(config: dict, prefix: str = "mixer."):
    return block_decode(fused_step(config), prefix)
