"""Host code of the Mamba (v1) templates (`MambaMixer`, Falcon-Mamba's, and their blocks): in_proj -> causal conv +
SiLU -> x_proj, dt_proj -> selective scan (prefill) or state update (decode) -> out_proj. `copy` (a state-in copied
before an in-place update: a candidate never modifies its inputs) is shared with the Mamba2 and RG-LRU hosts.

Config keys: `lin_*` (every projection's linear), `conv_*`, `scan_*` (prefill and the unfused decode), `in_*`, `ssu_*`
(the fused decode's two kernels), `xproj_rms` (Falcon-Mamba's weightless RMSNorms on dt_low, B and C, in fp32),
`state_inplace` (the fused decode's kernels write the new states over the cache's).
"""
from __future__ import annotations

import torch

from kernels_runtime.hosts import prefixed, static_value
from kernels_runtime.hosts.blocks import block_decode, block_prefill, mixer_decode, mixer_prefill
from kernels_runtime.ops.bcdt_rmsnorm import bcdt_rmsnorm
from kernels_runtime.ops.causal_conv1d import causal_conv1d, causal_conv1d_update
from kernels_runtime.ops.linear import linear
from kernels_runtime.ops.mamba_decode import mamba_dt_state_update, mamba_in_proj_conv
from kernels_runtime.ops.mask_rows import mask_rows
from kernels_runtime.ops.neg_exp import neg_exp
from kernels_runtime.ops.selective_scan import selective_scan, selective_state_update

RMS_EPS = ("rms_eps", "dt_layernorm.eps")  # Falcon-Mamba's mixer records its norms' eps as one of these


def copy(t):
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _ssm_params(config: dict):
    """xc: [..., I] -> dt [..., I] (no bias: the scan adds dt_proj.bias in fp32, as HF does), B, C [..., N]."""
    lin, rms = prefixed(config, "lin_"), config["xproj_rms"]

    def params(xc, weights, static):
        N = weights["A_log"].shape[1]
        R = weights["dt_proj.weight"].shape[1]
        p = linear(xc, weights["x_proj.weight"], **lin)  # [..., R + 2N]
        if rms:  # Falcon-Mamba: weightless RMSNorms on dt_low, B and C, in fp32 (one launch on p)
            p = bcdt_rmsnorm(p, R, N, float(static_value(static, *RMS_EPS)))
        dt = linear(p[..., :R], weights["dt_proj.weight"], **lin)
        return dt, p[..., R:R + N], p[..., R + N:]
    return params


def prefill_step(config: dict):
    """The prefill mixer over its own weight and static names; residual: a block's residual stream, added in
    out_proj's store."""
    lin, params = prefixed(config, "lin_"), _ssm_params(config)
    conv = {"BLOCK_C": config["conv_BLOCK_C"], "BLOCK_L": config["conv_BLOCK_L"]}
    scan = {"BLOCK_D": config["scan_BLOCK_D"], "num_warps": config["scan_num_warps"],
            "BLOCK_T": config.get("scan_BLOCK_T", 0)}

    def step(x, mask, weights, static, residual=None):
        # x: [B, L, H]; mask: [B, L] or None
        x = mask_rows(x, mask)
        I = weights["in_proj.weight"].shape[0] // 2
        proj = linear(x, weights["in_proj.weight"], weights.get("in_proj.bias"), **lin)  # [B, L, 2I]
        xs, gate = proj[..., :I].transpose(1, 2), proj[..., I:].transpose(1, 2)  # [B, I, L] views
        conv_w = weights["conv1d.weight"]  # [I, 1, K]
        xc, conv_state = causal_conv1d(xs, conv_w.view(I, conv_w.shape[-1]), weights.get("conv1d.bias"), silu=True,
                                       **conv)  # [B, I, L]
        xc = mask_rows(xc, mask, channels_last=False)
        dt, Bm, Cm = params(xc.transpose(1, 2), weights, static)  # [B, L, I], [B, L, N], [B, L, N]
        # A = -exp(A_log) in the kernel; D and the dt bias read as fp32 there (HF's .float() copies, no launches here)
        y, ssm_state = selective_scan(xc, dt.transpose(1, 2), weights["A_log"], Bm.transpose(1, 2),
                                      Cm.transpose(1, 2), D=weights["D"], z=gate,
                                      delta_bias=weights["dt_proj.bias"], delta_softplus=True, **scan,
                                      A_is_log=True)  # [B, I, L]
        out = linear(y.transpose(1, 2), weights["out_proj.weight"], weights.get("out_proj.bias"), residual=residual,
                     **lin)  # [B, L, H] (+ residual)
        # the cache keeps the scan's final state as it comes (fp32: HF's discretisation runs in fp32)
        return out, conv_state, ssm_state
    return step


