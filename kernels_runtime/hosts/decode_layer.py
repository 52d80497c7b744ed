"""Host code of the fused decode templates (llm4llm/search/templates/decode_fused.py): every projection a GEMV of
kernels_runtime.ops.gemv that streams its weight once, the work around it in the GEMV's prologue or its reduction.

- decode_mlp (mlp.decode_gemv): gate/up + SwiGLU in one pass, down_proj;
- decode_attention (attention.decode_fused_qkv): q/k/v + q/k norms + rotary in one pass, past ++ new, the split-KV
  decode attention, o_proj;
- decode_fused_layer (decoder_layer.decode_fused): the same attention with input_layernorm in q/k/v's prologue, then
  the MLP half (post_attention_layernorm in o_proj's reduction or gate/up's prologue: `post_norm`);
- decode_static_layer (decoder_layer.decode_static): the raw q/k/v pass, attention_decode_static on the static cache
  (attention_common.static_attention), the same MLP half;
- decode_static_gemma2_layer (decoder_layer.decode_static_gemma2): Gemma-2's sandwich-norm layer on the same ops;
- lm_head (lm_head.gemv): the vocabulary projection.

Each GEMV stage's keyword arguments come from the config's keys under its prefix (`qkv_`, `o_`, `gu_`, `dn_`, `lm_`)
plus the shared `num_stages`, `pdl`, `fma_max_m`, `dot_stages` (`stage`); they depend on the config only, so each
factory computes them once and a call only unpacks them.
"""
from __future__ import annotations

import functools

from kernels_runtime.hosts import prefixed, static_value
from kernels_runtime.hosts.attention_common import pad_keys, static_attention, with_past
from kernels_runtime.ops.attention_decode import attention_decode
from kernels_runtime.ops.gemv import gate_up_swiglu, gemv, gemv_residual_rmsnorm, qkv_norm_rope

ATTN_P = "self_attn."  # the decoder layer's attention weights and static values
# the keys attention_common.static_attention reads: its op's `attn_` kwargs, PDL and o_proj's L2 prefetch
STATIC_STEP_KEYS = ("pdl", "l2pf_o")


def stage(config: dict, prefix: str) -> dict:
    """One GEMV stage's keyword arguments: its `prefix`ed keys, the shared pipeline depth, PDL and the batch keys
    (`fma_max_m`, `dot_stages`, `norm_pass`)."""
    kw = prefixed(config, prefix)
    kw["num_stages"] = config["num_stages"]
    kw["PDL"] = bool(config.get("pdl", False))
    if "fma_max_m" in config:
        kw["FMA_MAX_M"] = config["fma_max_m"]
    if "dot_stages" in config:
        kw["DOT_STAGES"] = config["dot_stages"]
    if "norm_pass" in config:
        kw["NORM_PASS"] = config["norm_pass"]
    return kw


# PDL (each kernel launched while the one before drains) gains ~10 % a qwen3-4b layer at one row, and costs 4-8 % at 8
# and 32 rows, where each GEMV's weight pass is long enough to hide its own launch (the stacked-layer bench with and
# without it; docs/hardware.md names the measurement). So by default a layer's kernels use it up to PDL_MAX_M rows
# only; a config's `pdl_max_m` moves the limit (the search may try it).
PDL_MAX_M = 1


def pdl_by_rows(factory):
    """A decoder-layer factory whose config's PDL applies to calls of at most `pdl_max_m` rows (batch x tokens):
    two entries made once, one with PDL and one without, picked per call by the rows of hidden_states (a decode
    graph captures the one its bucket takes)."""
    @functools.wraps(factory)
    def make(config: dict):
        with_pdl = factory(config)
        if not config.get("pdl"):
            return with_pdl
        without = factory({**config, "pdl": False})
        limit = int(config.get("pdl_max_m", PDL_MAX_M))

        def entry(inputs, weights, state, static):
            x = inputs["hidden_states"]
            rows = x.shape[0] * x.shape[1]
            return (with_pdl if rows <= limit else without)(inputs, weights, state, static)
        return entry
    return make


def mlp_prefetch(config: dict):
    """weights -> o_proj's L2 prefetch: the first `l2pf_mlp_mb` MB of gate/up (half each), the rows gate/up's first
    programs read; () without it."""
    half = int(config.get("l2pf_mlp_mb") or 0) * (1 << 20) // 2
    if not half:
        return lambda weights: ()
    return lambda weights: ((weights["mlp.gate_proj.weight"], half), (weights["mlp.up_proj.weight"], half))


def decode_mlp(config: dict):
    gu, dn = stage(config, "gu_"), stage(config, "dn_")

    def entry(inputs, weights, state, static):
        x = inputs["x"]  # [B, 1, H]
        h = gate_up_swiglu(x, weights["gate_proj.weight"], weights["up_proj.weight"], **gu)  # [B, 1, I]
        return {"out": gemv(h, weights["down_proj.weight"], **dn)}
    return entry


