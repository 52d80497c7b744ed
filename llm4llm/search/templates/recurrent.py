"""recurrent_block family, RecurrentGemma `RecurrentGemmaRecurrentBlock` (Griffin/Hawk):
y = gelu_tanh(linear_y(x)) (Triton linear with the GELU epilogue), x = linear_x(x) -> temporal conv (causal_conv1d
with bias, no activation, state_len K - 1 in prefill; causal_conv1d_update in decode) -> RG-LRU (kernels_runtime.
ops.rglru, with the `* y` multiply fused) -> linear_out.

The conv state-in is copied before the in-place decode update; the RG-LRU op returns its new fp32 state without
writing the old one. Limits: a multi-token call continuing a cached state (chunked prefill) is out of scope (the
task would carry state); the GELU variants are the tanh approximation (RecurrentGemma's `gelu_pytorch_tanh`) and erf.
"""
from __future__ import annotations

from llm4llm.search.templates._linear import LIN_KWARGS, LINEAR_OP, linear_default, linear_space
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


def _lru(xc, pos, weights, h0, y):
    return rglru(xc, pos, weights["rg_lru.recurrent_param"], weights["rg_lru.input_gate_weight"],
                 weights["rg_lru.input_gate_bias"], weights["rg_lru.recurrent_gate_weight"],
                 weights["rg_lru.recurrent_gate_bias"], state=h0, y_branch=y, **RG)  # y [B, L, W], h [B, W] fp32
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
    return {**lin, **ops, "rg_BLOCK_W": [64, 128, 256, 512], "rg_num_warps": [1, 2, 4]}


def _default(spec: TaskSpec) -> dict:
    ops = {"conv_BLOCK_C": 128} if spec.phase == "decode" else {"conv_BLOCK_C": 32, "conv_BLOCK_L": 64}
    return {**linear_default(spec), **ops, "rg_BLOCK_W": 128, "rg_num_warps": 2}


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

def entry(inputs, weights, state, static):
    x, pos = inputs["input_states"], inputs["position_ids"]  # [B, 1, Hd], [B, 1]
    Bsz = x.shape[0]
    y = linear(x, weights["linear_y.weight"], weights.get("linear_y.bias"), epilogue={_act(spec)!r}, **LIN)  # [B, 1, W]
    xb = linear(x[:, 0], weights["linear_x.weight"], weights.get("linear_x.bias"), **LIN)  # [B, W]
    conv_w = weights["conv_1d.weight"]  # [W, 1, K]
    W, K = conv_w.shape[0], conv_w.shape[-1]
    conv_state = _copy(state["conv_state"])  # [B, W, K - 1], advanced in place below
    xc = causal_conv1d_update(xb, conv_state, conv_w.view(W, K), weights.get("conv_1d.bias"), silu=False,
                              BLOCK_C=CONFIG["conv_BLOCK_C"])  # [B, W]
    h, lru_state = _lru(xc.view(Bsz, 1, W), pos, weights, state["rg_lru_state"], y)
    out = linear(h, weights["linear_out.weight"], weights.get("linear_out.bias"), **LIN)  # [B, 1, Hd]
    return {{"out": out, "state_out.conv_state": conv_state, "state_out.rg_lru_state": lru_state}}
'''


TEMPLATES = [
    Template(name="recurrent_block.rglru", family="recurrent_block", phases=("prefill",),
             requires=(LINEAR_OP, CONV, RGLRU), space_fn=_space, render_fn=_render_prefill, applies_fn=_applies,
             default_fn=_default),
    Template(name="recurrent_block.rglru_decode", family="recurrent_block", phases=("decode",),
             requires=(LINEAR_OP, CONV_UPDATE, RGLRU), space_fn=_space, render_fn=_render_decode,
             applies_fn=_applies, default_fn=_default),
]
