"""attention family (LlamaAttention, Qwen3Attention and those of StableLM, Phi, Phi-3, GPT-NeoX, Mistral, Gemma-2):
q/k/v projections (Triton linear; or one fused Linear, the `qkv_layout` option), rotary (fused with Qwen3's
q_norm/k_norm when those weights exist; partial rotary when cos/sin are narrower than the head), the KV cache as
state_out (a sliding-window cache keeps its last W - 1 positions), causal flash attention (prefill, with the sliding
window where the module has one) or split-KV flash decoding (decode), the output projection (Triton linear). Under
transformers' static KV cache (decode graphs), attention.decode_static: norms, rotary, the cache write at the
device-side length and split-KV attention in one kernel (kernels_runtime/ops/attention_decode_static.py), nothing on
the host that a graph would freeze (the same qkv_layout option; partial rotary too). The host code of each is
kernels_runtime/hosts/attention.py (the shared parts hosts/attention_common.py), which the rendered source imports.
Padded batches (left padding, as `generate` builds them): every template here passes the last query row of HF's
4-D bool mask (`pad_keys`: HF builds it as the causal mask AND the 2-D padding mask, so that row is the padding
mask; for a decode step it is the step's own row) to its kernel, which reads it on the device and excludes each
row's pad keys; the mask forms they cannot read are refused (`mask_problem`), never attended causally."""
from __future__ import annotations

from llm4llm.search.templates._linear import (LINEAR_OP, occupancy_seeds, sm90_capable, sm_count,
                                              task_rows)
from llm4llm.search.templates.base import Template, host_source
from llm4llm.taskspec import TaskSpec

ROTARY = ("kernels_runtime.ops.rotary", "rotary")
QK_NORM_ROTARY = ("kernels_runtime.ops.rotary", "qk_norm_rotary")
PREFILL_OP = ("kernels_runtime.ops.attention_prefill", "attention_prefill")
FLASH_TMA_OP = ("kernels_runtime.ops.attention_prefill", "attention_prefill_tma")
DECODE_OP = ("kernels_runtime.ops.attention_decode", "attention_decode")
DECODE_UPDATE_OP = ("kernels_runtime.ops.attention_decode", "attention_decode_update")
DECODE_STATIC_OP = ("kernels_runtime.ops.attention_decode_static", "attention_decode_static")
# transformers' static KV cache (StaticLayer, StaticSlidingWindowLayer while its window fills): preallocated
# keys/values and a device-side length, what decode graphs run on
STATIC_ADAPTERS = ("StaticLayer", "StaticSlidingWindowLayer")
# transformers' dynamic sliding-window cache (Mistral, Gemma-2's sliding layers): keeps the last W - 1 positions
SLIDING_ADAPTER = "DynamicSlidingWindowLayer"

# Fused q/k/v projections (one Linear) and output projections, by the names transformers' modules give them
QKV_NAMES = ("qkv_proj", "query_key_value")  # Phi-3, GPT-NeoX
O_NAMES = ("o_proj", "dense")  # GPT-NeoX and Phi name it dense
# qkv_layout, the one option key (the applicability check runs each value and pins the one that matches):
# split: q_proj/k_proj/v_proj; blocks: one Linear whose output is [q of every head | k | v] (Phi-3's qkv_proj);
# heads: one Linear whose output is per head [q_h | k_h | v_h] (GPT-NeoX's query_key_value: view(B, S, H, 3D)).
# Either fused layout is one GEMM, q/k/v strided views of its output (the ops take any strides): no copies.
# weights the attention templates read besides the projections' (Qwen3's per-head RMSNorm)
NORM_WEIGHTS = ("q_norm.weight", "k_norm.weight")

# Smaller linear space than the MLP's: the attention and rotary keys multiply it.
# The prefill projections are large GEMMs: cuBLAS first (the model's own path), our Triton block kernel as an option.
# With the projections all in Triton at 64 x 64 x 32 tiles the template's entry ran 1.6 ms slower than the HF layer
# with the same attention kernel swapped in (one qwen3-4b layer at 16k).
LIN_PREFILL = {"lin_impl": ["cublas", "triton"], "lin_BLOCK_M": [64, 128], "lin_BLOCK_N": [64, 128],
               "lin_BLOCK_K": [32, 64], "lin_num_warps": [4, 8], "lin_num_stages": [3, 4]}
