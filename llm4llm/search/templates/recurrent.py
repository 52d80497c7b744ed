"""recurrent_block family, RecurrentGemma `RecurrentGemmaRecurrentBlock` (Griffin/Hawk):
y = gelu_tanh(linear_y(x)) (Triton linear with the GELU epilogue), x = linear_x(x) -> temporal conv (causal_conv1d
with bias, no activation, state_len K - 1 in prefill; causal_conv1d_update in decode) -> RG-LRU (kernels_runtime.
ops.rglru, with the `* y` multiply fused) -> linear_out. The host code is kernels_runtime.hosts.recurrent.

Decode updates the conv and RG-LRU states in place by default (`state_inplace`; the runtime then copies nothing);
otherwise the conv state is copied before the in-place conv update and the RG-LRU op returns its new fp32 state
without writing the old one. Limits: a multi-token call continuing a cached state (chunked prefill) is out of scope (the
task would carry state); the GELU variants are the tanh approximation (RecurrentGemma's `gelu_pytorch_tanh`) and erf.
"""
from __future__ import annotations

from llm4llm.search.templates._linear import LINEAR_OP, linear_default, linear_space, occupancy_seeds
from llm4llm.search.templates.base import Template, host_source
from llm4llm.search.templates.blocks import STATE_IN_PLACE
from llm4llm.taskspec import TaskSpec

CONV = ("kernels_runtime.ops.causal_conv1d", "causal_conv1d")
CONV_UPDATE = ("kernels_runtime.ops.causal_conv1d", "causal_conv1d_update")
RGLRU = ("kernels_runtime.ops.rglru", "rglru")
RG_WEIGHTS = {"linear_y.weight", "linear_x.weight", "linear_out.weight", "conv_1d.weight", "rg_lru.recurrent_param",
              "rg_lru.input_gate_weight", "rg_lru.input_gate_bias", "rg_lru.recurrent_gate_weight",
              "rg_lru.recurrent_gate_bias"}
# the block's act_fn class (static `act_fn.__class__`) -> the linear op's epilogue
ACTS = {"GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh",
        "GELUActivation": "gelu"}


def _act(spec: TaskSpec) -> str | None:
    return ACTS.get(spec.static.get("act_fn.__class__", "GELUTanh"))


def _applies(spec: TaskSpec) -> str | None:
    if not RG_WEIGHTS <= set(spec.weight_names):
        return f"recurrent_block.rglru: expected weights {sorted(RG_WEIGHTS)}, got {spec.weight_names}"
    if not {"input_states", "position_ids"} <= set(spec.input_names):
        return f"recurrent_block.rglru: expected inputs input_states and position_ids, got {spec.input_names}"
    if _act(spec) is None:
        return f"recurrent_block.rglru: expected a GELU act_fn, got {spec.static.get('act_fn.__class__')!r}"
    if spec.phase == "prefill" and spec.state_names:
        return "recurrent_block.rglru: a multi-token call continuing a cached state (chunked prefill) is out of scope"
    if spec.phase == "decode" and not {"conv_state", "rg_lru_state"} <= set(spec.state_names):
        return f"recurrent_block.rglru: decode expects conv_state and rg_lru_state, got {spec.state_names}"
    return None


def _space(spec: TaskSpec) -> dict[str, list]:
    if spec.phase == "decode":
        ops = {"conv_BLOCK_C": [64, 128, 256]}
    else:
        ops = {"conv_BLOCK_C": [16, 32, 64], "conv_BLOCK_L": [32, 64, 128]}
    lin = linear_space(spec)
    lin.pop("lin_TF32", None)
    space = {**lin, **ops, "rg_BLOCK_W": [64, 128, 256, 512], "rg_num_warps": [1, 2, 4]}
    if spec.phase == "decode":
        space["state_inplace"] = [True, False]
    return space


def _default(spec: TaskSpec) -> dict:
    ops = {"conv_BLOCK_C": 128} if spec.phase == "decode" else {"conv_BLOCK_C": 32, "conv_BLOCK_L": 64}
    # decode: the conv and RG-LRU states updated where the block holds them (no copies: 3 launches a block fewer
    # under graph replay, where the block's state lives in graph-owned buffers)
    return {**linear_default(spec), **ops, "rg_BLOCK_W": 128, "rg_num_warps": 2, "state_inplace": True}


def _render_prefill(spec: TaskSpec, config: dict) -> str:
    return host_source("recurrent_block.rglru", spec, config, "recurrent", "rglru_prefill", epilogue=_act(spec))


def _render_decode(spec: TaskSpec, config: dict) -> str:
    return host_source("recurrent_block.rglru_decode", spec, config, "recurrent", "rglru_decode", extra=STATE_IN_PLACE,
                       epilogue=_act(spec))


TEMPLATES = [
    Template(name="recurrent_block.rglru", family="recurrent_block", phases=("prefill",),
             requires=(LINEAR_OP, CONV, RGLRU), space_fn=_space, render_fn=_render_prefill, applies_fn=_applies,
             default_fn=_default),
    Template(name="recurrent_block.rglru_decode", family="recurrent_block", phases=("decode",),
             requires=(LINEAR_OP, CONV_UPDATE, RGLRU), space_fn=_space, render_fn=_render_decode,
             applies_fn=_applies, default_fn=_default, seeds_fn=occupancy_seeds(_default)),
]