def attention_step(config: dict):
    """(xin, inputs, weights, static, state, p, norm_w, norm_eps) -> (o [B*S, Hq*D], k_all, v_all): q/k/v (+ the
    q/k norms + rotary, + a norm in the prologue) in one pass, past ++ new token (copies: the state-in is never
    modified), the split-KV decode attention; weights and static values under the prefix `p`."""
    qkv, attn = stage(config, "qkv_"), prefixed(config, "attn_")

    def attend(xin, inputs, weights, static, state, p, norm_w=None, norm_eps=1e-6):
        B, S, _ = xin.shape
        D = int(static_value(static, p + "head_dim"))
        cos, sin = inputs["position_embeddings.0"], inputs["position_embeddings.1"]  # [B, 1, D]
        qn, kn = weights.get(p + "q_norm.weight"), weights.get(p + "k_norm.weight")
        eps = float(static_value(static, p + "q_norm.variance_epsilon", p + "q_norm.eps")) if qn is not None \
            else 1e-6
        q, k, v = qkv_norm_rope(xin.reshape(B * S, -1), weights[p + "q_proj.weight"], weights[p + "k_proj.weight"],
                                weights[p + "v_proj.weight"], cos.reshape(B * S, D), sin.reshape(B * S, D), D,
                                q_norm_w=qn, k_norm_w=kn, eps=eps, norm_w=norm_w, norm_eps=norm_eps,
                                **qkv)  # [B*S, H, D] views of one buffer
        q = q.view(B, S, -1, D).transpose(1, 2)  # [B, Hq, 1, D]
        k_all, _ = with_past(state.get("key_cache"), k.view(B, S, -1, D).transpose(1, 2))  # [B, Hkv, S_past + 1, D]
        v_all, _ = with_past(state.get("value_cache"), v.view(B, S, -1, D).transpose(1, 2))
        kv_mask = pad_keys(inputs, B, k_all.shape[2])  # a padded batch's decode row [B, S_past + 1], or None
        o = attention_decode(q, k_all, v_all, float(static_value(static, p + "scaling")), kv_mask=kv_mask,
                             **attn)  # [B, Hq, 1, D]
        return o.transpose(1, 2).reshape(B * S, -1), k_all, v_all
    return attend


def decode_attention(config: dict):
    attend, o_kw = attention_step(config), stage(config, "o_")

    def entry(inputs, weights, state, static):
        x = inputs["hidden_states"]  # [B, 1, H]
        o, k_all, v_all = attend(x, inputs, weights, static, state, "")
        out = gemv(o, weights["o_proj.weight"], **o_kw).view(*x.shape[:-1], -1)
        return {"out": out, "state_out.key_cache": k_all, "state_out.value_cache": v_all}
    return entry


def mlp_half(config: dict):
    """(o, x2, weights, static) -> the layer's output rows: o_proj + the residual add (x2: the layer's input rows) +
    post_attention_layernorm, gate/up + SwiGLU, down_proj + the second residual add. `post_norm` picks where the
    norm runs: o_proj's reduction (one program a row; `o_reduce`) or gate/up's prologue (every gate/up program
    reads the row for its rstd; `gate_up_prologue`). `post_norm_batch` (a task with batches) picks it for calls of
    more than one row: on tl.dot tiles the prologue's per-tile normalisation, redone by every gate/up program, cost
    more than o_proj's extra reduction launch (docs/hardware.md)."""
    single = _mlp_half(config, config["post_norm"])
    batch = config.get("post_norm_batch", config["post_norm"])
    if batch == config["post_norm"]:
        return single
    rows = _mlp_half(config, batch)

    def mlp(o, x2, weights, static):
        return (single if o.shape[0] <= 1 else rows)(o, x2, weights, static)
    return mlp


