"""Host code of the MLP templates.

swiglu_op: `down(silu(gate(x)) * up(x))`, the fusion scope from the config (`fusion`): "gate_up_swiglu" (one GEMM
with the silu-mul epilogue, rounding like HF), "gate_up_linear" (the linear's silu epilogue with `w_up`, one fp32
rounding) or "separate" (two linears + silu_and_mul). `gate_up_proj`: the module has one [2I, H] Linear whose rows
are [gate | up] (Phi-3), read as two row views.

gelu_mlp_op: `down(gelu(up(x)))`, biases optional, over the module's up/down projection names; `transpose_up` /
`transpose_down`: a GPT-2 Conv1D weight stored [in, out], read through its transpose.
"""
from __future__ import annotations

from kernels_runtime.hosts import prefixed
from kernels_runtime.ops.linear import linear


def _gate_up(fusion: str, lin: dict):
    """(x, wg, wu) -> silu(x @ wg.T) * (x @ wu.T): [..., I], in the op(s) `fusion` names."""
    if fusion == "gate_up_swiglu":
        from kernels_runtime.ops.swiglu import swiglu_fused  # imported by the choice that calls it (choice_requires)
        return lambda x, wg, wu: swiglu_fused(x, wg, wu)
    if fusion == "gate_up_linear":
        return lambda x, wg, wu: linear(x, wg, epilogue="silu", w_up=wu, **lin)
    from kernels_runtime.ops.swiglu import silu_and_mul
    return lambda x, wg, wu: silu_and_mul(linear(x, wg, **lin), linear(x, wu, **lin))


def _rows(weights):
    # rows [gate | up] of one Linear: contiguous row views, no copy
    w = weights["gate_up_proj.weight"]  # [2I, H]
    return w[: w.shape[0] // 2], w[w.shape[0] // 2:]  # [I, H] each


def _pair(weights):
    return weights["gate_proj.weight"], weights["up_proj.weight"]  # [I, H]


def swiglu_op(config: dict, x: str = "hidden_states", gate_up_proj: bool = False):
    lin = prefixed(config, "lin_")
    gate_up, split = _gate_up(config["fusion"], lin), _rows if gate_up_proj else _pair

    def entry(inputs, weights, state, static):
        h = gate_up(inputs[x], *split(weights))  # [..., I]
        return {"out": linear(h, weights["down_proj.weight"], **lin)}  # [..., H]
    return entry


def gelu_mlp_op(config: dict, up: str, down: str, form: str, x: str = "hidden_states", transpose_up: bool = False,
                transpose_down: bool = False):
    from kernels_runtime.ops.gelu_mlp import gelu_mlp  # imported by its own template only (its `requires`)

    lin = prefixed(config, "lin_")

    def entry(inputs, weights, state, static):
        w_up, w_down = weights[f"{up}.weight"], weights[f"{down}.weight"]  # [I, H], [H, I] (Conv1D: transposed)
        w_up, w_down = w_up.T if transpose_up else w_up, w_down.T if transpose_down else w_down
        out = gelu_mlp(inputs[x], w_up, weights.get(f"{up}.bias"), w_down, weights.get(f"{down}.bias"), form,
                       **lin)  # [..., H]
        return {"out": out}
    return entry
