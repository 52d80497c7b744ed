"""mlp family: SwiGLU MLP `down(silu(gate(x)) * up(x))` (LlamaMLP, Qwen3MLP), fusion scope as a config choice:
- "gate_up_swiglu": gate/up in one GEMM with the silu-mul epilogue (kernels_runtime.ops.swiglu.swiglu_fused),
  rounding like HF; then the down projection with the Triton linear.
- "gate_up_linear": the same fusion through linear(..., epilogue="silu", w_up=...) (one fp32 rounding).
- "separate": two Triton linears + silu_and_mul + the down linear (HF's op boundaries, in Triton).
"""
from __future__ import annotations

from llm4llm.search.templates._linear import LIN_KWARGS, LINEAR_OP, linear_default, linear_space
from llm4llm.search.templates.base import Template, header
from llm4llm.taskspec import TaskSpec

SWIGLU = "kernels_runtime.ops.swiglu"
SCOPES = ["gate_up_swiglu", "gate_up_linear", "separate"]


def _applies(spec: TaskSpec) -> str | None:
    need = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    if not need <= set(spec.weight_names) or spec.input_names != ["x"]:
        return f"mlp: expected input ['x'] and weights {sorted(need)}, got {spec.input_names}, {spec.weight_names}"
    if any(w.endswith(".bias") for w in spec.weight_names):
        return "mlp: projections with bias are out of scope"
    act = spec.static.get("act_fn.__class__", "SiLUActivation")
    if act not in ("SiLU", "SiLUActivation"):
        return f"mlp: expected a SiLU act_fn, got {act!r}"
    return None


def _space(spec: TaskSpec) -> dict[str, list]:
    return {"fusion": list(SCOPES), **linear_space(spec)}


def _render(spec: TaskSpec, config: dict) -> str:
    imports = ["from kernels_runtime.ops.linear import linear"]
    if config["fusion"] == "gate_up_swiglu":
        imports.append("from kernels_runtime.ops.swiglu import swiglu_fused")
        mid = '    h = swiglu_fused(x, wg, wu)  # [..., I]\n'
    elif config["fusion"] == "gate_up_linear":
        mid = '    h = linear(x, wg, epilogue="silu", w_up=wu, **LIN)  # [..., I]\n'
    else:
        imports.append("from kernels_runtime.ops.swiglu import silu_and_mul")
        mid = '    h = silu_and_mul(linear(x, wg, **LIN), linear(x, wu, **LIN))  # [..., I]\n'
    return header("mlp.swiglu", spec, imports, config) + LIN_KWARGS + f'''

def entry(inputs, weights, state, static):
    x = inputs["x"]  # [..., H]
    wg, wu = weights["gate_proj.weight"], weights["up_proj.weight"]  # [I, H]
{mid}    return {{"out": linear(h, weights["down_proj.weight"], **LIN)}}  # [..., H]
'''


TEMPLATES = [
    Template(name="mlp.swiglu", family="mlp", phases=("prefill", "decode"), requires=(LINEAR_OP,),
             space_fn=_space, render_fn=_render, applies_fn=_applies,
             default_fn=lambda spec: {"fusion": "gate_up_swiglu", **linear_default(spec)},
             choice_requires={("fusion", "gate_up_swiglu"): ((SWIGLU, "swiglu_fused"),),
                              ("fusion", "separate"): ((SWIGLU, "silu_and_mul"),)}),
]
