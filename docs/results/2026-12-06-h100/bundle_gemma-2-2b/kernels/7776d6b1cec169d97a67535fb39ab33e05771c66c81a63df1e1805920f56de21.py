"""Candidate from template attention.decode_static for a attention/decode task (bfloat16)."""
import torch
import triton
import triton.language as tl
from kernels_runtime.ops.linear import linear
from kernels_runtime.ops.rotary import rotary, qk_norm_rotary
from kernels_runtime.ops.attention_decode_static import attention_decode_static

CONFIG = {'attn_BLOCK_N': 32, 'attn_num_splits': 64, 'attn_num_stages': 2, 'attn_num_warps': 4, 'lin_GEMV_BLOCK_K': 128, 'lin_GEMV_BLOCK_N': 32, 'lin_GEMV_SPLIT_K': 2, 'lin_num_warps': 8, 'qkv_layout': 'split'}

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

QKV, O_PROJ = None, 'o_proj'
WINDOW, SLIDING_CACHE = None, False


def _qkv(x, weights, static, B, S, D):
    # q: [B, Hq, S, D], k/v: [B, Hkv, S, D], transposed views of the projections' outputs (no copies)
    layout = CONFIG["qkv_layout"]
    if layout == "split":
        return tuple(_proj(x, weights, n, B, S, D) for n in ("q_proj", "k_proj", "v_proj"))
    y = linear(x, weights[QKV + ".weight"], weights.get(QKV + ".bias"), **LIN)  # [B, S, (Hq + 2 Hkv) * D]
    if layout == "heads":  # GPT-NeoX: view(B, S, H, 3D).transpose(1, 2).chunk(3, dim=-1)
        y = y.view(B, S, -1, 3 * D).transpose(1, 2)  # [B, H, S, 3D]
        return y[..., :D], y[..., D:2 * D], y[..., 2 * D:]
    hkv = static.get("num_key_value_heads") or y.shape[-1] // (3 * D)  # Phi-3: [q | k | v] along the features
    nq, nkv = y.shape[-1] - 2 * hkv * D, hkv * D
    q, k, v = y[..., :nq], y[..., nq:nq + nkv], y[..., nq + nkv:]
    return tuple(t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))


def _window(static):
    # the module's window (Gemma-2), else its sliding cache layer's (Mistral keeps it on the config only)
    w = static.get("sliding_window") or WINDOW
    return int(w) if w else None


def _kept(t, window):
    # [B, Hkv, L, D] -> what the cache keeps: DynamicSlidingWindowLayer the last W - 1 positions (all while fewer)
    return t[:, :, -window + 1:] if SLIDING_CACHE and window else t


def _out(o, weights, B, S):
    # o: [B, H, S, D] -> the output projection of [B, S, H * D]
    return linear(o.transpose(1, 2).reshape(B, S, -1), weights[O_PROJ + ".weight"], weights.get(O_PROJ + ".bias"),
                  **LIN)


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
    x = inputs["hidden_states"]  # [B, 1, H]
    B, S, _ = x.shape
    D = _head_dim(static)
    q, k, v = _qkv(x, weights, static, B, S, D)  # [B, H, 1, D] views
    o, state_out = _static_attention(q, k, v, inputs, weights, state, static)  # [B, Hq, 1, D]
    return {"out": _out(o, weights, B, S), **state_out}
