"""ssm_mixer family, Mamba2 `Mamba2Mixer`: in_proj (Triton linear) -> [gate | xBC | dt] -> causal_conv1d + SiLU over
xBC (prefill; the conv state is the last K inputs) or causal_conv1d_update (decode) -> the SSD scan (kernels_runtime.
ops.ssd: `ssd` chunked prefill, `ssd_state_update` decode; dt_bias, softplus, the dt limit and the D skip fused) ->
the gated RMSNorm `w * rmsnorm(y * silu(gate))` (kernels_runtime.ops.rmsnorm.gated_rmsnorm) -> out_proj
(Triton linear).

Numerics follow HF's torch path (transformers 5.17): the prefill scan output stays fp32 into the gated norm (HF's
`mamba2_chunk_scan` returns fp32), the decode update's output is in the input dtype; the norm normalises over the
whole intermediate size (HF's `MambaRMSNormGated` has no group size). The state-in is copied before the in-place decode
updates. A 2-D `attention_mask` zeroes padded positions before in_proj and after the conv, as HF does.
Limits: SiLU activation only; a multi-token call continuing a cached state (chunked prefill) is out of scope.
"""
from __future__ import annotations

from llm4llm.search.templates._linear import LINEAR_OP, linear_default, linear_space, occupancy_seeds
from llm4llm.search.templates.base import Template
from llm4llm.search.templates.blocks import block_applies, host_renderer
from llm4llm.taskspec import TaskSpec

CONV = ("kernels_runtime.ops.causal_conv1d", "causal_conv1d")
CONV_UPDATE = ("kernels_runtime.ops.causal_conv1d", "causal_conv1d_update")
SSD = ("kernels_runtime.ops.ssd", "ssd")
SSD_UPDATE = ("kernels_runtime.ops.ssd", "ssd_state_update")
GATED_NORM = ("kernels_runtime.ops.rmsnorm", "gated_rmsnorm")
MASK_ROWS = ("kernels_runtime.ops.mask_rows", "mask_rows")
NEG_EXP = ("kernels_runtime.ops.neg_exp", "neg_exp")
PROJ_CONV = ("kernels_runtime.ops.mamba_decode", "proj_conv")
GNORM_LINEAR = ("kernels_runtime.ops.mamba_decode", "gated_norm_linear")
MAMBA2_WEIGHTS = {"in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight"}


def _applies(spec: TaskSpec) -> str | None:
    if not MAMBA2_WEIGHTS <= set(spec.weight_names):
        return f"ssm_mixer.mamba2: expected weights {sorted(MAMBA2_WEIGHTS)}, got {spec.weight_names}"
    if spec.static.get("activation", "silu") != "silu":
        return f"ssm_mixer.mamba2: expected activation silu, got {spec.static.get('activation')!r}"
    if "head_dim" not in spec.static or "n_groups" not in spec.static:
        return "ssm_mixer.mamba2: expected static head_dim and n_groups"
    if spec.phase == "prefill" and spec.state_names:
        return "ssm_mixer.mamba2: a multi-token call continuing a cached state (chunked prefill) is out of scope"
    if spec.phase == "decode" and not {"conv_state", "ssm_state"} <= set(spec.state_names):
        return f"ssm_mixer.mamba2: decode expects conv_state and ssm_state, got {spec.state_names}"
    return None


NORM = {"norm_ROWS": [1, 2, 4, 8], "norm_num_warps": [1, 2, 4, 8]}
NORM_PER_THREAD = 64  # fp32 values of the gated norm's [ROWS, BLOCK_N] tile a thread may hold (it keeps three)


def _norm_space(spec: TaskSpec) -> dict[str, list]:
    """The gated norm's rows and warps whose tile fits in registers at this width, every pair of the two lists (the
    space is a product): a tile that spills is too slow to finish within the candidate time limit."""
    width = spec.static.get("intermediate_size", spec.static.get("mixer.intermediate_size"))
    if not isinstance(width, int) or width <= 0:
        return {k: list(v) for k, v in NORM.items()}
    block_n = 1 << (width - 1).bit_length()
    warps = [w for w in NORM["norm_num_warps"] if block_n <= NORM_PER_THREAD * 32 * w] or [max(NORM["norm_num_warps"])]
    rows = [r for r in NORM["norm_ROWS"] if r * block_n <= NORM_PER_THREAD * 32 * min(warps)] or [1]
    return {"norm_ROWS": rows, "norm_num_warps": warps}


def _space(spec: TaskSpec) -> dict[str, list]:
    if spec.phase == "decode":
        ops = {"conv_BLOCK_C": [64, 128, 256], "ssd_BLOCK_P": [16, 32, 64], "ssd_num_warps": [2, 4, 8]}
    else:
        ops = {"conv_BLOCK_C": [16, 32, 64], "conv_BLOCK_L": [32, 64, 128], "ssd_BLOCK_T": [16, 32, 64],
               "ssd_BLOCK_P": [16, 32, 64], "ssd_num_warps": [4, 8]}
    lin = linear_space(spec)
    lin.pop("lin_TF32", None)
    return {**lin, **ops, **_norm_space(spec)}


