"""The entries of a state-space mixer and of its residual block (HF's MambaBlock / Mamba2Block: residual +
mixer(norm(x.to(norm dtype))), the residual in fp32 with residual_in_fp32), around a mixer's step.

A mixer's host module (kernels_runtime.hosts.ssm, .mamba2) builds its steps from the config, over the mixer's own
weight and static names:
- prefill: `step(x, mask, weights, static, residual=None) -> (out, conv_state, ssm_state)`;
- fused decode: `step(x, mask, weights, state, static, norm_w=None, norm_eps=0.0, residual=None)`, the block's
  RMSNorm folded into the mixer's first kernel (`norm_w`), the residual add into out_proj's store (`residual`).
The block's entries call the step on the part of the block's weights and static values under `prefix` ("mixer.").
"""
from __future__ import annotations

from kernels_runtime.hosts import prefixed
from kernels_runtime.ops.rmsnorm import rmsnorm


def _outputs(out, conv_state, ssm_state) -> dict:
    return {"out": out, "state_out.conv_state": conv_state, "state_out.ssm_state": ssm_state}


def mixer_prefill(step):
    def entry(inputs, weights, state, static):
        return _outputs(*step(inputs["hidden_states"], inputs.get("attention_mask"), weights, static))
    return entry


def block_prefill(step, prefix: str):
    def entry(inputs, weights, state, static):
        # HF's block over the prompt: one norm launch on the residual stream (cast to the norm's dtype inside it), the
        # mixer's kernels, the residual add in out_proj's store
        x = inputs["hidden_states"]  # [B, L, H]
        nw = weights["norm.weight"]
        xn = rmsnorm(x, nw, static["norm.variance_epsilon"], in_dtype=nw.dtype)
        residual = x.float() if static["residual_in_fp32"] else x  # a copy in the first block only
        return _outputs(*step(xn, inputs.get("attention_mask"), prefixed(weights, prefix), prefixed(static, prefix),
                              residual=residual))
    return entry


def mixer_decode(step):
    def entry(inputs, weights, state, static):
        return _outputs(*step(inputs["hidden_states"], inputs.get("attention_mask"), weights, state, static))
    return entry


def block_decode(step, prefix: str):
    def entry(inputs, weights, state, static):
        # HF's block: residual + mixer(norm(x.to(norm dtype))), the residual in fp32 with residual_in_fp32. The norm
        # runs inside the mixer's first kernel (it reads the whole row anyway), the add in out_proj's store.
        x = inputs["hidden_states"]  # [B, 1, H]: the residual stream (fp32 past the first block with residual_in_fp32)
        residual = x.float() if static["residual_in_fp32"] else x  # a copy in the first block only
        return _outputs(*step(x, inputs.get("attention_mask"), prefixed(weights, prefix), state,
                              prefixed(static, prefix), norm_w=weights["norm.weight"],
                              norm_eps=static["norm.variance_epsilon"], residual=residual))
    return entry
