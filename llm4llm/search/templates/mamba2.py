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

from llm4llm.search.templates._linear import LIN_KWARGS, LINEAR_OP, linear_default, linear_space, occupancy_seeds
from llm4llm.search.templates.base import Template, header
from llm4llm.search.templates.blocks import (BLOCK_ENTRY, BLOCK_PREFILL_ENTRY, BLOCK_PREFILL_IMPORT, MIXER_ENTRY,
                                             MIXER_PREFILL_ENTRY, block_applies, renderer)
from llm4llm.search.templates.ssm import HELPERS
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

PRELUDE = LIN_KWARGS + HELPERS + '''

def _gated_rmsnorm(y, z, w, eps, out_dtype):
    # y, z: [R, N] row views (unit stride along N) -> [R, N] in out_dtype
    return gated_rmsnorm(y, z, w, eps, out_dtype=out_dtype, rows=CONFIG["norm_ROWS"],
                         num_warps=CONFIG["norm_num_warps"])


def _dims(weights, static):
    H = weights["A_log"].shape[0]
    P = int(_static(static, "head_dim"))
    G = int(_static(static, "n_groups"))
    N = int(_static(static, "ssm_state_size", "state_size"))
    I = H * P
    return H, P, G, N, I, I + 2 * G * N  # ..., conv_dim


def _eps(static):
    return float(_static(static, "norm.variance_epsilon", "layer_norm_epsilon"))
'''


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


def _imports(extra: list[str]) -> list[str]:
    return ["from kernels_runtime.ops.linear import linear", "from kernels_runtime.ops.rmsnorm import gated_rmsnorm",
            *extra]


# The prefill mixer over its own weight and static names, shared with the block's template (templates/blocks.py);
# residual: a block's residual stream, added in out_proj's store.
PREFILL_STEP = '''

def _prefill_step(x, mask, weights, static, residual=None):
    # x: [B, L, Hd] (the mixer's input: its dtype is the activation dtype); mask: [B, L] or None
    act = x.dtype
    x = mask_rows(x, mask)
    Bsz, L, _ = x.shape
    H, P, G, N, I, CD = _dims(weights, static)
    proj = linear(x, weights["in_proj.weight"], weights.get("in_proj.bias"), **LIN)  # [B, L, I + CD + H]
    gate, xbc, dt = proj[..., :I], proj[..., I:I + CD], proj[..., I + CD:]
    conv_w = weights["conv1d.weight"]  # [CD, 1, K]
    xc, conv_state = causal_conv1d(xbc.transpose(1, 2), conv_w.view(CD, conv_w.shape[-1]), weights.get("conv1d.bias"),
                                   silu=True, BLOCK_C=CONFIG["conv_BLOCK_C"], BLOCK_L=CONFIG["conv_BLOCK_L"])  # [B, CD, L]
    xc = mask_rows(xc, mask, channels_last=False).transpose(1, 2)  # [B, L, CD] view
    lim = static.get("time_step_limit") or (0.0, None)
    lo = 0.0 if lim[0] is None else float(lim[0])
    hi = float("inf") if lim[1] is None else float(lim[1])
    y, ssm_state = ssd(xc[..., :I].view(Bsz, L, H, P), dt, weights["A_log"],
                       xc[..., I:I + G * N].view(Bsz, L, G, N), xc[..., I + G * N:].view(Bsz, L, G, N),
                       D=weights["D"], dt_bias=weights["dt_bias"], dt_softplus=True, dt_limit=(lo, hi),
                       out_dtype=torch.float32, BLOCK_T=CONFIG["ssd_BLOCK_T"], BLOCK_P=CONFIG["ssd_BLOCK_P"],
                       num_warps=CONFIG["ssd_num_warps"], A_is_log=True)  # y: [B, L, H, P] fp32 (as HF), state fp32
    yn = _gated_rmsnorm(y.view(Bsz * L, I), gate.reshape(Bsz * L, I), weights["norm.weight"], _eps(static), act)
    out = linear(yn.view(Bsz, L, I), weights["out_proj.weight"], weights.get("out_proj.bias"), residual=residual,
                 **LIN)  # [B, L, Hd] (+ residual)
    return out, conv_state, ssm_state
'''
PREFILL_IMPORTS = _imports(["from kernels_runtime.ops.causal_conv1d import causal_conv1d",
                            "from kernels_runtime.ops.mask_rows import mask_rows",
                            "from kernels_runtime.ops.ssd import ssd"])


