"""mlp family.

mlp.swiglu: SwiGLU MLP `down(silu(gate(x)) * up(x))` (LlamaMLP, Qwen3MLP; Phi3MLP's one `gate_up_proj` Linear as
row views [gate | up] of its weight), fusion scope as a config choice:
- "gate_up_swiglu": gate/up in one GEMM with the silu-mul epilogue (kernels_runtime.ops.swiglu.swiglu_fused),
  rounding like HF; then the down projection with the Triton linear.
- "gate_up_linear": the same fusion through linear(..., epilogue="silu", w_up=...) (one fp32 rounding).
- "separate": two Triton linears + silu_and_mul + the down linear (HF's op boundaries, in Triton).

mlp.gelu: GELU MLP `down(gelu(up(x)))`, biases optional (GPTNeoXMLP, FalconMLP: dense_h_to_4h / dense_4h_to_h; PhiMLP:
fc1 / fc2; GPTJMLP, CodeGenMLP: fc_in / fc_out; GPT2MLP (Conv1D weights [in, out]), GPTNeoMLP, GPTBigCodeMLP,
Starcoder2MLP: c_fc / c_proj), the GELU form (erf or tanh) read from the activation module's class
(kernels_runtime.ops.gelu_mlp: the GELU in the up projection's epilogue, two launches).

The host code of both is kernels_runtime.hosts.mlp.
"""
from __future__ import annotations

from llm4llm.search.templates._linear import LINEAR_OP, linear_default, linear_space, occupancy_seeds
from llm4llm.search.templates.base import Template, host_source
from llm4llm.taskspec import TaskSpec

SWIGLU = "kernels_runtime.ops.swiglu"
SCOPES = ["gate_up_swiglu", "gate_up_linear", "separate"]


GATE_UP = {"gate_proj.weight", "up_proj.weight"}
FUSED_GATE_UP = "gate_up_proj.weight"  # one Linear [2I, H] whose output chunks into (gate, up): Phi-3


def _applies(spec: TaskSpec) -> str | None:
    w = set(spec.weight_names)
    if not (GATE_UP <= w or FUSED_GATE_UP in w) or "down_proj.weight" not in w or len(spec.input_names) != 1:
        return f"mlp: expected one input and weights gate_proj + up_proj (or one gate_up_proj) + down_proj, got " \
               f"{spec.input_names}, {spec.weight_names}"
    if any(n.endswith(".bias") for n in spec.weight_names):
        return "mlp: projections with bias are out of scope"
    act = spec.static.get("act_fn.__class__", spec.static.get("activation_fn.__class__", "SiLUActivation"))
    if act not in ("SiLU", "SiLUActivation"):
        return f"mlp: expected a SiLU act_fn, got {act!r}"
    return None


def _space(spec: TaskSpec) -> dict[str, list]:
    return {"fusion": list(SCOPES), **linear_space(spec)}


def _render(spec: TaskSpec, config: dict) -> str:
    return host_source("mlp.swiglu", spec, config, "mlp", "swiglu_op", x=spec.input_names[0],
                       gate_up_proj=FUSED_GATE_UP in spec.weight_names)


# ---------------------------------------------------------------------------------------------------------- gelu

GELU_MLP = ("kernels_runtime.ops.gelu_mlp", "gelu_mlp")
# (up, down) projection names of the GELU MLPs in transformers
GELU_PAIRS = (("dense_h_to_4h", "dense_4h_to_h"), ("fc1", "fc2"), ("fc_in", "fc_out"), ("c_fc", "c_proj"))
ACT_KEYS = ("act.__class__", "activation_fn.__class__", "act_fn.__class__")
# activation class -> torch.nn.functional.gelu's `approximate` (nn.GELU: its own `approximate` attribute)
GELU_ACTS = {"GELUActivation": "none", "NewGELUActivation": "tanh", "GELUTanh": "tanh", "PytorchGELUTanh": "tanh",
             "FastGELUActivation": "tanh", "AccurateGELUActivation": "tanh"}


def _gelu_pair(spec: TaskSpec) -> tuple[str, str] | None:
    w = set(spec.weight_names)
    return next(((u, d) for u, d in GELU_PAIRS if {f"{u}.weight", f"{d}.weight"} <= w), None)


def _gelu_form(spec: TaskSpec) -> str | None:
    """"none" or "tanh" from the MLP's activation module, None when it is no GELU."""
    key = next((k for k in ACT_KEYS if k in spec.static), None)
    act = spec.static.get(key)
    if act == "GELU":  # torch.nn.GELU
        return spec.static.get(key.removesuffix("__class__") + "approximate", "none")
    return GELU_ACTS.get(act)


def _gelu_applies(spec: TaskSpec) -> str | None:
    pair = _gelu_pair(spec)
    if pair is None or len(spec.input_names) != 1:
        return f"mlp.gelu: expected one input and the weights of one of the up/down pairs {GELU_PAIRS}, got " \
               f"{spec.input_names}, {spec.weight_names}"
    extra = set(spec.weight_names) - {f"{p}.{k}" for p in pair for k in ("weight", "bias")}
    if extra:
        return f"mlp.gelu: expected only {pair[0]} and {pair[1]} weights and biases, got also {sorted(extra)}"
    if _gelu_form(spec) is None:
        return f"mlp.gelu: expected a GELU activation, got {[spec.static.get(k) for k in ACT_KEYS if k in spec.static]}"
    return None


def _gelu_render(spec: TaskSpec, config: dict) -> str:
    up, down = _gelu_pair(spec)
    # Conv1D (GPT-2) stores [in, out] and records nf/nx: its transpose is the [out, in] view the op takes
    return host_source("mlp.gelu", spec, config, "mlp", "gelu_mlp_op", up=up, down=down, form=_gelu_form(spec),
                       x=spec.input_names[0], transpose_up=f"{up}.nf" in spec.static,
                       transpose_down=f"{down}.nf" in spec.static)


TEMPLATES = [
    Template(name="mlp.swiglu", family="mlp", phases=("prefill", "decode"), requires=(LINEAR_OP,),
             space_fn=_space, render_fn=_render, applies_fn=_applies,
             default_fn=lambda spec: {"fusion": "gate_up_swiglu", **linear_default(spec)},
             choice_requires={("fusion", "gate_up_swiglu"): ((SWIGLU, "swiglu_fused"),),
                              ("fusion", "separate"): ((SWIGLU, "silu_and_mul"),)}),
    Template(name="mlp.gelu", family="mlp", phases=("prefill", "decode"), requires=(LINEAR_OP, GELU_MLP),
             space_fn=linear_space, render_fn=_gelu_render, applies_fn=_gelu_applies, default_fn=linear_default,
             seeds_fn=occupancy_seeds(linear_default)),
]