def _mlp_half(config: dict, post_norm: str):
    o_kw, gu, dn, prefetch = stage(config, "o_"), stage(config, "gu_"), stage(config, "dn_"), mlp_prefetch(config)
    if post_norm == "o_reduce":
        def mlp(o, x2, weights, static):
            h, hn = gemv_residual_rmsnorm(o, weights["self_attn.o_proj.weight"], x2,
                                          weights["post_attention_layernorm.weight"],
                                          float(static["post_attention_layernorm.variance_epsilon"]),
                                          l2_prefetch=prefetch(weights), **o_kw)
            g = gate_up_swiglu(hn, weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"], **gu)
            return gemv(g, weights["mlp.down_proj.weight"], residual=h, **dn)
        return mlp

    def mlp_prologue(o, x2, weights, static):
        h = gemv(o, weights["self_attn.o_proj.weight"], residual=x2, l2_prefetch=prefetch(weights), **o_kw)
        g = gate_up_swiglu(h, weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"],
                           norm_w=weights["post_attention_layernorm.weight"],
                           eps=float(static["post_attention_layernorm.variance_epsilon"]), **gu)
        return gemv(g, weights["mlp.down_proj.weight"], residual=h, **dn)
    return mlp_prologue


def decode_fused_layer(config: dict):
    """HF's pre-norm layer: h = x + o_proj(attn(input_layernorm(x))); out = h + mlp(post_attention_layernorm(h)),
    on the dynamic cache (past ++ new returned as the state-out)."""
    attend, mlp = attention_step(config), mlp_half(config)

    def entry(inputs, weights, state, static):
        x = inputs["hidden_states"]  # [B, 1, H]
        o, k_all, v_all = attend(x, inputs, weights, static, state, ATTN_P, norm_w=weights["input_layernorm.weight"],
                                 norm_eps=float(static["input_layernorm.variance_epsilon"]))
        out = mlp(o, x.reshape(-1, x.shape[-1]), weights, static)
        return {"out": out.view(x.shape), "state_out.key_cache": k_all, "state_out.value_cache": v_all}
    return entry


def static_attend(x, inputs, weights, state, static, qkv: dict, step: dict, gemma_norm: bool = False):
    """x [B, 1, H] -> (x2 [B, H], o [B, Hq * D], the state-out): input_layernorm in the raw q/k/v pass's prologue
    (gemma_norm: Gemma's), then attention_common.static_attention on the static cache (in place)."""
    B, S, _ = x.shape
    x2 = x.reshape(-1, x.shape[-1])
    D = int(static_value(static, "self_attn.head_dim"))
    norm_eps = float(static_value(static, "input_layernorm.variance_epsilon", "input_layernorm.eps"))
    q, k, v = qkv_norm_rope(x2, weights["self_attn.q_proj.weight"], weights["self_attn.k_proj.weight"],
                            weights["self_attn.v_proj.weight"], None, None, D, norm_w=weights["input_layernorm.weight"],
                            norm_eps=norm_eps, gemma_norm=gemma_norm, **qkv)  # [B*S, H, D] views of one buffer
    q, k, v = (t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))  # [B, H, 1, D] views
    o, state_out = static_attention(q, k, v, inputs, weights, state, static, step, ATTN_P)  # [B, Hq, 1, D]
    return x2, o.transpose(1, 2).reshape(B * S, -1), state_out


@pdl_by_rows
def decode_static_layer(config: dict):
    """decode_fused_layer on transformers' static KV cache: input_layernorm in the q/k/v pass's prologue (the raw
    projections: the attention kernel applies the q/k norms and rotary), attention_decode_static (the cache write at
    the device-side length, split-KV attention, the length advanced, all in place), the same MLP half."""
    qkv, mlp = stage(config, "qkv_"), mlp_half(config)
    # only what static_attention reads, so its per-call prefixed() scans a few keys, not the whole config
    step = {k: v for k, v in config.items() if k.startswith("attn_") or k in STATIC_STEP_KEYS}

    def entry(inputs, weights, state, static):
        x = inputs["hidden_states"]  # [B, 1, H]
        x2, o, state_out = static_attend(x, inputs, weights, state, static, qkv, step)
        out = mlp(o, x2, weights, static)
        return {"out": out.view(x.shape), **state_out}
    return entry


def _eps(static: dict, norm: str) -> float:
    return float(static_value(static, norm + ".eps", norm + ".variance_epsilon"))


@pdl_by_rows
def decode_static_gemma2_layer(config: dict):
    """Gemma2DecoderLayer on the static KV cache: h = x + post_attention_layernorm(attn(input_layernorm(x)));
    out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))), every norm Gemma's (fp32, 1 + w).
    input_layernorm in the raw q/k/v pass's prologue; attention_decode_static (the module's scaling, soft-cap and
    sliding window: static_attention); o_proj with post_attention_layernorm, the residual add and
    pre_feedforward_layernorm in its reduction; gate/up + gelu-tanh in one pass; down_proj with
    post_feedforward_layernorm and the second residual add in its reduction."""
    qkv, o_kw, gu, dn = stage(config, "qkv_"), stage(config, "o_"), stage(config, "gu_"), stage(config, "dn_")
    prefetch = mlp_prefetch(config)
    step = {k: v for k, v in config.items() if k.startswith("attn_") or k in STATIC_STEP_KEYS}

    def entry(inputs, weights, state, static):
        x = inputs["hidden_states"]  # [B, 1, H]
        x2, o, state_out = static_attend(x, inputs, weights, state, static, qkv, step, gemma_norm=True)
        h, hn = gemv_residual_rmsnorm(o, weights["self_attn.o_proj.weight"], x2,
                                      weights["pre_feedforward_layernorm.weight"],
                                      _eps(static, "pre_feedforward_layernorm"),
                                      out_norm_w=weights["post_attention_layernorm.weight"],
                                      out_eps=_eps(static, "post_attention_layernorm"), gemma=True,
                                      l2_prefetch=prefetch(weights), **o_kw)
        g = gate_up_swiglu(hn, weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"], act="gelu_tanh", **gu)
        out, _ = gemv_residual_rmsnorm(g, weights["mlp.down_proj.weight"], h, None,
                                       out_norm_w=weights["post_feedforward_layernorm.weight"],
                                       out_eps=_eps(static, "post_feedforward_layernorm"), gemma=True, **dn)
        return {"out": out.view(x.shape), **state_out}
    return entry


def lm_head(config: dict):
    kw = stage(config, "lm_")

    def entry(inputs, weights, state, static):
        return {"out": gemv(inputs["input"], weights["weight"], **kw)}
    return entry