def _render_decode(spec: TaskSpec, config: dict) -> str:
    imports = _imports(["from kernels_runtime.ops.causal_conv1d import causal_conv1d_update",
                        "from kernels_runtime.ops.mask_rows import mask_rows",
                        "from kernels_runtime.ops.neg_exp import neg_exp",
                        "from kernels_runtime.ops.ssd import ssd_state_update"])
    return header("ssm_mixer.mamba2_decode", spec, imports, config) + PRELUDE + '''

def entry(inputs, weights, state, static):
    mask = inputs.get("attention_mask")  # [B, 1] or None
    x = mask_rows(inputs["hidden_states"], mask)  # [B, 1, Hd]
    Bsz = x.shape[0]
    H, P, G, N, I, CD = _dims(weights, static)
    proj = linear(x[:, 0], weights["in_proj.weight"], weights.get("in_proj.bias"), **LIN)  # [B, I + CD + H]
    gate, xbc, dt = proj[:, :I], proj[:, I:I + CD], proj[:, I + CD:]
    conv_w = weights["conv1d.weight"]  # [CD, 1, K]
    conv_state = _copy(state["conv_state"])  # [B, CD, K], advanced in place below
    xc = causal_conv1d_update(xbc, conv_state, conv_w.view(CD, conv_w.shape[-1]), weights.get("conv1d.bias"),
                              silu=True, BLOCK_C=CONFIG["conv_BLOCK_C"])  # [B, CD]
    xc = mask_rows(xc.view(Bsz, 1, CD), mask).view(Bsz, CD)
    ssm_state = _copy(state["ssm_state"])  # [B, H, P, N], advanced in place below
    y = ssd_state_update(ssm_state, xc[:, :I].view(Bsz, H, P), dt, neg_exp(weights["A_log"]),
                         xc[:, I:I + G * N].view(Bsz, G, N), xc[:, I + G * N:].view(Bsz, G, N), D=weights["D"],
                         dt_bias=weights["dt_bias"], dt_softplus=True, BLOCK_P=CONFIG["ssd_BLOCK_P"],
                         num_warps=CONFIG["ssd_num_warps"])  # [B, H, P] in x's dtype
    yn = _gated_rmsnorm(y.view(Bsz, I), gate, weights["norm.weight"], _eps(static), x.dtype)
    out = linear(yn.view(Bsz, 1, I), weights["out_proj.weight"], weights.get("out_proj.bias"), **LIN)
    return {"out": out, "state_out.conv_state": conv_state, "state_out.ssm_state": ssm_state}
'''


def _space_fused(spec: TaskSpec) -> dict[str, list]:
    lin = linear_space(spec)
    lin.pop("lin_TF32", None)
    return {**lin, "in_BLOCK_C": [16, 32, 64, 128], "in_BLOCK_H": [64, 128, 256, 512], "in_num_warps": [2, 4, 8],
            "ssd_BLOCK_P": [16, 32, 64], "ssd_num_warps": [2, 4, 8], **_norm_space(spec), "state_inplace": [True, False],
            "out_gnorm_fused": [True, False]}  # the gated norm in out_proj's GEMV (its own launch otherwise)


def _default_fused(spec: TaskSpec) -> dict:
    # 16-row GEMV blocks and 8 warps: the 64-wide GEMV gives mamba2-2.7b's out_proj too few programs to fill the
    # GPU.
    return {**linear_default(spec), "lin_GEMV_BLOCK_N": 16, "lin_GEMV_BLOCK_K": 128, "lin_num_warps": 8,
            "in_BLOCK_C": 16, "in_BLOCK_H": 128, "in_num_warps": 8, "ssd_BLOCK_P": 16, "ssd_num_warps": 2,
            "norm_ROWS": 1, "norm_num_warps": 4, "out_gnorm_fused": True,  # the gated norm in out_proj: a launch less
            "state_inplace": True}  # the kernels update the cache's states: no write-back copies (2 launches a layer)


