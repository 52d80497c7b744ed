"""Fused decode templates over kernels_runtime.ops.gemv: every projection streams its weights once, with the work
around it in the GEMV's prologue or its split-K reduction. One template per boundary, finest first:
- mlp.decode_gemv (an MLP task): gate/up in one pass with the SwiGLU epilogue, down_proj: 4 launches (2 with no split);
- attention.decode_fused_qkv (an attention task): q/k/v in one pass with Qwen3's q/k norms and the rotary embedding
  in the reduction, the split-KV decode attention (kernels_runtime.ops.attention_decode), o_proj;
- decoder_layer.decode_fused (a whole decoder layer, LlamaDecoderLayer / Qwen3DecoderLayer): input_layernorm in the
  q/k/v GEMV's prologue, o_proj with the residual add and post_attention_layernorm in its reduction (or the norm in
  gate/up's prologue: `post_norm`), gate/up + SwiGLU, down_proj with the second residual add: the MLP block is 2
  GEMV passes, the layer 3 plus attention;
- decoder_layer.decode_static (the same layer on transformers' static KV cache, what decode graphs run on): the
  input_layernorm + q/k/v GEMV, then attention.decode_static's kernel (q/k norms, rotary, the cache write at the
  device-side length, split-KV attention: its `attn_` keys), then the MLP half as decode_fused;
- decoder_layer.decode_static_gemma2 (Gemma2DecoderLayer on the static cache): decode_static's ops with Gemma's
  (1 + w) norms: input_layernorm in the q/k/v prologue, the attention with the module's soft-cap and window,
  post_attention_layernorm + residual + pre_feedforward_layernorm in o_proj's reduction, gate/up + gelu-tanh,
  post_feedforward_layernorm + residual in down_proj's reduction;
- lm_head.gemv: the vocabulary projection.
Each GEMV stage has its own keys (prefix `qkv_`, `o_`, `gu_`, `dn_`, `lm_`): BLOCK_N (rows a program), BLOCK_K (the
K tile: 512 bf16 = 16-byte loads, 64 per row a step), SPLIT_K (programs along K, a deterministic second launch adds
them), num_warps; `num_stages` is shared. Defaults: the best points of the batch-1 sweep (_stage_default;
docs/hardware.md names the measurements behind each default).
"""
from __future__ import annotations

from llm4llm.search.templates._linear import occupancy_split, sm90_capable, sm_count, task_rows
from llm4llm.search.templates.attention import (ATTN_DECODE, ATTN_STATIC, DECODE_OP, DECODE_STATIC_OP,
                                                STATIC_ADAPTERS, _STATIC_DEFAULT, _adapter, cache_splits,
                                                mask_problem, module_softcap, static_mask_problem)
from llm4llm.search.templates.base import Template, host_source
from llm4llm.taskspec import TaskSpec

GEMV = "kernels_runtime.ops.gemv"
HOSTS = "decode_layer"  # kernels_runtime.hosts.decode_layer: the host code every rendered source imports
OPS = ((GEMV, "gemv"), (GEMV, "gate_up_swiglu"), (GEMV, "gemv_residual_rmsnorm"), (GEMV, "qkv_norm_rope"))
# DOT: tl.dot over x padded to 16 rows (the tensor cores, pipelined operand loads) instead of the fp32 FMA
# reduction, for batches > 1 where the reduction path leaves bandwidth unused; an option the search tries, no default.
STAGE = {"BLOCK_N": [2, 4, 8, 16, 32], "BLOCK_K": [128, 256, 512, 1024, 2048, 4096], "SPLIT_K": [1, 2, 4, 8],
         "num_warps": [4, 8], "DOT": [False, True], "PREFETCH": [False, True]}
