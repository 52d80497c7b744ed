"""norm family: LayerNorm with or without bias (torch.nn.LayerNorm: GPT-NeoX, Phi, StableLM, GPT-J), Llama-style
RMSNorm (`weight * normed.to(input dtype)`) over the last dim, and Mamba2's gated
RMSNorm (`MambaRMSNormGated`: `weight * rmsnorm(x * silu(gate)).to(input dtype)`, normalised over the whole last dim,
as HF 5.17 does)."""
from __future__ import annotations

from llm4llm.search.templates.base import Template, host_source, short_class
from llm4llm.taskspec import TaskSpec

def _applies(spec: TaskSpec) -> str | None:
    if "Gemma" in short_class(spec):
        return "norm: Gemma-style RMSNorm scales by (1 + weight); not this template's numerics"
    if spec.input_names != ["hidden_states"] or spec.weight_names != ["weight"]:
        return f"norm: expected inputs ['hidden_states'] and weights ['weight'], got {spec.input_names}, " \
               f"{spec.weight_names} (gated norms are out of scope)"
    return None


def _applies_gemma(spec: TaskSpec) -> str | None:
    if "Gemma" not in short_class(spec):
        return f"norm.rmsnorm_gemma: written for Gemma-style RMSNorm (1 + weight), not {short_class(spec)}"
    if len(spec.input_names) != 1 or spec.weight_names != ["weight"]:
        return f"norm.rmsnorm_gemma: expected one input and weights ['weight'], got {spec.input_names}, " \
               f"{spec.weight_names}"
    return None


def _render_gemma(spec: TaskSpec, config: dict) -> str:
    return host_source("norm.rmsnorm_gemma", spec, config, "norm", "rmsnorm_op", x=spec.input_names[0], gemma=True)


def _render_op(spec: TaskSpec, config: dict) -> str:
    return host_source("norm.rmsnorm_op", spec, config, "norm", "rmsnorm_op")


def _render_rows(spec: TaskSpec, config: dict) -> str:
    return host_source("norm.rmsnorm_rows", spec, config, "norm", "rmsnorm_rows_op")


def _applies_gated(spec: TaskSpec) -> str | None:
    if spec.input_names not in (["hidden_states", "gate"], ["hidden_states"]) or spec.weight_names != ["weight"]:
        return f"norm.rmsnorm_gated: expected inputs ['hidden_states', 'gate'] and weights ['weight'], got " \
               f"{spec.input_names}, {spec.weight_names}"
    if "Gated" not in short_class(spec):
        return f"norm.rmsnorm_gated: written for MambaRMSNormGated, not {short_class(spec)}"
    return None


def _render_gated(spec: TaskSpec, config: dict) -> str:
    return host_source("norm.rmsnorm_gated", spec, config, "norm", "gated_rmsnorm_op")


def _applies_layernorm(spec: TaskSpec) -> str | None:
    if len(spec.input_names) != 1 or spec.weight_names not in (["weight", "bias"], ["weight"]):
        return f"norm.layernorm: expected one input and weights ['weight'(, 'bias')], got {spec.input_names}, " \
               f"{spec.weight_names}"
    shape = spec.static.get("normalized_shape")
    if not isinstance(shape, list) or len(shape) != 1:
        return f"norm.layernorm: expected a normalized_shape over the last dim, got {shape!r}"
    return None


def _render_layernorm(spec: TaskSpec, config: dict) -> str:
    return host_source("norm.layernorm", spec, config, "norm", "layernorm_op", x=spec.input_names[0])


TEMPLATES = [
    Template(name="norm.layernorm", family="norm", phases=("prefill", "decode"),
             requires=(("kernels_runtime.ops.layernorm", "layernorm"),),
             space_fn=lambda spec: {"ROWS": [1, 2, 4, 8, 16], "num_warps": [1, 2, 4, 8]},
             render_fn=_render_layernorm, applies_fn=_applies_layernorm,
             default_fn=lambda spec: {"ROWS": 4, "num_warps": 4}),
    Template(name="norm.rmsnorm_op", family="norm", phases=("prefill", "decode"),
             requires=(("kernels_runtime.ops.rmsnorm", "rmsnorm"),),
             space_fn=lambda spec: {"num_warps": [1, 2, 4, 8, 16]}, render_fn=_render_op, applies_fn=_applies,
             default_fn=lambda spec: {"num_warps": 4}),
    Template(name="norm.rmsnorm_gemma", family="norm", phases=("prefill", "decode"),
             requires=(("kernels_runtime.ops.rmsnorm", "rmsnorm_gemma_ref"),),
             space_fn=lambda spec: {"num_warps": [1, 2, 4, 8, 16]}, render_fn=_render_gemma,
             applies_fn=_applies_gemma, default_fn=lambda spec: {"num_warps": 4}),
    Template(name="norm.rmsnorm_rows", family="norm", phases=("prefill", "decode"),
             requires=(("kernels_runtime.ops.rmsnorm", "rmsnorm_rows"),),
             space_fn=lambda spec: {"ROWS": [1, 2, 4, 8, 16], "num_warps": [1, 2, 4, 8]}, render_fn=_render_rows,
             applies_fn=_applies, default_fn=lambda spec: {"ROWS": 4, "num_warps": 4}),
    Template(name="norm.rmsnorm_gated", family="norm", phases=("prefill", "decode"),
             requires=(("kernels_runtime.ops.rmsnorm", "gated_rmsnorm"),),
             space_fn=lambda spec: {"ROWS": [1, 2, 4, 8, 16], "num_warps": [1, 2, 4, 8]}, render_fn=_render_gated,
             applies_fn=_applies_gated, default_fn=lambda spec: {"ROWS": 4, "num_warps": 4}),
]
