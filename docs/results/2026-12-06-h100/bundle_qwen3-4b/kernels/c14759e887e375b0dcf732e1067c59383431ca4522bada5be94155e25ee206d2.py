"""Candidate from template decoder_layer.decode_static for a decoder_layer/decode task (bfloat16)."""
import torch
import triton
import triton.language as tl
from kernels_runtime.ops.gemv import gate_up_swiglu, gemv, gemv_residual_rmsnorm, qkv_norm_rope
from kernels_runtime.ops.attention_decode_static import attention_decode_static

CONFIG = {'attn_BLOCK_N': 32, 'attn_num_splits': 32, 'attn_num_stages': 2, 'attn_num_warps': 4, 'dn_BLOCK_K': 1024, 'dn_BLOCK_N': 4, 'dn_DOT': False, 'dn_PREFETCH': False, 'dn_SPLIT_K': 1, 'dn_TMA': 0, 'dn_TMA_LATE': False, 'dn_TMA_PRE': False, 'dn_num_warps': 4, 'gu_BLOCK_K': 256, 'gu_BLOCK_N': 16, 'gu_DOT': False, 'gu_PREFETCH': False, 'gu_SPLIT_K': 1, 'gu_TMA': 4, 'gu_TMA_LATE': True, 'gu_TMA_PRE': True, 'gu_num_warps': 4, 'l2pf_mlp_mb': 0, 'l2pf_o': False, 'num_stages': 1, 'o_BLOCK_K': 1024, 'o_BLOCK_N': 4, 'o_DOT': False, 'o_PREFETCH': False, 'o_SPLIT_K': 1, 'o_num_warps': 4, 'pdl': True, 'post_norm': 'gate_up_prologue', 'qkv_BLOCK_K': 1024, 'qkv_BLOCK_N': 4, 'qkv_DOT': False, 'qkv_PREFETCH': False, 'qkv_SPLIT_K': 1, 'qkv_num_warps': 4}

def _static(static, *names):
    for n in names:
        if n in static:
            return static[n]
    raise KeyError(f"static: expected one of {names}, got {sorted(static)}")
LIN = {k[4:]: v for k, v in CONFIG.items() if k.startswith('lin_')}
ROPE = {k[5:]: v for k, v in CONFIG.items() if k.startswith("rope_")}
ATTN = {k[5:]: v for k, v in CONFIG.items() if k.startswith("attn_")}


def _proj(x, weights, name, B, S, D):
    # [B, S, H*D] -> [B, H, S, D] (a transposed view, as HF lays it out)
    return linear(x, weights[name + ".weight"], weights.get(name + ".bias"), **LIN).view(B, S, -1, D).transpose(1, 2)


def _rope(q, k, inputs, weights, static):
    cos, sin = inputs["position_embeddings.0"], inputs["position_embeddings.1"]  # [B, S, R], R < D: partial
    if "q_norm.weight" in weights:
        eps = float(_static(static, "q_norm.variance_epsilon", "q_norm.eps", "rms_norm_eps"))
        return qk_norm_rotary(q, k, cos, sin, weights["q_norm.weight"], weights["k_norm.weight"], eps, **ROPE)
    return rotary(q, k, cos, sin, **ROPE)


def _head_dim(static):
    return int(_static(static, "head_dim", "head_size"))


def _with_past(past, new, extra=0):
    # [B, Hkv, S_past, D] ++ [B, Hkv, S, D] by copies into a new buffer (the state-in is never modified);
    # `extra` > 0 leaves that many positions unwritten after the past instead of copying `new`.
    sp = 0 if past is None else past.shape[2]
    B, H, S, D = new.shape
    out = torch.empty((B, H, sp + (extra or S), D), dtype=new.dtype, device=new.device)
    if sp:
        out[:, :, :sp].copy_(past)
    if not extra:
        out[:, :, sp:].copy_(new)
    return out, sp


def _stage(prefix):
    kw = {k[len(prefix):]: v for k, v in CONFIG.items() if k.startswith(prefix)}
    kw["num_stages"] = CONFIG["num_stages"]
    kw["PDL"] = bool(CONFIG.get("pdl", False))
    return kw


