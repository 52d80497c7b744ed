"""recurrent_block family, RecurrentGemma `RecurrentGemmaRecurrentBlock` (Griffin/Hawk):
y = gelu_tanh(linear_y(x)) (Triton linear with the GELU epilogue), x = linear_x(x) -> temporal conv (causal_conv1d
with bias, no activation, state_len K - 1 in prefill; causal_conv1d_update in decode) -> RG-LRU (kernels_runtime.
ops.rglru, with the `* y` multiply fused) -> linear_out.

Decode updates the conv and RG-LRU states in place by default (`state_inplace`; the runtime then copies nothing);
otherwise the conv state is copied before the in-place conv update and the RG-LRU op returns its new fp32 state
without writing the old one. Limits: a multi-token call continuing a cached state (chunked prefill) is out of scope (the
task would carry state); the GELU variants are the tanh approximation (RecurrentGemma's `gelu_pytorch_tanh`) and erf.
"""
from __future__ import annotations

from llm4llm.search.templates._linear import LIN_KWARGS, LINEAR_OP, linear_default, linear_space, occupancy_seeds
from llm4llm.search.templates.base import Template, header
from llm4llm.search.templates.ssm import HELPERS
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

PRELUDE = LIN_KWARGS + HELPERS + '''

RG = {k[3:]: v for k, v in CONFIG.items() if k.startswith("rg_")}


def _lru(xc, pos, weights, h0, y, inplace=False):
    return rglru(xc, pos, weights["rg_lru.recurrent_param"], weights["rg_lru.input_gate_weight"],
                 weights["rg_lru.input_gate_bias"], weights["rg_lru.recurrent_gate_weight"],
                 weights["rg_lru.recurrent_gate_bias"], state=h0, y_branch=y, inplace=inplace,
                 **RG)  # y [B, L, W], h [B, W] fp32
'''


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
    imports = ["from kernels_runtime.ops.linear import linear",
               "from kernels_runtime.ops.causal_conv1d import causal_conv1d",
               "from kernels_runtime.ops.rglru import rglru"]
    return header("recurrent_block.rglru", spec, imports, config) + PRELUDE + f'''

def entry(inputs, weights, state, static):
    x, pos = inputs["input_states"], inputs["position_ids"]  # [B, L, Hd], [B, L]
    y = linear(x, weights["linear_y.weight"], weights.get("linear_y.bias"), epilogue={_act(spec)!r}, **LIN)  # [B, L, W]
    xb = linear(x, weights["linear_x.weight"], weights.get("linear_x.bias"), **LIN)  # [B, L, W]
    conv_w = weights["conv_1d.weight"]  # [W, 1, K]
    W, K = conv_w.shape[0], conv_w.shape[-1]
    xc, conv_state = causal_conv1d(xb.transpose(1, 2), conv_w.view(W, K), weights.get("conv_1d.bias"), silu=False,
                                   state_len=K - 1, BLOCK_C=CONFIG["conv_BLOCK_C"],
                                   BLOCK_L=CONFIG["conv_BLOCK_L"])  # [B, W, L], [B, W, K - 1]
    h, lru_state = _lru(xc.transpose(1, 2), pos, weights, None, y)
    out = linear(h, weights["linear_out.weight"], weights.get("linear_out.bias"), **LIN)  # [B, L, Hd]
    return {{"out": out, "state_out.conv_state": conv_state, "state_out.rg_lru_state": lru_state}}
'''


def _render_decode(spec: TaskSpec, config: dict) -> str:
    imports = ["from kernels_runtime.ops.linear import linear",
               "from kernels_runtime.ops.causal_conv1d import causal_conv1d_update",
               "from kernels_runtime.ops.rglru import rglru"]
    return header("recurrent_block.rglru_decode", spec, imports, config) + PRELUDE + f'''

# state_inplace: the conv and RG-LRU states are updated where they are held (kernels_runtime then copies nothing and
# never falls back once this entry started); a state that is not contiguous (HF's first one after prefill may be a
# slice) or not fp32 is copied first, as without it
STATE_IN_PLACE = CONFIG["state_inplace"]


def entry(inputs, weights, state, static):
    x, pos = inputs["input_states"], inputs["position_ids"]  # [B, 1, Hd], [B, 1]
    Bsz = x.shape[0]
    cs, hs = state["conv_state"], state["rg_lru_state"]
    conv_state = cs if STATE_IN_PLACE and cs.is_contiguous() else _copy(cs)  # [B, W, K - 1], advanced in place below
    in_place_lru = STATE_IN_PLACE and hs.is_contiguous() and hs.dtype == torch.float32
    y = linear(x, weights["linear_y.weight"], weights.get("linear_y.bias"), epilogue={_act(spec)!r}, **LIN)  # [B, 1, W]
    xb = linear(x[:, 0], weights["linear_x.weight"], weights.get("linear_x.bias"), **LIN)  # [B, W]
    conv_w = weights["conv_1d.weight"]  # [W, 1, K]
    W, K = conv_w.shape[0], conv_w.shape[-1]
    xc = causal_conv1d_update(xb, conv_state, conv_w.view(W, K), weights.get("conv_1d.bias"), silu=False,
                              BLOCK_C=CONFIG["conv_BLOCK_C"])  # [B, W]
    h, lru_state = _lru(xc.view(Bsz, 1, W), pos, weights, hs, y, inplace=in_place_lru)
    out = linear(h, weights["linear_out.weight"], weights.get("linear_out.bias"), **LIN)  # [B, 1, Hd]
    return {{"out": out, "state_out.conv_state": conv_state, "state_out.rg_lru_state": lru_state}}
'''


TEMPLATES = [
    Template(name="recurrent_block.rglru", family="recurrent_block", phases=("prefill",),
             requires=(LINEAR_OP, CONV, RGLRU), space_fn=_space, render_fn=_render_prefill, applies_fn=_applies,
             default_fn=_default),
    Template(name="recurrent_block.rglru_decode", family="recurrent_block", phases=("decode",),
             requires=(LINEAR_OP, CONV_UPDATE, RGLRU), space_fn=_space, render_fn=_render_decode,
             applies_fn=_applies, default_fn=_default, seeds_fn=occupancy_seeds(_default)),
]