# At a decode batch (a task whose cases have more than one row) two keys for every GEMV stage: `fma_max_m`, the
# most rows the FMA reduction takes before tl.dot tiles take over (kernels_runtime.ops.gemv's FMA_MAX_M), and
# `dot_stages`, the tl.dot path's pipeline depth (DOT_STAGES). First: the default. One config then picks the path
# per batch bucket by M; batch-1 tasks' spaces do not change. Default 1 row: the FMA reduction of 8 rows spills
# (a qwen3-4b step 29 ms at batch 8 against 6.7 ms on tl.dot; docs/hardware.md names the measurement). Default 3
# tiles in flight: 12-15 % faster than 4 at batch 32 with the batch tiles below, even at batch 8 (the stacked-layer
# bench on qwen3-4b and llama-2-7b; docs/hardware.md). `norm_pass` on by default: the q/k/v input norm as a pass of
# its own, not a prologue every program repeats over K, was 8-12 % faster on the whole stack at batch 8 and 32 on the
# same bench, and as close to the fp32 stack as the prologue (docs/hardware.md).
FMA_ROWS = [1, 2, 4, 8, 16]
DOT_STAGES = [3, 4, 2]
MAX_ROWS = 64  # kernels_runtime.ops.gemv.MAX_ROWS: the rows one weight pass serves

def _stage_space(prefix: str) -> dict[str, list]:
    return {prefix + k: list(v) for k, v in STAGE.items()}


def rows_space(spec: TaskSpec, *prefixes: str) -> dict[str, list]:
    """`fma_max_m` (the values below its largest batch, and the default), `dot_stages`, `norm_pass` (a norm
    prologue's rows normalised in a pass of their own, kernels_runtime.ops.gemv's NORM_PASS) and the tl.dot tiles
    of the stages `prefixes` (`dot_tile_space`) for a task with batches; {} at batch 1."""
    rows = task_rows(spec)
    if rows <= 1:
        return {}
    return {"fma_max_m": [v for v in FMA_ROWS if v == FMA_ROWS[0] or v < rows], "dot_stages": list(DOT_STAGES),
            "norm_pass": [True, False], **dot_tile_space(spec, *prefixes)}


# The tl.dot path's own tile a stage (kernels_runtime.ops.gemv's DOT_BLOCK_N / DOT_BLOCK_K / DOT_SPLIT_K), so that
# batch 1 and a batch each run at their own tile from one config. First value, the default: the GEMV batch sweep's
# best point per projection over 8 and 32 rows on qwen3-4b's shapes (docs/hardware.md names the measurement); 0
# derives the tile from the stage's FMA tile (raised to tl.dot's minimum), the earlier behaviour.
DOT_TILE_DEFAULTS = {"qkv_": (64, 128, 1), "o_": (64, 256, 2), "gu_": (128, 128, 1), "dn_": (64, 256, 2)}
DOT_TILE_VALUES = {"DOT_BLOCK_N": [16, 32, 64, 128], "DOT_BLOCK_K": [64, 128, 256], "DOT_SPLIT_K": [1, 2, 4]}


def dot_tile_space(spec: TaskSpec, *prefixes: str) -> dict[str, list]:
    """The tl.dot tile keys of the stages `prefixes` for a task with batches (the default first, 0 last)."""
    if task_rows(spec) <= 1:
        return {}
    out = {}
    for p in prefixes:
        for (key, values), first in zip(DOT_TILE_VALUES.items(), DOT_TILE_DEFAULTS[p]):
            out[p + key] = [first, *(v for v in values if v != first), 0]
    return out


def _stage_default(prefix: str, n_out: int, k: int, sms: int) -> dict:
    """4-row programs 1024 deep (8 x 512 where K < 1024), 4 warps, no split: the sweep's usual best point at batch 1.
    No split-K: its second launch costs more than the idle SMs it
    fills."""
    bn, bk = (4, 1024) if k >= 1024 else (8, 512)
    return {prefix + "BLOCK_N": bn, prefix + "BLOCK_K": bk, prefix + "SPLIT_K": 1, prefix + "num_warps": 4,
            prefix + "DOT": False, prefix + "PREFETCH": False}