# with the projections on cuBLAS the Triton linear's tiles render the same kernels (Template.inactive)
LIN_PREFILL_INACTIVE = {("lin_impl", "cublas"): ("lin_BLOCK_M", "lin_BLOCK_N", "lin_BLOCK_K", "lin_num_warps",
                                                 "lin_num_stages")}
LIN_PREFILL_DEFAULT = {"lin_impl": "cublas", "lin_BLOCK_M": 64, "lin_BLOCK_N": 64, "lin_BLOCK_K": 32,
                       "lin_num_warps": 4, "lin_num_stages": 3}


def _prefill_attn_default(spec: TaskSpec) -> dict:
    """The flash template's attention default: on sm_90+ (and a CPU task) TileMix's 0 % kernel with TMA at 128 x 128
    in 3 stages (qwen3-4b's heads at 16k and 32k, batch 8: 1.29x and 1.33x SDPA flash;
    attention_prefill at 64 x 64 put the template's entry at 0.94x the model's module); before sm_90 the earlier
    default, whose three-stage 128 x 128 buffers would not fit shared memory there."""
    if sm90_capable(spec):
        return {"flash_kernel": "tma", "attn_BLOCK_M": 128, "attn_BLOCK_N": 128, "attn_num_warps": 8,
                "attn_num_stages": 3}
    return {"flash_kernel": "pointer", "attn_BLOCK_M": 64, "attn_BLOCK_N": 64, "attn_num_warps": 4,
            "attn_num_stages": 2}


LIN_DECODE = {"lin_GEMV_BLOCK_N": [32, 64, 128], "lin_GEMV_BLOCK_K": [64, 128, 256], "lin_num_warps": [4, 8],
              "lin_GEMV_SPLIT_K": [1, 2, 4]}
ROPE = {"rope_BLOCK_H": [2, 4, 8], "rope_num_warps": [1, 2, 4]}
ATTN_PREFILL = {"attn_BLOCK_M": [64, 128], "attn_BLOCK_N": [32, 64, 128], "attn_num_warps": [4, 8],
                "attn_num_stages": [2, 3]}
ATTN_DECODE = {"cache_update": ["fused", "copy"], "attn_BLOCK_N": [32, 64, 128], "attn_num_splits": [None, 2, 8, 32],
               "attn_num_warps": [4, 8]}
ATTN_STATIC = {"attn_BLOCK_N": [16, 32, 64, 128], "attn_num_splits": [None, 4, 8, 16, 32, 64],
               "attn_num_warps": [2, 4, 8], "attn_num_stages": [1, 2, 3]}

def _names(spec: TaskSpec) -> dict:
    """The module's names the hosts' `Attention` takes: the fused q/k/v projection (None: split), the output
    projection, and from the recipe's cache state the sliding layer's window and whether the cache keeps only it."""
    state = (spec.recipe or {}).get("state") or {}
    return {"qkv": _fused_name(spec), "o_proj": _o_name(spec), "window": state.get("sliding_window"),
            "sliding_cache": state.get("adapter") == SLIDING_ADAPTER}


def _fused_name(spec: TaskSpec) -> str | None:
    return next((n for n in QKV_NAMES if n + ".weight" in spec.weight_names), None)


def _o_name(spec: TaskSpec) -> str | None:
    return next((n for n in O_NAMES if n + ".weight" in spec.weight_names), None)


def _layouts(spec: TaskSpec) -> list[str]:
    """The qkv_layout values the task's weights allow: split projections, or the two layouts of a fused one."""
    if {"q_proj.weight", "k_proj.weight", "v_proj.weight"} <= set(spec.weight_names):
        return ["split"]
    return ["blocks", "heads"] if _fused_name(spec) else []


def _split_only(spec: TaskSpec, name: str) -> str | None:
    """Scope of the templates that read q_proj/k_proj/v_proj/o_proj by name (TileMix)."""
    if _layouts(spec) != ["split"] or _o_name(spec) != "o_proj":
        return f"{name}: expected q_proj/k_proj/v_proj/o_proj, got {spec.weight_names}"
    return None


def _adapter(spec: TaskSpec) -> str | None:
    return ((spec.recipe or {}).get("state") or {}).get("adapter")