def _mlp_prefetch(weights):
    # l2pf_mlp_mb: o_proj asks the L2 for the first MB of gate/up (half each), the rows gate/up's first programs read
    half = int(CONFIG.get("l2pf_mlp_mb") or 0) * (1 << 20) // 2
    return ((weights["mlp.gate_proj.weight"], half), (weights["mlp.up_proj.weight"], half)) if half else ()


def _opt(static, *names):
    for n in names:
        if static.get(n) is not None:
            return static[n]
    return None


def _softcap(static, p=""):
    # the cap the module applies: transformers' SDPA path ignores it (templates.attention.module_softcap)
    if "sdpa" in str(static.get(p + "attn_implementation") or ""):
        return None
    return _opt(static, p + "attn_logit_softcapping", p + "config.attn_logit_softcapping")


def _static_attention(q, k, v, inputs, weights, state, static, p=""):
    # q: [B, Hq, 1, D], k/v: [B, Hkv, 1, D] (views) -> o [B, Hq, 1, D], the state-out (the state-in, written)
    kc, vc, n = state["key_cache"], state["value_cache"], state["cache_len"]  # [B, Hkv, S_max, D], 0-d int64
    norm = p + "q_norm.weight" in weights
    eps = float(_static(static, p + "q_norm.variance_epsilon", p + "q_norm.eps", "rms_norm_eps")) if norm else 1e-6
    window = _opt(static, p + "sliding_window")
    cap = _softcap(static, p)
    o = attention_decode_static(
        q, k, v, kc, vc, n, inputs["position_embeddings.0"], inputs["position_embeddings.1"],
        float(_static(static, p + "scaling")), q_norm_weight=weights.get(p + "q_norm.weight"),
        k_norm_weight=weights.get(p + "k_norm.weight"), eps=eps, sliding_window=int(window) if window else None,
        softcap=float(cap) if cap else None, PDL=bool(CONFIG.get("pdl", False)),
        # o_proj's weight into L2 while the attention leaves HBM idle (l2pf_o: decoder_layer.decode_static)
        l2_prefetch=weights.get(p + "o_proj.weight") if CONFIG.get("l2pf_o") else None, **ATTN)
    return o, {"state_out.key_cache": kc, "state_out.value_cache": vc, "state_out.cache_len": n}


def entry(inputs, weights, state, static):
    # HF's pre-norm layer: h = x + o_proj(attn(input_layernorm(x))); out = h + mlp(post_attention_layernorm(h))
    x = inputs["hidden_states"]  # [B, 1, H]
    B, S, _ = x.shape
    x2 = x.reshape(-1, x.shape[-1])
    D = int(_static(static, "self_attn.head_dim"))
    # input_layernorm in the GEMV's prologue, the raw q/k/v (no rotary here: the attention kernel applies it)
    q, k, v = qkv_norm_rope(x2, weights["self_attn.q_proj.weight"], weights["self_attn.k_proj.weight"],
                            weights["self_attn.v_proj.weight"], None, None, D,
                            norm_w=weights["input_layernorm.weight"],
                            norm_eps=float(static["input_layernorm.variance_epsilon"]),
                            **_stage("qkv_"))  # [B*S, H, D] views of one buffer
    q, k, v = (t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))  # [B, H, 1, D] views
    # q/k norms + rotary + the cache write at the device-side length + split-KV attention, the length advanced
    o, state_out = _static_attention(q, k, v, inputs, weights, state, static, "self_attn.")  # [B, Hq, 1, D]
    o = o.transpose(1, 2).reshape(B * S, -1)
    h = gemv(o, weights["self_attn.o_proj.weight"], residual=x2, l2_prefetch=_mlp_prefetch(weights), **_stage("o_"))
    g = gate_up_swiglu(h, weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"],
                       norm_w=weights["post_attention_layernorm.weight"],
                       eps=float(static["post_attention_layernorm.variance_epsilon"]), **_stage("gu_"))
    out = gemv(g, weights["mlp.down_proj.weight"], residual=h, **_stage("dn_"))
    return {"out": out.view(x.shape), **state_out}