def _default(spec: TaskSpec) -> dict:
    ops = {"conv_BLOCK_C": 128, "ssd_BLOCK_P": 32, "ssd_num_warps": 4} if spec.phase == "decode" else \
        {"conv_BLOCK_C": 32, "conv_BLOCK_L": 64, "ssd_BLOCK_T": 32, "ssd_BLOCK_P": 32, "ssd_num_warps": 4}
    return {**linear_default(spec), **ops, "norm_ROWS": 1, "norm_num_warps": 4}


def _space_fused(spec: TaskSpec) -> dict[str, list]:
    lin = linear_space(spec)
    lin.pop("lin_TF32", None)
    return {**lin, "in_BLOCK_C": [16, 32, 64, 128], "in_BLOCK_H": [64, 128, 256, 512], "in_num_warps": [2, 4, 8],
            "ssd_BLOCK_P": [16, 32, 64], "ssd_num_warps": [2, 4, 8], **_norm_space(spec),
            "state_inplace": [True, False],
            "out_gnorm_fused": [True, False]}  # the gated norm in out_proj's GEMV (its own launch otherwise)


def _default_fused(spec: TaskSpec) -> dict:
    # 16-row GEMV blocks and 8 warps: the 64-wide GEMV gives mamba2-2.7b's out_proj too few programs to fill the
    # GPU.
    return {**linear_default(spec), "lin_GEMV_BLOCK_N": 16, "lin_GEMV_BLOCK_K": 128, "lin_num_warps": 8,
            "in_BLOCK_C": 16, "in_BLOCK_H": 128, "in_num_warps": 8, "ssd_BLOCK_P": 16, "ssd_num_warps": 2,
            "norm_ROWS": 1, "norm_num_warps": 4, "out_gnorm_fused": True,  # the gated norm in out_proj: a launch less
            "state_inplace": True}  # the kernels update the cache's states: no write-back copies (2 launches a layer)


_render_prefill = host_renderer("ssm_mixer.mamba2", "mamba2", "mamba2_prefill")
_render_decode = host_renderer("ssm_mixer.mamba2_decode", "mamba2", "mamba2_decode")
_render_block_prefill = host_renderer("ssm_block.mamba2", "mamba2", "mamba2_block_prefill", block=True)
_render_decode_fused = host_renderer("ssm_mixer.mamba2_decode_fused", "mamba2", "mamba2_decode_fused")
_render_block_decode_fused = host_renderer("ssm_block.mamba2_decode_fused", "mamba2", "mamba2_block_decode_fused",
                                           block=True)

TEMPLATES = [
    Template(name="ssm_mixer.mamba2", family="ssm_mixer", phases=("prefill",),
             requires=(LINEAR_OP, GATED_NORM, MASK_ROWS, CONV, SSD),
             space_fn=_space, render_fn=_render_prefill, applies_fn=_applies, default_fn=_default),
    Template(name="ssm_mixer.mamba2_decode", family="ssm_mixer", phases=("decode",),
             requires=(LINEAR_OP, GATED_NORM, MASK_ROWS, NEG_EXP, CONV_UPDATE, SSD_UPDATE), space_fn=_space,
             render_fn=_render_decode,
             applies_fn=_applies, default_fn=_default, seeds_fn=occupancy_seeds(_default)),
    Template(name="ssm_mixer.mamba2_decode_fused", family="ssm_mixer", phases=("decode",),
             requires=(LINEAR_OP, GATED_NORM, PROJ_CONV, SSD_UPDATE, GNORM_LINEAR), space_fn=_space_fused,
             render_fn=_render_decode_fused, applies_fn=_applies, default_fn=_default_fused,
             seeds_fn=occupancy_seeds(_default_fused)),
    Template(name="ssm_block.mamba2", family="ssm_block", phases=("prefill",),
             requires=(LINEAR_OP, GATED_NORM, MASK_ROWS, CONV, SSD, ("kernels_runtime.ops.rmsnorm", "rmsnorm")),
             space_fn=_space,
             render_fn=_render_block_prefill, applies_fn=block_applies("ssm_block.mamba2", _applies),
             default_fn=_default),
    Template(name="ssm_block.mamba2_decode_fused", family="ssm_block", phases=("decode",),
             requires=(LINEAR_OP, GATED_NORM, PROJ_CONV, SSD_UPDATE, GNORM_LINEAR), space_fn=_space_fused,
             render_fn=_render_block_decode_fused, applies_fn=block_applies("ssm_block.mamba2_decode_fused", _applies),
             default_fn=_default_fused, seeds_fn=occupancy_seeds(_default_fused)),
]