def _applies_common(spec: TaskSpec) -> str | None:
    if not _layouts(spec) or not _o_name(spec):
        return f"attention: expected q_proj/k_proj/v_proj or a fused projection {QKV_NAMES}, and an output " \
               f"projection {O_NAMES}, got weights {spec.weight_names}"
    qkv = ["q_proj", "k_proj", "v_proj"] if _layouts(spec) == ["split"] else [_fused_name(spec)]
    read = {f"{n}.{p}" for n in (*qkv, _o_name(spec)) for p in ("weight", "bias")} | set(NORM_WEIGHTS)
    unread = [w for w in spec.weight_names if w not in read]
    if unread:  # StableLM's and Phi's q/k LayerNorms, ...: another computation
        return f"attention: weights the template does not read: {unread}"
    if not {"hidden_states", "position_embeddings.0", "position_embeddings.1"} <= set(spec.input_names):
        return f"attention: expected hidden_states and position_embeddings.0/.1 inputs, got {spec.input_names}"
    return None


def module_softcap(static: dict) -> float | None:
    """The attention-logit soft-cap the module applies: Gemma-2's `attn_logit_softcapping` under eager, flash or
    flex attention; none under SDPA, whose transformers path ignores `softcap`."""
    cap = next((static[n] for n in ("attn_logit_softcapping", "config.attn_logit_softcapping")
                if static.get(n) is not None), None)
    if not cap or "sdpa" in str(static.get("attn_implementation") or ""):
        return None
    return float(cap)


def mask_problem(spec: TaskSpec, static: bool = False) -> str | None:
    """Why the task's captured attention mask is not one the attention templates honour, or None: they read HF's
    4-D bool mask [B, 1, S, L] (SDPA's form, the padding included; L = the case's cache size on the static cache);
    an additive float mask (eager attention, whose fully masked rows average every value where SDPA's give zeros) or
    a 2-D one (flash attention) they refuse rather than attend causally."""
    for case in spec.cases:
        m = case.inputs.get("attention_mask")
        if m is None:
            continue
        cache = case.state.get("key_cache") if static else None
        s_max = list(cache.shape)[-2] if cache is not None else None
        shape = list(m.shape)
        if m.dtype != "bool" or len(shape) != 4 or shape[1] != 1 or (s_max and shape[3] != s_max):
            return (f"attention mask: expected HF's [B, 1, S, {s_max or 'L'}] bool mask (SDPA), got {m.dtype} "
                    f"{shape}")
    return None


def static_mask_problem(spec: TaskSpec) -> str | None:
    """mask_problem on the static cache: HF's [B, 1, 1, S_max] mask, the decode row."""
    return mask_problem(spec, static=True)


def _applies(spec: TaskSpec) -> str | None:
    why = _applies_common(spec)
    if why:
        return why
    if _adapter(spec) in STATIC_ADAPTERS:
        return "attention: a static KV cache task (attention.decode_static takes it)"
    if mask_problem(spec):
        return f"attention: {mask_problem(spec)}"
    if module_softcap(spec.static):
        return (f"attention: logit soft-capping ({module_softcap(spec.static):g}, "
                f"{spec.static.get('attn_implementation')} attention) is out of this template's scope")
    return None


def _applies_static(spec: TaskSpec) -> str | None:
    why = _applies_common(spec)
    if why:
        return why
    if _adapter(spec) not in STATIC_ADAPTERS:
        return f"attention.decode_static: expected a static KV cache task ({STATIC_ADAPTERS}), got {_adapter(spec)}"
    if spec.static.get("attention_type") not in (None, "full_attention", "sliding_attention"):
        return f"attention.decode_static: attention type {spec.static.get('attention_type')!r} is out of scope"
    why = static_mask_problem(spec)
    return f"attention.decode_static: {why}" if why else None


def _render_prefill(spec: TaskSpec, config: dict) -> str:
    return host_source("attention.prefill_flash", spec, config, "attention", "prefill_flash", **_names(spec))


def _render_decode(spec: TaskSpec, config: dict) -> str:
    return host_source("attention.decode_splitkv", spec, config, "attention", "decode_splitkv", **_names(spec))


_STATIC_DEFAULT = {"lin_GEMV_BLOCK_N": 64, "lin_GEMV_BLOCK_K": 128, "lin_num_warps": 4, "attn_BLOCK_N": 64,
                   "attn_num_splits": None, "attn_num_warps": 4, "attn_num_stages": 2}