def fused_step(config: dict):
    """The fused decode step over the mixer's own weight and static names: four launches ([norm +] in_proj + conv
    update + SiLU), x_proj, (dt_proj + state update + skip + gate), out_proj; three with ssu_xproj_fused (x_proj
    inside the state update). norm_w: a block's RMSNorm, folded into in_proj's kernel."""
    lin, inplace, rms = prefixed(config, "lin_"), config["state_inplace"], config["xproj_rms"]
    in_conv = {"BLOCK_C": config["in_BLOCK_C"], "BLOCK_H": config["in_BLOCK_H"], "num_warps": config["in_num_warps"]}
    ssu = {"BLOCK_D": config["ssu_BLOCK_D"], "num_warps": config["ssu_num_warps"]}
    fused = config["ssu_xproj_fused"]  # x_proj inside the state update's launch (its own GEMV launch otherwise)

    def step(x, mask, weights, state, static, norm_w=None, norm_eps=0.0, residual=None):
        # x: [B, 1, H]; mask: [B, 1] or None
        conv_w = weights["conv1d.weight"]  # [I, 1, K]
        xc, z, conv_state = mamba_in_proj_conv(
            x[:, 0], weights["in_proj.weight"], weights.get("in_proj.bias"), state["conv_state"],
            conv_w.view(conv_w.shape[0], conv_w.shape[-1]), weights.get("conv1d.bias"), mask, **in_conv,
            inplace=inplace, norm_w=norm_w, norm_eps=norm_eps)
        p = None if fused else linear(xc, weights["x_proj.weight"], **lin)  # [B, R + 2N]
        y, ssm_state = mamba_dt_state_update(
            p, weights["dt_proj.weight"], weights["dt_proj.bias"], weights["A_log"], weights["D"], xc, z,
            state["ssm_state"], **ssu, inplace=inplace, x_proj_w=weights["x_proj.weight"] if fused else None,
            # Falcon-Mamba's dt/B/C RMSNorms, applied in fp32 as the kernel reads x_proj's output
            rms_eps=float(static_value(static, *RMS_EPS)) if rms else None)
        out = linear(y.view(y.shape[0], 1, y.shape[1]), weights["out_proj.weight"], weights.get("out_proj.bias"),
                     residual=residual, **lin)  # [+ residual]: a block's add, in the store
        return out, conv_state, ssm_state
    return step


def mamba_decode(config: dict):
    """The unfused decode: in_proj, conv update, x_proj, dt_proj, state update, out_proj, on copies of the states."""
    lin, params, conv_c = prefixed(config, "lin_"), _ssm_params(config), config["conv_BLOCK_C"]
    scan = {"BLOCK_D": config["scan_BLOCK_D"], "num_warps": config["scan_num_warps"]}

    def entry(inputs, weights, state, static):
        mask = inputs.get("attention_mask")  # [B, 1] or None
        x = mask_rows(inputs["hidden_states"], mask)  # [B, 1, H]
        I = weights["in_proj.weight"].shape[0] // 2
        proj = linear(x[:, 0], weights["in_proj.weight"], weights.get("in_proj.bias"), **lin)  # [B, 2I]
        xs, gate = proj[:, :I], proj[:, I:]
        conv_w = weights["conv1d.weight"]  # [I, 1, K]
        conv_state = copy(state["conv_state"])  # [B, I, K], advanced in place below
        xc = causal_conv1d_update(xs, conv_state, conv_w.view(I, conv_w.shape[-1]), weights.get("conv1d.bias"),
                                  silu=True, BLOCK_C=conv_c)  # [B, I]
        xc = mask_rows(xc.view(xc.shape[0], 1, I), mask).view(xc.shape[0], I)
        dt, Bm, Cm = params(xc, weights, static)  # [B, I], [B, N], [B, N]
        ssm_state = copy(state["ssm_state"])  # [B, I, N]
        y = selective_state_update(ssm_state, xc, dt, neg_exp(weights["A_log"]), Bm, Cm, D=weights["D"], z=gate,
                                   dt_bias=weights["dt_proj.bias"].float(), dt_softplus=True, **scan)  # [B, I]
        out = linear(y.view(y.shape[0], 1, I), weights["out_proj.weight"], weights.get("out_proj.bias"), **lin)
        return {"out": out, "state_out.conv_state": conv_state, "state_out.ssm_state": ssm_state}
    return entry


def mamba_prefill(config: dict):
    return mixer_prefill(prefill_step(config))


def mamba_block_prefill(config: dict, prefix: str = "mixer."):
    return block_prefill(prefill_step(config), prefix)


def mamba_decode_fused(config: dict):
    return mixer_decode(fused_step(config))


def mamba_block_decode_fused(config: dict, prefix: str = "mixer."):
    return block_decode(fused_step(config), prefix)
