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

from llm4llm.search.templates._linear import (LIN_KWARGS, LINEAR_OP, linear_default, linear_space, occupancy_seeds,
                                              programs_block, sm_count)
from llm4llm.search.templates.base import Template, header
from llm4llm.search.templates.blocks import (BLOCK_ENTRY, BLOCK_PREFILL_ENTRY, BLOCK_PREFILL_IMPORT, MIXER_ENTRY,
                                             MIXER_PREFILL_ENTRY, block_applies, renderer)
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

# Shared with the Mamba2 and RecurrentGemma templates: a state copy (the padding mask and A = -exp(A_log) are the ops
# kernels_runtime.ops.mask_rows and .neg_exp).
HELPERS = '''
def _copy(t):
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out
'''

PRELUDE = LIN_KWARGS + HELPERS + '''

def _ssm_params(xc, weights, static):
    # xc: [..., I] -> dt [..., I] (no bias: the scan adds dt_proj.bias in fp32, as HF does), B, C [..., N]
    N = weights["A_log"].shape[1]
    R = weights["dt_proj.weight"].shape[1]
    p = linear(xc, weights["x_proj.weight"], **LIN)  # [..., R + 2N]
    if CONFIG["xproj_rms"]:  # Falcon-Mamba: weightless RMSNorms on dt_low, B and C, in fp32 (one launch on p)
        p = bcdt_rmsnorm(p, R, N, float(_static(static, "rms_eps", "dt_layernorm.eps")))
    dt = linear(p[..., :R], weights["dt_proj.weight"], **LIN)
    return dt, p[..., R:R + N], p[..., R + N:]
'''


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


# The prefill mixer over its own weight and static names, shared with the block's template (templates/blocks.py);
# residual: a block's residual stream, added in out_proj's store.
PREFILL_STEP = '''

def _prefill_step(x, mask, weights, static, residual=None):
    # x: [B, L, H]; mask: [B, L] or None
    x = mask_rows(x, mask)
    I = weights["in_proj.weight"].shape[0] // 2
    proj = linear(x, weights["in_proj.weight"], weights.get("in_proj.bias"), **LIN)  # [B, L, 2I]
    xs, gate = proj[..., :I].transpose(1, 2), proj[..., I:].transpose(1, 2)  # [B, I, L] views
    conv_w = weights["conv1d.weight"]  # [I, 1, K]
    xc, conv_state = causal_conv1d(xs, conv_w.view(I, conv_w.shape[-1]), weights.get("conv1d.bias"), silu=True,
                                   BLOCK_C=CONFIG["conv_BLOCK_C"], BLOCK_L=CONFIG["conv_BLOCK_L"])  # [B, I, L]
    xc = mask_rows(xc, mask, channels_last=False)
    dt, Bm, Cm = _ssm_params(xc.transpose(1, 2), weights, static)  # [B, L, I], [B, L, N], [B, L, N]
    # A = -exp(A_log) in the kernel; D and the dt bias read as fp32 there (HF's .float() copies, no launches here)
    y, ssm_state = selective_scan(xc, dt.transpose(1, 2), weights["A_log"], Bm.transpose(1, 2),
                                  Cm.transpose(1, 2), D=weights["D"], z=gate,
                                  delta_bias=weights["dt_proj.bias"], delta_softplus=True,
                                  BLOCK_D=CONFIG["scan_BLOCK_D"], num_warps=CONFIG["scan_num_warps"],
                                  BLOCK_T=CONFIG.get("scan_BLOCK_T", 0), A_is_log=True)  # [B, I, L]
    out = linear(y.transpose(1, 2), weights["out_proj.weight"], weights.get("out_proj.bias"), residual=residual,
                 **LIN)  # [B, L, H] (+ residual)
    # the cache keeps the scan's final state as it comes (fp32: HF's discretisation runs in fp32)
    return out, conv_state, ssm_state
'''
PREFILL_IMPORTS = ["from kernels_runtime.ops.linear import linear",
                   "from kernels_runtime.ops.bcdt_rmsnorm import bcdt_rmsnorm",
                   "from kernels_runtime.ops.causal_conv1d import causal_conv1d",
                   "from kernels_runtime.ops.mask_rows import mask_rows",
                   "from kernels_runtime.ops.selective_scan import selective_scan"]


