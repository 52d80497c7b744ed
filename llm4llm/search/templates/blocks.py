"""ssm_block family: a state-space model's residual block (HF's MambaBlock / Mamba2Block: residual +
mixer(norm(x.to(norm dtype))), the residual in fp32 with residual_in_fp32) rendered from its mixer's fused decode
template: the block's RMSNorm goes into the mixer's first kernel (`proj_conv`'s `norm_w`), the residual add into
out_proj's store (`linear`'s `residual`): the mixer's four launches and nothing else. Each mixer template renders a
`_fused_step(x, mask, weights, state, static, norm_w=None, norm_eps=0.0, residual=None)` over the mixer's own weight
and static names; the block's entry calls it on the `mixer.` part of its own.
"""
from __future__ import annotations

from typing import Callable

from llm4llm.search.templates.base import header
from llm4llm.taskspec import TaskSpec

MIXER = "mixer."

_STATE_IN_PLACE = '''
# state_inplace: the kernels write the new states over the cache's (kernels_runtime then copies nothing and never
# falls back once this entry started); otherwise into fresh tensors, which the runtime copies into the cache
STATE_IN_PLACE = CONFIG["state_inplace"]
'''

# Both block entries read the mixer's part of the block's weights and static values through this.
_MIXER_PART = '''

def _mixer_part(d):
    # the mixer's weights and static values under the names its own template reads
    return {k[len("mixer."):]: v for k, v in d.items() if k.startswith("mixer.")}
'''

# Pasted into a block's rendered source, after the mixer's `_fused_step`.
BLOCK_ENTRY = _MIXER_PART + _STATE_IN_PLACE + '''


def entry(inputs, weights, state, static):
    # HF's block: residual + mixer(norm(x.to(norm dtype))), the residual in fp32 with residual_in_fp32. The norm runs
    # inside the mixer's first kernel (it reads the whole row anyway), the add in out_proj's store.
    x = inputs["hidden_states"]  # [B, 1, H]: the residual stream (fp32 past the first block with residual_in_fp32)
    residual = x.float() if static["residual_in_fp32"] else x  # a copy in the first block only
    out, conv_state, ssm_state = _fused_step(x, inputs.get("attention_mask"), _mixer_part(weights), state,
                                             _mixer_part(static), norm_w=weights["norm.weight"],
                                             norm_eps=static["norm.variance_epsilon"], residual=residual)
    return {"out": out, "state_out.conv_state": conv_state, "state_out.ssm_state": ssm_state}
'''

# Pasted into a mixer's rendered source after its `_fused_step`: the mixer's own entry.
MIXER_ENTRY = _STATE_IN_PLACE + '''


def entry(inputs, weights, state, static):
    out, conv_state, ssm_state = _fused_step(inputs["hidden_states"], inputs.get("attention_mask"), weights, state,
                                             static)
    return {"out": out, "state_out.conv_state": conv_state, "state_out.ssm_state": ssm_state}
'''


# The prefill counterparts: the mixer's `_prefill_step(x, mask, weights, static, residual=None)` (no state-in).
BLOCK_PREFILL_ENTRY = _MIXER_PART + '''

def entry(inputs, weights, state, static):
    # HF's block over the prompt: one norm launch on the residual stream (cast to the norm's dtype inside it), the
    # mixer's kernels, the residual add in out_proj's store
    x = inputs["hidden_states"]  # [B, L, H]
    nw = weights["norm.weight"]
    xn = rmsnorm(x, nw, static["norm.variance_epsilon"], in_dtype=nw.dtype)
    residual = x.float() if static["residual_in_fp32"] else x  # a copy in the first block only
    out, conv_state, ssm_state = _prefill_step(xn, inputs.get("attention_mask"), _mixer_part(weights),
                                               _mixer_part(static), residual=residual)
    return {"out": out, "state_out.conv_state": conv_state, "state_out.ssm_state": ssm_state}
'''

MIXER_PREFILL_ENTRY = '''

def entry(inputs, weights, state, static):
    out, conv_state, ssm_state = _prefill_step(inputs["hidden_states"], inputs.get("attention_mask"), weights, static)
    return {"out": out, "state_out.conv_state": conv_state, "state_out.ssm_state": ssm_state}
'''
BLOCK_PREFILL_IMPORT = "from kernels_runtime.ops.rmsnorm import rmsnorm"


def renderer(name: str, imports: list[str], *parts: str) -> Callable[[TaskSpec, dict], str]:
    """render_fn of a mixer or block template: the header, then the source parts (prelude, entry, step) in order."""

    def render(spec: TaskSpec, config: dict) -> str:
        return header(name, spec, imports, config) + "".join(parts)

    return render


def mixer_view(spec: TaskSpec) -> TaskSpec:
    """The block's task as its mixer's template sees it: the `mixer.` weights and static values without the prefix."""
    return spec.model_copy(update={
        "family": "ssm_mixer",
        "weight_names": [w[len(MIXER):] for w in spec.weight_names if w.startswith(MIXER)],
        "static": {k[len(MIXER):]: v for k, v in spec.static.items() if k.startswith(MIXER)},
    })


def block_applies(name: str, mixer_applies: Callable[[TaskSpec], str | None]) -> Callable[[TaskSpec], str | None]:
    """applies_fn of a block template: the block's own norm and flags, then its mixer's template on mixer_view."""

    def applies(spec: TaskSpec) -> str | None:
        if "norm.weight" not in spec.weight_names:
            return f"{name}: expected the block's norm.weight, got {spec.weight_names}"
        for key, kind in (("norm.variance_epsilon", float), ("residual_in_fp32", bool)):
            if not isinstance(spec.static.get(key), kind):
                return f"{name}: expected static {key} ({kind.__name__}), got {spec.static.get(key)!r}"
        if spec.phase == "decode" and set(spec.state_names) != {"conv_state", "ssm_state"}:
            return f"{name}: expected states conv_state and ssm_state, got {spec.state_names}"
        why = mixer_applies(mixer_view(spec))
        return f"{name}: mixer: {why}" if why else None

    return applies
