"""ssm_mixer family, Mamba (v1) `MambaMixer`: in_proj (Triton linear) -> causal_conv1d + SiLU (prefill; the conv
state is the last K inputs) or causal_conv1d_update (decode) -> x_proj, dt_proj (Triton linear) -> selective_scan
with the D skip and the silu(z) gate fused (prefill) or selective_state_update (decode) -> out_proj. The state-in is
copied before the in-place decode updates: a candidate never modifies its inputs. A 2-D `attention_mask` input
(prefill) zeroes padded positions before in_proj and after the conv, as HF does. Limit: the SiLU activation only
(MambaConfig's default). Option `xproj_rms` (Falcon-Mamba's `FalconMambaMixer`): weightless RMSNorms on dt_low, B
and C right after x_proj (`mixer_rms_eps`), in fp32 — one launch on x_proj's output in prefill
(ops/bcdt_rmsnorm.py), inside the state-update kernel in the fused decode; the applicability check settles it per
task by running both values against the module.

16-bit: the chain amplifies 1-ulp differences of its bf16 intermediates (at mamba-130m's dims one flipped rounding per
stage moves `out` by ~2-3 and the fp32 ssm_state by ~1), so the ops round exactly where HF's torch path does: the conv
result in the weight dtype before the SiLU, dt + bias and softplus (log1p) in dt's dtype, the state in u's dtype
before the C contraction, and round-to-nearest bf16 stores under the interpreter (which truncates)."""
from __future__ import annotations

from llm4llm.search.templates._linear import (LINEAR_OP, linear_default, linear_space, occupancy_seeds, programs_block,
                                              sm_count)
from llm4llm.search.templates.base import Template
from llm4llm.search.templates.blocks import block_applies, host_renderer
from llm4llm.taskspec import TaskSpec

CONV = ("kernels_runtime.ops.causal_conv1d", "causal_conv1d")
BCDT_NORM = ("kernels_runtime.ops.bcdt_rmsnorm", "bcdt_rmsnorm")
CONV_UPDATE = ("kernels_runtime.ops.causal_conv1d", "causal_conv1d_update")
SCAN = ("kernels_runtime.ops.selective_scan", "selective_scan")
STATE_UPDATE = ("kernels_runtime.ops.selective_scan", "selective_state_update")
IN_CONV = ("kernels_runtime.ops.mamba_decode", "mamba_in_proj_conv")
DT_UPDATE = ("kernels_runtime.ops.mamba_decode", "mamba_dt_state_update")
NORM_OP = ("kernels_runtime.ops.rmsnorm", "rmsnorm")
MASK_ROWS = ("kernels_runtime.ops.mask_rows", "mask_rows")
NEG_EXP = ("kernels_runtime.ops.neg_exp", "neg_exp")
MAMBA_WEIGHTS = {"in_proj.weight", "conv1d.weight", "x_proj.weight", "dt_proj.weight", "dt_proj.bias", "A_log", "D",
                 "out_proj.weight"}


def _applies(spec: TaskSpec) -> str | None:
    if not MAMBA_WEIGHTS <= set(spec.weight_names):
        return f"ssm_mixer.mamba: expected weights {sorted(MAMBA_WEIGHTS)}, got {spec.weight_names}"
    if spec.static.get("activation", "silu") != "silu":
        return f"ssm_mixer.mamba: expected activation silu, got {spec.static.get('activation')!r}"
    if spec.phase == "prefill" and spec.state_names:
        return "ssm_mixer.mamba: a multi-token call continuing a cached state (chunked prefill) is out of scope"
    return None


def _xproj_rms_hint(spec: TaskSpec) -> bool:
    """The default of the `xproj_rms` option: Falcon-Mamba's mixer records its norms' eps (`rms_eps`). Only a
    starting point: the applicability check runs both values and keeps the one that matches the module."""
    return any(k.rsplit(".", 1)[-1] == "rms_eps" for k in spec.static)


def _space(spec: TaskSpec) -> dict[str, list]:
    if spec.phase == "decode":
        ops = {"conv_BLOCK_C": [64, 128, 256], "scan_BLOCK_D": [16, 32, 64], "scan_num_warps": [1, 2, 4]}
    else:
        ops = {"conv_BLOCK_C": [16, 32, 64], "conv_BLOCK_L": [32, 64, 128], "scan_BLOCK_D": [8, 16, 32, 64],
               "scan_num_warps": [1, 2, 4], "scan_BLOCK_T": [0, 4, 8, 16]}  # BLOCK_T 0: one step at a time
    lin = linear_space(spec)
    lin.pop("lin_TF32", None)
    return {**lin, **ops, "xproj_rms": [False, True]}


def _default(spec: TaskSpec) -> dict:
    ops = {"conv_BLOCK_C": 128, "scan_BLOCK_D": 32, "scan_num_warps": 2} if spec.phase == "decode" else \
        {"conv_BLOCK_C": 32, "conv_BLOCK_L": 64, "scan_BLOCK_D": 16, "scan_num_warps": 2, "scan_BLOCK_T": 8}
    return {**linear_default(spec), **ops, "xproj_rms": _xproj_rms_hint(spec)}


def _space_fused(spec: TaskSpec) -> dict[str, list]:
    lin = linear_space(spec)
    lin.pop("lin_TF32", None)
    return {**lin, "in_BLOCK_C": [16, 32, 64, 128], "in_BLOCK_H": [64, 128, 256, 512], "in_num_warps": [2, 4, 8],
            "ssu_BLOCK_D": [8, 16, 32, 64], "ssu_num_warps": [1, 2, 4], "state_inplace": [True, False],
            "ssu_xproj_fused": [True, False], "xproj_rms": [False, True]}


