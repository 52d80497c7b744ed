"""Candidate from template ssm_mixer.mamba_decode_fused for a ssm_mixer/decode task (bfloat16)."""
import torch
import triton
import triton.language as tl
from kernels_runtime.ops.linear import linear
from kernels_runtime.ops.mamba_decode import mamba_dt_state_update, mamba_in_proj_conv

CONFIG = {'in_BLOCK_C': 16, 'in_BLOCK_H': 128, 'in_num_warps': 8, 'lin_GEMV_BLOCK_K': 128, 'lin_GEMV_BLOCK_N': 32, 'lin_GEMV_SPLIT_K': 8, 'lin_num_stages': 1, 'lin_num_warps': 8, 'ssu_BLOCK_D': 8, 'ssu_num_warps': 1, 'ssu_xproj_fused': False, 'state_inplace': True}

def _static(static, *names):
    for n in names:
        if n in static:
            return static[n]
    raise KeyError(f"static: expected one of {names}, got {sorted(static)}")
LIN = {k[4:]: v for k, v in CONFIG.items() if k.startswith('lin_')}

# state_inplace: the kernels write the new states over the cache's (kernels_runtime then copies nothing and never
# falls back once this entry started); otherwise into fresh tensors, which the runtime copies into the cache
STATE_IN_PLACE = CONFIG["state_inplace"]



def entry(inputs, weights, state, static):
    out, conv_state, ssm_state = _fused_step(inputs["hidden_states"], inputs.get("attention_mask"), weights, state,
                                             static)
    return {"out": out, "state_out.conv_state": conv_state, "state_out.ssm_state": ssm_state}


def _fused_step(x, mask, weights, state, static, norm_w=None, norm_eps=0.0, residual=None):
    # four launches: ([norm +] in_proj + conv update + SiLU), x_proj, (dt_proj + state update + skip + gate), out_proj;
    # three with ssu_xproj_fused (x_proj inside the state update)
    # x: [B, 1, H]; mask: [B, 1] or None
    conv_w = weights["conv1d.weight"]  # [I, 1, K]
    xc, z, conv_state = mamba_in_proj_conv(
        x[:, 0], weights["in_proj.weight"], weights.get("in_proj.bias"), state["conv_state"],
        conv_w.view(conv_w.shape[0], conv_w.shape[-1]), weights.get("conv1d.bias"), mask,
        BLOCK_C=CONFIG["in_BLOCK_C"], BLOCK_H=CONFIG["in_BLOCK_H"], num_warps=CONFIG["in_num_warps"],
        inplace=STATE_IN_PLACE, norm_w=norm_w, norm_eps=norm_eps)
    fused = CONFIG["ssu_xproj_fused"]  # x_proj inside the state update's launch (its own GEMV launch otherwise)
    p = None if fused else linear(xc, weights["x_proj.weight"], **LIN)  # [B, R + 2N]
    y, ssm_state = mamba_dt_state_update(
        p, weights["dt_proj.weight"], weights["dt_proj.bias"], weights["A_log"], weights["D"], xc, z,
        state["ssm_state"], BLOCK_D=CONFIG["ssu_BLOCK_D"], num_warps=CONFIG["ssu_num_warps"], inplace=STATE_IN_PLACE,
        x_proj_w=weights["x_proj.weight"] if fused else None)
    out = linear(y.view(y.shape[0], 1, y.shape[1]), weights["out_proj.weight"], weights.get("out_proj.bias"),
                 residual=residual, **LIN)  # [+ residual]: a block's add, in the store
    return out, conv_state, ssm_state