def _static_seeds(spec: TaskSpec) -> list[dict]:
    """The projections' GEMV occupancy point, first with the cache split so that (KV heads x splits) programs fill
    the GPU. The default leaves most SMs idle at batch 1, and the good points (many cache splits, a split-K GEMV)
    lie far from it, beyond what a small budget reaches by local search."""
    seeds = occupancy_seeds(lambda s: dict(_STATIC_DEFAULT))(spec)
    splits = cache_splits(spec)
    if not seeds or not splits:
        return seeds
    return [{**seeds[0], **splits}, *seeds]


def cache_splits(spec: TaskSpec, prefix: str = "") -> dict:
    """The attn_ keys of attention_decode_static that split the cache so that (KV heads x splits) programs fill the
    task's GPU (32-position blocks); {} where the static values do not give the KV heads. `prefix`: where the
    attention's static values sit (a decoder layer's `self_attn.`). A task with decode batches keeps the split
    unset: the op then splits per call by its rows (`default_num_splits`: rows x KV heads x splits near its
    target), where one fixed split for batch 1 would cut a batch of 32 rows into 8192 programs of a few keys."""
    head_dim, kv_width = spec.static.get(prefix + "head_dim"), spec.static.get(prefix + "k_proj.out_features")
    if not (isinstance(head_dim, int) and isinstance(kv_width, int) and head_dim > 0):
        return {}
    if task_rows(spec) > 1:
        return {"attn_num_splits": None, "attn_BLOCK_N": 32}
    heads, sms = max(1, kv_width // head_dim), sm_count(spec)
    return {"attn_num_splits": next((n for n in (4, 8, 16, 32, 64) if heads * n >= sms), 64), "attn_BLOCK_N": 32}


def _render_static(spec: TaskSpec, config: dict) -> str:
    names = _names(spec)
    return host_source("attention.decode_static", spec, config, "attention", "decode_static", qkv=names["qkv"],
                       o_proj=names["o_proj"])


TEMPLATES = [
    Template(name="attention.prefill_flash", family="attention", phases=("prefill",),
             requires=(LINEAR_OP, ROTARY, QK_NORM_ROTARY, PREFILL_OP),
             space_fn=lambda spec: {"qkv_layout": _layouts(spec) or ["split"], **LIN_PREFILL, **ROPE, **ATTN_PREFILL,
                                    "flash_kernel": ["tma", "pointer"]},
             render_fn=_render_prefill, applies_fn=_applies, options=("qkv_layout",),
             choice_requires={("flash_kernel", "tma"): (FLASH_TMA_OP,)}, inactive=LIN_PREFILL_INACTIVE,
             default_fn=lambda spec: {**LIN_PREFILL_DEFAULT, "rope_BLOCK_H": 4, "rope_num_warps": 2,
                                      **_prefill_attn_default(spec)}),
    Template(name="attention.decode_splitkv", family="attention", phases=("decode",),
             requires=(LINEAR_OP, ROTARY, QK_NORM_ROTARY, DECODE_OP),
             space_fn=lambda spec: {"qkv_layout": _layouts(spec) or ["split"], **LIN_DECODE, **ROPE, **ATTN_DECODE},
             render_fn=_render_decode, applies_fn=_applies, options=("qkv_layout",),
             default_fn=lambda spec: {"lin_GEMV_BLOCK_N": 64, "lin_GEMV_BLOCK_K": 128, "lin_num_warps": 4,
                                      "rope_BLOCK_H": 4, "rope_num_warps": 2, "cache_update": "copy",
                                      "attn_BLOCK_N": 64, "attn_num_splits": None, "attn_num_warps": 4},
             choice_requires={("cache_update", "fused"): (DECODE_UPDATE_OP,)}),
    Template(name="attention.decode_static", family="attention", phases=("decode",), seeds_fn=_static_seeds,
             requires=(LINEAR_OP, DECODE_STATIC_OP),
             space_fn=lambda spec: {"qkv_layout": _layouts(spec) or ["split"], **LIN_DECODE, **ATTN_STATIC},
             render_fn=_render_static, applies_fn=_applies_static, options=("qkv_layout",),
             default_fn=lambda spec: dict(_STATIC_DEFAULT)),
]