def _default_fused(spec: TaskSpec) -> dict:
    # Narrow GEMV row blocks and 8 warps keep every SM reading weights; the 64-wide, 4-warp GEMV default launches too
    # few programs for mamba-130m's N = 768.
    return {**linear_default(spec), "lin_GEMV_BLOCK_N": 16, "lin_GEMV_BLOCK_K": 32, "lin_num_warps": 8,
            "in_BLOCK_C": 16, "in_BLOCK_H": 128, "in_num_warps": 8, "ssu_BLOCK_D": 64, "ssu_num_warps": 1,
            # x_proj inside the state update saves a launch a layer but every program reduces x_proj's rows itself,
            # which costs more than the launch
            "ssu_xproj_fused": False,
            "state_inplace": True,  # the kernels update the cache's states: no write-back copies (2 launches a layer)
            "xproj_rms": _xproj_rms_hint(spec)}


def _ssu_occupancy(spec: TaskSpec, sms: int) -> dict | None:
    """The state update's channel block that gives it a program per SM: its grid is (B, I / ssu_BLOCK_D), and at
    the default 64 mamba-130m's I = 1536 makes only 24 programs."""
    sig = next((c.state.get("ssm_state") for c in spec.cases if c.state.get("ssm_state")), None)
    if sig is None or len(sig.shape) != 3:
        return None
    return {"ssu_BLOCK_D": programs_block(int(sig.shape[1]), [8, 16, 32, 64], sms)}


def _scan_seeds(spec: TaskSpec) -> list[dict]:
    """Prefill: the default with the selective scan's channel block cut for a program per SM (its grid is
    (B, I / scan_BLOCK_D); the default 16 gives mamba-130m's I = 1536 96 programs on 132 SMs)."""
    sig = next((c.outputs.get("state_out.ssm_state") for c in spec.cases if c.outputs.get("state_out.ssm_state")),
               None)
    if spec.phase != "prefill" or sig is None or len(sig.shape) != 3:
        return []
    return [{**_default(spec), "scan_BLOCK_D": programs_block(int(sig.shape[1]), [8, 16, 32, 64], sm_count(spec))}]


def _applies_fused(spec: TaskSpec) -> str | None:
    why = _applies(spec)
    if why:
        return why.replace("ssm_mixer.mamba:", "ssm_mixer.mamba_decode_fused:")
    if set(spec.state_names) != {"conv_state", "ssm_state"}:
        return f"ssm_mixer.mamba_decode_fused: expected states conv_state and ssm_state, got {spec.state_names}"
    return None


_render_prefill = host_renderer("ssm_mixer.mamba", "ssm", "mamba_prefill")
_render_decode = host_renderer("ssm_mixer.mamba_decode", "ssm", "mamba_decode")
_render_block_prefill = host_renderer("ssm_block.mamba", "ssm", "mamba_block_prefill", block=True)
_render_decode_fused = host_renderer("ssm_mixer.mamba_decode_fused", "ssm", "mamba_decode_fused")
_render_block_decode_fused = host_renderer("ssm_block.mamba_decode_fused", "ssm", "mamba_block_decode_fused",
                                           block=True)

XPROJ_OPTION = ("xproj_rms",)  # a property of the module (Falcon-Mamba or not), settled by the applicability check

TEMPLATES = [
    Template(name="ssm_mixer.mamba", family="ssm_mixer", phases=("prefill",),
             requires=(LINEAR_OP, CONV, SCAN, BCDT_NORM, MASK_ROWS),
             space_fn=_space, render_fn=_render_prefill, applies_fn=_applies, default_fn=_default,
             seeds_fn=_scan_seeds, options=XPROJ_OPTION),
    Template(name="ssm_mixer.mamba_decode", family="ssm_mixer", phases=("decode",),
             requires=(LINEAR_OP, CONV_UPDATE, STATE_UPDATE, BCDT_NORM, MASK_ROWS, NEG_EXP), space_fn=_space,
             render_fn=_render_decode,
             applies_fn=_applies, default_fn=_default, seeds_fn=occupancy_seeds(_default), options=XPROJ_OPTION),
    Template(name="ssm_mixer.mamba_decode_fused", family="ssm_mixer", phases=("decode",),
             requires=(LINEAR_OP, IN_CONV, DT_UPDATE), space_fn=_space_fused, render_fn=_render_decode_fused,
             applies_fn=_applies_fused, default_fn=_default_fused,
             seeds_fn=occupancy_seeds(_default_fused, extras=(_ssu_occupancy,)), options=XPROJ_OPTION),
    Template(name="ssm_block.mamba", family="ssm_block", phases=("prefill",),
             requires=(LINEAR_OP, CONV, SCAN, NORM_OP, BCDT_NORM, MASK_ROWS),
             space_fn=_space, render_fn=_render_block_prefill, applies_fn=block_applies("ssm_block.mamba", _applies),
             default_fn=_default, seeds_fn=_scan_seeds, options=XPROJ_OPTION),
    Template(name="ssm_block.mamba_decode_fused", family="ssm_block", phases=("decode",),
             requires=(LINEAR_OP, IN_CONV, DT_UPDATE), space_fn=_space_fused, render_fn=_render_block_decode_fused,
             applies_fn=block_applies("ssm_block.mamba_decode_fused", _applies_fused), default_fn=_default_fused,
             seeds_fn=occupancy_seeds(_default_fused, extras=(_ssu_occupancy,)), options=XPROJ_OPTION),
]