def _render_decode(spec: TaskSpec, config: dict) -> str:
    imports = ["from kernels_runtime.ops.linear import linear",
               "from kernels_runtime.ops.bcdt_rmsnorm import bcdt_rmsnorm",
               "from kernels_runtime.ops.causal_conv1d import causal_conv1d_update",
               "from kernels_runtime.ops.mask_rows import mask_rows",
               "from kernels_runtime.ops.neg_exp import neg_exp",
               "from kernels_runtime.ops.selective_scan import selective_state_update"]
    return header("ssm_mixer.mamba", spec, imports, config) + PRELUDE + '''

def entry(inputs, weights, state, static):
    mask = inputs.get("attention_mask")  # [B, 1] or None
    x = mask_rows(inputs["hidden_states"], mask)  # [B, 1, H]
    I = weights["in_proj.weight"].shape[0] // 2
    proj = linear(x[:, 0], weights["in_proj.weight"], weights.get("in_proj.bias"), **LIN)  # [B, 2I]
    xs, gate = proj[:, :I], proj[:, I:]
    conv_w = weights["conv1d.weight"]  # [I, 1, K]
    conv_state = _copy(state["conv_state"])  # [B, I, K], advanced in place below
    xc = causal_conv1d_update(xs, conv_state, conv_w.view(I, conv_w.shape[-1]), weights.get("conv1d.bias"),
                              silu=True, BLOCK_C=CONFIG["conv_BLOCK_C"])  # [B, I]
    xc = mask_rows(xc.view(xc.shape[0], 1, I), mask).view(xc.shape[0], I)
    dt, Bm, Cm = _ssm_params(xc, weights, static)  # [B, I], [B, N], [B, N]
    ssm_state = _copy(state["ssm_state"])  # [B, I, N]
    y = selective_state_update(ssm_state, xc, dt, neg_exp(weights["A_log"]), Bm, Cm, D=weights["D"], z=gate,
                               dt_bias=weights["dt_proj.bias"].float(), dt_softplus=True,
                               BLOCK_D=CONFIG["scan_BLOCK_D"], num_warps=CONFIG["scan_num_warps"])  # [B, I]
    out = linear(y.view(y.shape[0], 1, I), weights["out_proj.weight"], weights.get("out_proj.bias"), **LIN)
    return {"out": out, "state_out.conv_state": conv_state, "state_out.ssm_state": ssm_state}
'''


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


# The fused decode step, shared by the mixer's template and its block's (templates/blocks.py): over the mixer's own
# weight and static names; norm_w: the block's RMSNorm, folded into in_proj's kernel.
FUSED_STEP = '''

def _fused_step(x, mask, weights, state, static, norm_w=None, norm_eps=0.0, residual=None):
    # four launches: ([norm +] in_proj + conv update + SiLU), x_proj, (dt_proj + state update + skip + gate), out_proj;
    # three with ssu_xproj_fused (x_proj inside the state update)
    # x: [B, 1, H]; mask: [B, 1] or None
    conv_w = weights["conv1d.weight"]  # [I, 1, K]
    xc, z, conv_state = mamba_in_proj_conv(
        x[:, 0], weights["in_proj.weight"], weights.get("in_proj.bias"), state["conv_state"],
        conv_w.view(conv_w.shape[0], conv_w.shape[-1]), weights.get("conv1d.bias"), mask,
        BLOCK_C=CONFIG["in_BLOCK_C"], BLOCK_H=CONFIG["in_BLOCK_H"], num_warps=CONFIG["in_num_warps"],
        inplace=STATE_IN_PLACE, norm_w=norm_w, norm_eps=norm_eps)
    fused = CONFIG["ssu_xproj_fused"]  # x_proj inside the state update's launch (its own GEMV launch otherwise)
    p = None if fused else linear(xc, weights["x_proj.weight"], **LIN)  # [B, R + 2N]
    y, ssm_state = mamba_dt_state_update(
        p, weights["dt_proj.weight"], weights["dt_proj.bias"], weights["A_log"], weights["D"], xc, z,
        state["ssm_state"], BLOCK_D=CONFIG["ssu_BLOCK_D"], num_warps=CONFIG["ssu_num_warps"], inplace=STATE_IN_PLACE,
        x_proj_w=weights["x_proj.weight"] if fused else None,
        # Falcon-Mamba's dt/B/C RMSNorms, applied in fp32 as the kernel reads x_proj's output
        rms_eps=float(_static(static, "rms_eps", "dt_layernorm.eps")) if CONFIG["xproj_rms"] else None)
    out = linear(y.view(y.shape[0], 1, y.shape[1]), weights["out_proj.weight"], weights.get("out_proj.bias"),
                 residual=residual, **LIN)  # [+ residual]: a block's add, in the store
    return out, conv_state, ssm_state
'''
FUSED_IMPORTS = ["from kernels_runtime.ops.linear import linear",
                 "from kernels_runtime.ops.mamba_decode import mamba_dt_state_update, mamba_in_proj_conv"]


_render_prefill = renderer("ssm_mixer.mamba", PREFILL_IMPORTS, PRELUDE, MIXER_PREFILL_ENTRY, PREFILL_STEP)
_render_block_prefill = renderer("ssm_block.mamba", PREFILL_IMPORTS + [BLOCK_PREFILL_IMPORT], PRELUDE,
                                 BLOCK_PREFILL_ENTRY, PREFILL_STEP)
_render_decode_fused = renderer("ssm_mixer.mamba_decode_fused", FUSED_IMPORTS, LIN_KWARGS, MIXER_ENTRY, FUSED_STEP)
_render_block_decode_fused = renderer("ssm_block.mamba_decode_fused", FUSED_IMPORTS, LIN_KWARGS, BLOCK_ENTRY,
                                      FUSED_STEP)

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