def _seeds(*prefixes: str):
    """seeds_fn: the sweep's runner-up point (8 rows x 512) on every stage, then a K split of 2 on every stage."""
    def seeds(spec: TaskSpec) -> list[dict]:
        a = {p + k: v for p in prefixes for k, v in (("BLOCK_N", 8), ("BLOCK_K", 512))}
        b = {p + "SPLIT_K": 2 for p in prefixes}
        return [a, b]
    return seeds


def _dim(spec: TaskSpec, *names: str, default: int = 4096) -> int:
    for n in names:
        v = spec.static.get(n)
        if isinstance(v, int) and v > 0:
            return v
    return default


def _bias_free(spec: TaskSpec, prefix: str = "") -> str | None:
    biased = [w for w in spec.weight_names if w.startswith(prefix) and w.endswith(".bias")]
    return f"projections with bias are out of scope: {biased}" if biased else None


# ------------------------------------------------------------------------------------------------------------ mlp

def _mlp_applies(spec: TaskSpec, prefix: str = "") -> str | None:
    need = {prefix + n for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")}
    if not need <= set(spec.weight_names):
        return f"expected weights {sorted(need)}, got {spec.weight_names}"
    act = spec.static.get(prefix + "act_fn.__class__", "SiLUActivation")
    if act not in ("SiLU", "SiLUActivation"):
        return f"expected a SiLU act_fn, got {act!r}"
    return _bias_free(spec, prefix)


def _mlp_task_applies(spec: TaskSpec) -> str | None:
    why = _mlp_applies(spec) or (None if spec.input_names == ["x"] else f"expected input ['x'], got {spec.input_names}")
    return f"mlp.decode_gemv: {why}" if why else None


def _mlp_dims(spec: TaskSpec, prefix: str = "") -> tuple[int, int]:
    h = _dim(spec, prefix + "hidden_size", prefix + "gate_proj.in_features", "hidden_size")
    i = _dim(spec, prefix + "intermediate_size", prefix + "gate_proj.out_features", default=4 * h)
    return h, i


def _mlp_space(spec):
    return {**_stage_space("gu_"), **_stage_space("dn_"), "num_stages": [1, 2, 3], **rows_space(spec, "gu_", "dn_")}


def _mlp_default(spec):
    h, i = _mlp_dims(spec)
    sms = sm_count(spec)
    return {**_stage_default("gu_", 2 * i, h, sms), **_stage_default("dn_", h, i, sms), "num_stages": 1}


def _mlp_render(spec, config):
    return host_source("mlp.decode_gemv", spec, config, HOSTS, "decode_mlp")


# ------------------------------------------------------------------------------------------------------ attention

def _attn_applies(spec: TaskSpec, prefix: str = "") -> str | None:
    need = {prefix + n for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")}
    if not need <= set(spec.weight_names):
        return f"expected weights {sorted(need)}, got {spec.weight_names}"
    if not {"hidden_states", "position_embeddings.0", "position_embeddings.1"} <= set(spec.input_names):
        return f"expected hidden_states and position_embeddings.0/.1 inputs, got {spec.input_names}"
    if mask_problem(spec):  # HF's bool mask is honoured (the pad keys excluded); other forms are not read
        return mask_problem(spec)
    if spec.static.get(prefix + "sliding_window"):
        return "sliding-window attention is out of scope"
    if set(spec.state_names) != {"key_cache", "value_cache"}:
        return f"expected the layer's key_cache and value_cache as state, got {spec.state_names}"
    return _bias_free(spec, prefix)


def _attn_dims(spec: TaskSpec, prefix: str = "") -> tuple[int, int, int]:
    h = _dim(spec, prefix + "q_proj.in_features", "hidden_size")
    nq = _dim(spec, prefix + "q_proj.out_features", default=h)
    nkv = _dim(spec, prefix + "k_proj.out_features", default=nq)
    return h, nq, nkv


def _attn_space(spec):
    attn = {k: v for k, v in ATTN_DECODE.items() if k != "cache_update"}
    return {**_stage_space("qkv_"), **_stage_space("o_"), **attn, "num_stages": [1, 2, 3],
            **rows_space(spec, "qkv_", "o_")}


def _attn_default(spec, prefix=""):
    h, nq, nkv = _attn_dims(spec, prefix)
    sms = sm_count(spec)
    return {**_stage_default("qkv_", nq + 2 * nkv, h, sms), **_stage_default("o_", h, nq, sms), "attn_BLOCK_N": 64,
            "attn_num_splits": None, "attn_num_warps": 4, "num_stages": 1}


def _attn_render(spec, config):
    return host_source("attention.decode_fused_qkv", spec, config, HOSTS, "decode_attention")


# -------------------------------------------------------------------------------------------------- decoder layer

ATTN_P, MLP_P = "self_attn.", "mlp."


def _layer_structure(spec: TaskSpec) -> str | None:
    """Why the task's module is not a pre-norm Llama-style layer (both layer templates' scope), or None."""
    for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        if norm not in spec.weight_names:
            return f"expected {norm} (a pre-norm Llama-style layer), got {spec.weight_names}"
    extra = [w for w in spec.weight_names if not w.startswith((ATTN_P, MLP_P, "input_layernorm.",
                                                                "post_attention_layernorm."))]
    if extra:  # Gemma-2's pre/post feedforward norms, ...: another layer structure
        return f"weights outside a Llama-style layer: {extra} (Gemma-2's: decoder_layer.decode_static_gemma2)"
    for key in ("input_layernorm.variance_epsilon", "post_attention_layernorm.variance_epsilon"):
        if not isinstance(spec.static.get(key), float):
            return f"expected static {key}, got {spec.static.get(key)!r}"
    return None


def _layer_applies(spec: TaskSpec) -> str | None:
    why = _layer_structure(spec) or _attn_applies(spec, ATTN_P) or _mlp_applies(spec, MLP_P)
    return f"decoder_layer.decode_fused: {why}" if why else None


def _layer_space(spec):
    return {"post_norm": ["o_reduce", "gate_up_prologue"], **_attn_space(spec), **_stage_space("gu_"),
            **_stage_space("dn_"), **dot_tile_space(spec, "gu_", "dn_"), **post_norm_rows_space(spec)}


def _layer_default(spec):
    h, i = _mlp_dims(spec, MLP_P)
    sms = sm_count(spec)
    return {"post_norm": "o_reduce", **_attn_default(spec, ATTN_P), **_stage_default("gu_", 2 * i, h, sms),
            **_stage_default("dn_", h, i, sms)}


def _layer_render(spec, config):
    return host_source("decoder_layer.decode_fused", spec, config, HOSTS, "decode_fused_layer")


# ------------------------------------------------------------------------------------ decoder layer, static cache
# decoder_layer.decode_static: the layer of decoder_layer.decode_fused on transformers' static KV cache (what decode
# graphs run on): input_layernorm in the q/k/v GEMV's prologue (the raw projections, one pass over the three
# weights), attention.decode_static's kernel for the q/k norms + rotary + the cache write at the device-side length
# + split-KV attention (kernels_runtime.hosts.attention_common.static_attention, the same call), then o_proj +
# residual + post_attention_layernorm, gate/up + SwiGLU, down_proj + residual as decode_fused. Nothing is read on
# the host. The attention mask (every static-cache call carries one) is honoured as attention.decode_static honours
# it: the kernel reads its decode row on the device (a left-padded row's pad keys excluded); the forms it cannot
# read are refused (static_mask_problem).

ATTN_WEIGHTS = {ATTN_P + n for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                     "q_norm.weight", "k_norm.weight")}


def _layer_static_applies(spec: TaskSpec) -> str | None:
    why = _layer_structure(spec) or _attn_static_applies(spec) or _mlp_applies(spec, MLP_P)
    return f"decoder_layer.decode_static: {why}" if why else None


def _attn_static_applies(spec: TaskSpec, softcap_ok: bool = False) -> str | None:
    need = {ATTN_P + n for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")}
    if not need <= set(spec.weight_names):
        return f"expected weights {sorted(need)}, got {spec.weight_names}"
    unread = [w for w in spec.weight_names if w.startswith(ATTN_P) and w not in ATTN_WEIGHTS]
    if unread:  # StableLM's q/k LayerNorms, ...: another computation
        return f"attention weights the template does not read: {unread}"
    if (ATTN_P + "q_norm.weight" in spec.weight_names) != (ATTN_P + "k_norm.weight" in spec.weight_names):
        return "expected both q_norm and k_norm, or neither"
    if not {"hidden_states", "position_embeddings.0", "position_embeddings.1"} <= set(spec.input_names):
        return f"expected hidden_states and position_embeddings.0/.1 inputs, got {spec.input_names}"
    if _adapter(spec) not in STATIC_ADAPTERS:
        return f"expected a static KV cache task ({STATIC_ADAPTERS}), got {_adapter(spec)} " \
               f"(decoder_layer.decode_fused takes the dynamic cache)"
    if set(spec.state_names) != {"key_cache", "value_cache", "cache_len"}:
        return f"expected the layer's key_cache, value_cache and cache_len as state, got {spec.state_names}"
    if not isinstance(spec.static.get(ATTN_P + "head_dim"), int):
        return f"expected static {ATTN_P}head_dim, got {spec.static.get(ATTN_P + 'head_dim')!r}"
    if spec.static.get(ATTN_P + "attention_type") not in (None, "full_attention", "sliding_attention"):
        return f"attention type {spec.static.get(ATTN_P + 'attention_type')!r} is out of scope"
    attn_static = {k[len(ATTN_P):]: v for k, v in spec.static.items() if k.startswith(ATTN_P)}
    if not softcap_ok and any(attn_static.get(n) is not None for n in ("attn_logit_softcapping",
                                                                        "config.attn_logit_softcapping")):
        # whether the module caps depends on its attention implementation (module_softcap), not recorded here
        return f"logit soft-capping is out of scope (module_softcap: {module_softcap(attn_static)})"
    return static_mask_problem(spec) or _bias_free(spec, ATTN_P)


def _layer_static_space(spec):
    return {"post_norm": ["o_reduce", "gate_up_prologue"], **_stage_space("qkv_"), **_stage_space("o_"),
            **ATTN_STATIC, **_stage_space("gu_"), **_stage_space("dn_"), "num_stages": [1, 2, 3],
            "pdl": [False, True] if sm90_capable(spec) else [False], **l2_prefetch_space(spec), **tma_space(spec),
            **rows_space(spec, "qkv_", "o_", "gu_", "dn_"), **pdl_rows_space(spec), **post_norm_rows_space(spec)}


def post_norm_rows_space(spec: TaskSpec) -> dict[str, list]:
    """`post_norm_batch` (kernels_runtime.hosts.decode_layer.mlp_half: where post_attention_layernorm runs for a call
    of more than one row; first the default, o_proj's reduction) for a task with batches; {} at batch 1."""
    return {"post_norm_batch": ["o_reduce", "gate_up_prologue"]} if task_rows(spec) > 1 else {}


def pdl_rows_space(spec: TaskSpec) -> dict[str, list]:
    """`pdl_max_m` (kernels_runtime.hosts.decode_layer.PDL_MAX_M: the most rows a layer call launches its kernels
    with PDL; first the default, one row) for a task with batches on sm_90+; {} otherwise."""
    if task_rows(spec) <= 1 or not sm90_capable(spec):
        return {}
    return {"pdl_max_m": [1, MAX_ROWS]}


TMA_STAGES = [0, 2, 3, 4, 5, 6, 8]  # a stage's `TMA` (kernels_runtime.ops.gemv): 0 off, else the pipeline's depth
# the passes the search may feed by TMA: gate/up and down (o_proj by TMA lost 2-7 us a layer on all three reference
# shapes; q/k/v streams three weights, which the TMA pass does not take)
TMA_PASSES = ("gu_", "dn_")


def _tma(prefix: str, block_n: int, block_k: int, stages: int, pre: bool = True, late: bool = False) -> dict:
    return {prefix + "TMA": stages, prefix + "BLOCK_N": block_n, prefix + "BLOCK_K": block_k,
            prefix + "TMA_PRE": pre, prefix + "TMA_LATE": late}


# gate/up by TMA, the first tile before PDL's wait: the best layer of each reference shape in the stacked-layer bench
# (us a layer against the register default): qwen3-4b 16 rows x 256, 4 stages, the
# next kernel let launch late (68.4 against 72.5); Llama-3.2-3B 32 x 256, 2 stages (62.8 against 68.3); llama-2-7b
# 32 x 128, 5 stages, late (124.1 against 126.6). Which one wins turns on how the programs fill the SMs' shared memory.
TMA_SEEDS = [_tma("gu_", 16, 256, 4, late=True), _tma("gu_", 32, 256, 2), _tma("gu_", 32, 128, 5, late=True)]

def tma_space(spec: TaskSpec) -> dict:
    """gate/up's and down's weight tiles by TMA (sm_90+), `TMA` the pipeline's depth (0: the register pass), and
    gate/up's 64-row programs (32 rows of each weight), the probe's best TMA point;
    `TMA_PRE`: the first tile loaded before PDL's wait; `TMA_LATE`: the next kernel let launch after the loop."""
    depths = TMA_STAGES if sm90_capable(spec) else [0]
    flags = [False, True] if sm90_capable(spec) else [False]
    return {"gu_TMA": list(depths), "dn_TMA": list(depths), "gu_BLOCK_N": STAGE["BLOCK_N"] + [64],
            **{p + f: list(flags) for p in TMA_PASSES for f in ("TMA_PRE", "TMA_LATE")}}


def l2_prefetch_space(spec: TaskSpec) -> dict:
    """L2 prefetches (sm_90's bulk prefetch, so only where PDL is): the attention asks the L2 for o_proj's weight
    (`l2pf_o`) while it leaves HBM idle, and o_proj, then reading from L2, for the first MB of gate/up
    (`l2pf_mlp_mb`)."""
    if not sm90_capable(spec):
        return {"l2pf_o": [False], "l2pf_mlp_mb": [0]}
    return {"l2pf_o": [False, True], "l2pf_mlp_mb": [0, 8, 16, 24]}


def _layer_static_default(spec):
    """Four launches of weight-streaming GEMVs plus the attention's two: input_layernorm in the q/k/v pass,
    o_proj + residual, the post norm in the paired gate/up pass, down + residual; each kernel launched with PDL
    (it loads its first weight or K/V tile while the one before drains); the cache split that fills the SMs.
    The sweep's fastest point."""
    h, nq, nkv = _attn_dims(spec, ATTN_P)
    _, i = _mlp_dims(spec, MLP_P)
    sms = sm_count(spec)
    attn = {k: v for k, v in _STATIC_DEFAULT.items() if k.startswith("attn_")}
    return {"post_norm": "gate_up_prologue", **_stage_default("qkv_", nq + 2 * nkv, h, sms),
            **_stage_default("o_", h, nq, sms), **attn, **cache_splits(spec, ATTN_P),
            **_stage_default("gu_", 2 * i, h, sms), **_stage_default("dn_", h, i, sms), "num_stages": 1,
            "pdl": sm90_capable(spec), "l2pf_o": False, "l2pf_mlp_mb": 0, "gu_TMA": 0, "dn_TMA": 0,
            **{p + f: False for p in TMA_PASSES for f in ("TMA_PRE", "TMA_LATE")}}


def _occupancy_split(prefix: str, n_out: int, k: int, sms: int, block_n: int, block_k: int) -> dict:
    """The stage's SPLIT_K that gives its GEMV at least one program per SM, never finer than one BLOCK_K tile."""
    return {prefix + "SPLIT_K": occupancy_split(n_out, sms, block_n, max(1, -(-k // block_k)))}


def _layer_static_seeds(spec: TaskSpec) -> list[dict]:
    """Points that differ from the default in what they run: on sm_90+ first gate/up by TMA (TMA_SEEDS, one point
    a reference shape), then its GEMVs software-pipelined (num_stages 3), the post norm in o_proj's reduction (one
    more launch), decode_fused's seeds (8 rows x 512, a K split of 2 everywhere); the GEMV occupancy split after the
    first, only where it changes a stage (on qwen3-4b's layer every stage already covers the SMs unsplit)."""
    h, nq, nkv = _attn_dims(spec, ATTN_P)
    _, i = _mlp_dims(spec, MLP_P)
    sms, base = sm_count(spec), _layer_static_default(spec)
    occupancy = {}
    for p, n, k in (("qkv_", nq + 2 * nkv, h), ("o_", h, nq), ("gu_", 2 * i, h), ("dn_", h, i)):
        occupancy.update(_occupancy_split(p, n, k, sms, base[p + "BLOCK_N"], base[p + "BLOCK_K"]))
    a, b = _seeds("qkv_", "o_", "gu_", "dn_")(spec)
    seeds = [{"num_stages": 3}, {"post_norm": "o_reduce"}, a, b]
    if any(v > 1 for v in occupancy.values()):
        seeds.insert(1, occupancy)
    if sm90_capable(spec):  # first: the stacked-layer bench's best points
        seeds[:0] = [dict(sd) for sd in TMA_SEEDS]
    return seeds


def _layer_static_render(spec, config):
    return host_source("decoder_layer.decode_static", spec, config, HOSTS, "decode_static_layer")


# -------------------------------------------------------------------------- Gemma-2's decoder layer, static cache
# decoder_layer.decode_static_gemma2: Gemma2DecoderLayer (h = x + post_attention_layernorm(attn(input_layernorm(x)));
# out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))), Gemma's fp32 (1 + w) norms, a gelu-tanh
# gated MLP) on decode_static's ops and keys: the same four weight passes plus the attention, the norms in the
# prologue and the reductions (kernels_runtime.hosts.decode_layer.decode_static_gemma2_layer). The attention applies
# the module's soft-cap where its implementation does (attention_common.softcap: not under SDPA) and its window.
# No `post_norm` choice (both norms sit in o_proj's reduction) and no TMA for down_proj (its reduction holds the
# post-feedforward norm).

GEMMA2_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")
GELU_TANH = ("GELUTanh", "PytorchGELUTanh")  # transformers' gelu_pytorch_tanh: torch's gelu(approximate="tanh")
GEMMA2_DROP = ("post_norm", "post_norm_batch", "dn_TMA", "dn_TMA_PRE", "dn_TMA_LATE")  # decode_static's keys this layer has not


def _gemma2_structure(spec: TaskSpec) -> str | None:
    if not spec.module_class.endswith(".Gemma2DecoderLayer"):  # the norm weights alone do not say (1 + w)
        return f"expected transformers' Gemma2DecoderLayer (Gemma's 1 + w norms), got {spec.module_class}"
    norms = [n + ".weight" for n in GEMMA2_NORMS]
    missing = [w for w in norms if w not in spec.weight_names]
    extra = [w for w in spec.weight_names if not w.startswith((ATTN_P, MLP_P)) and w not in norms]
    if missing or extra:
        return f"expected Gemma-2's four layer norms and nothing else outside attention and MLP, missing " \
               f"{missing}, extra {extra}"
    for n in GEMMA2_NORMS:
        if not isinstance(spec.static.get(n + ".eps"), float):
            return f"expected static {n}.eps, got {spec.static.get(n + '.eps')!r}"
    if any(ATTN_P + n in spec.weight_names for n in ("q_norm.weight", "k_norm.weight")):
        return "q/k norms (Gemma-3's 1 + w) are out of scope"
    act = spec.static.get(MLP_P + "act_fn.__class__")
    if act not in GELU_TANH:
        return f"expected a gelu-tanh act_fn {GELU_TANH}, got {act!r}"
    return _bias_free(spec, MLP_P)


def _gemma2_applies(spec: TaskSpec) -> str | None:
    why = _gemma2_structure(spec) or _attn_static_applies(spec, softcap_ok=True)
    return f"decoder_layer.decode_static_gemma2: {why}" if why else None


def _gemma2(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in GEMMA2_DROP}


def _gemma2_seeds(spec: TaskSpec) -> list[dict]:
    seeds = [_gemma2(sd) for sd in _layer_static_seeds(spec)]
    return [sd for sd in seeds if sd]


def _gemma2_render(spec, config):
    return host_source("decoder_layer.decode_static_gemma2", spec, config, HOSTS, "decode_static_gemma2_layer")


# -------------------------------------------------------------------------------------------------------- lm_head

def _lm_applies(spec: TaskSpec) -> str | None:
    if spec.weight_names != ["weight"] or spec.input_names != ["input"]:
        return f"lm_head.gemv: expected an nn.Linear without bias (input, weight), got {spec.input_names}, " \
               f"{spec.weight_names}"
    rows = task_rows(spec)
    if rows > MAX_ROWS:
        return f"lm_head.gemv: expected at most {MAX_ROWS} rows (decode, or prefill's last-token logits), got {rows}"
    return None




def _lm_default(spec):
    return {**_stage_default("lm_", _dim(spec, "out_features", default=32000), _dim(spec, "in_features"),
                             sm_count(spec)), "num_stages": 1}


def _lm_render(spec, config):
    return host_source("lm_head.gemv", spec, config, HOSTS, "lm_head")


TEMPLATES = [
    Template(name="mlp.decode_gemv", family="mlp", phases=("decode",), requires=OPS, space_fn=_mlp_space,
             render_fn=_mlp_render, applies_fn=_mlp_task_applies, default_fn=_mlp_default,
             seeds_fn=_seeds("gu_", "dn_")),
    Template(name="attention.decode_fused_qkv", family="attention", phases=("decode",), requires=(*OPS, DECODE_OP),
             space_fn=_attn_space, render_fn=_attn_render,
             applies_fn=lambda spec: (lambda why: why and f"attention.decode_fused_qkv: {why}")(_attn_applies(spec)),
             default_fn=_attn_default, seeds_fn=_seeds("qkv_", "o_")),
    Template(name="decoder_layer.decode_fused", family="decoder_layer", phases=("decode",), requires=(*OPS, DECODE_OP),
             space_fn=_layer_space, render_fn=_layer_render, applies_fn=_layer_applies, default_fn=_layer_default,
             seeds_fn=_seeds("qkv_", "o_", "gu_", "dn_")),
    Template(name="decoder_layer.decode_static", family="decoder_layer", phases=("decode",),
             requires=(*OPS, DECODE_STATIC_OP), space_fn=_layer_static_space, render_fn=_layer_static_render,
             applies_fn=_layer_static_applies, default_fn=_layer_static_default, seeds_fn=_layer_static_seeds),
    Template(name="decoder_layer.decode_static_gemma2", family="decoder_layer", phases=("decode",),
             requires=(*OPS, DECODE_STATIC_OP), space_fn=lambda spec: _gemma2(_layer_static_space(spec)),
             render_fn=_gemma2_render, applies_fn=_gemma2_applies,
             default_fn=lambda spec: _gemma2(_layer_static_default(spec)), seeds_fn=_gemma2_seeds),
    Template(name="lm_head.gemv", family="lm_head", phases=("prefill", "decode"), requires=OPS,
             space_fn=lambda spec: {**_stage_space("lm_"), "num_stages": [1, 2, 3], **rows_space(spec)},
             render_fn=_lm_render,
             applies_fn=_lm_applies, default_fn=_lm_default, seeds_fn=_seeds("lm_")),
]