# The fused decode step, shared by the mixer's template and its block's (templates/blocks.py): over the mixer's own
# weight and static names; norm_w: the block's RMSNorm, folded into in_proj's kernel.
FUSED_STEP = '''

def _fused_step(x, mask, weights, state, static, norm_w=None, norm_eps=0.0, residual=None):
    # four launches: ([norm +] in_proj + conv update over xBC + SiLU), the SSD state update (A = -exp(A_log)
    # in-kernel), the gated RMSNorm, out_proj. x: [B, 1, Hd]; mask: [B, 1] or None
    Bsz = x.shape[0]
    act = norm_w.dtype if norm_w is not None else x.dtype  # the mixer's activation dtype
    H, P, G, N, I, CD = _dims(weights, static)
    conv_w = weights["conv1d.weight"]  # [CD, 1, K]
    proj, conv_state = proj_conv(x[:, 0], weights["in_proj.weight"], weights.get("in_proj.bias"), state["conv_state"],
                                 conv_w.view(CD, conv_w.shape[-1]), weights.get("conv1d.bias"), mask, conv_start=I,
                                 BLOCK_C=CONFIG["in_BLOCK_C"], BLOCK_H=CONFIG["in_BLOCK_H"],
                                 num_warps=CONFIG["in_num_warps"], inplace=STATE_IN_PLACE, norm_w=norm_w,
                                 norm_eps=norm_eps)
    # proj: [B, I + CD + H]: gate | silu(conv(xBC)) | dt
    gate, xc, dt = proj[:, :I], proj[:, I:I + CD], proj[:, I + CD:]
    ssm_in = state["ssm_state"]
    ssm_state = ssm_in if STATE_IN_PLACE else torch.empty_like(ssm_in)
    y = ssd_state_update(ssm_in, xc[:, :I].view(Bsz, H, P), dt, weights["A_log"], xc[:, I:I + G * N].view(Bsz, G, N),
                         xc[:, I + G * N:].view(Bsz, G, N), D=weights["D"], dt_bias=weights["dt_bias"],
                         dt_softplus=True, out_state=None if STATE_IN_PLACE else ssm_state, A_is_log=True,
                         BLOCK_P=CONFIG["ssd_BLOCK_P"], num_warps=CONFIG["ssd_num_warps"])  # [B, H, P] in act
    if CONFIG["out_gnorm_fused"]:  # the gated norm inside out_proj's GEMV (+ the block's residual): one launch
        out = gated_norm_linear(y.view(Bsz, I), gate, weights["norm.weight"], _eps(static), weights["out_proj.weight"],
                                weights.get("out_proj.bias"), None if residual is None else residual.view(Bsz, -1),
                                out_dtype=act, GEMV_BLOCK_N=LIN["GEMV_BLOCK_N"], GEMV_BLOCK_K=LIN["GEMV_BLOCK_K"],
                                num_warps=LIN["num_warps"]).view(Bsz, 1, -1)
        return out, conv_state, ssm_state
    yn = _gated_rmsnorm(y.view(Bsz, I), gate, weights["norm.weight"], _eps(static), act)
    out = linear(yn.view(Bsz, 1, I), weights["out_proj.weight"], weights.get("out_proj.bias"), residual=residual,
                 **LIN)  # [+ residual]: a block's add, in the store
    return out, conv_state, ssm_state
'''
FUSED_IMPORTS = _imports(["from kernels_runtime.ops.mamba_decode import gated_norm_linear, proj_conv",
                          "from kernels_runtime.ops.ssd import ssd_state_update"])


_render_prefill = renderer("ssm_mixer.mamba2", PREFILL_IMPORTS, PRELUDE, MIXER_PREFILL_ENTRY, PREFILL_STEP)
_render_block_prefill = renderer("ssm_block.mamba2", PREFILL_IMPORTS + [BLOCK_PREFILL_IMPORT], PRELUDE,
                                 BLOCK_PREFILL_ENTRY, PREFILL_STEP)
_render_decode_fused = renderer("ssm_mixer.mamba2_decode_fused", FUSED_IMPORTS, PRELUDE, MIXER_ENTRY, FUSED_STEP)
_render_block_decode_fused = renderer("ssm_block.mamba2_decode_fused", FUSED_IMPORTS, PRELUDE, BLOCK_ENTRY, FUSED_STEP)

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
