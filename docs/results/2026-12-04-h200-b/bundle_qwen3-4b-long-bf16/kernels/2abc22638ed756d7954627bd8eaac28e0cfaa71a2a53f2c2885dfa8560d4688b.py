"""Candidate from template attention.prefill_flash for a attention/prefill task (bfloat16)."""
import torch
import triton
import triton.language as tl
from kernels_runtime.ops.linear import linear
from kernels_runtime.ops.rotary import rotary, qk_norm_rotary
from kernels_runtime.ops.attention_prefill import attention_prefill, attention_prefill_tma, tma_applies

CONFIG = {'attn_BLOCK_M': 128, 'attn_BLOCK_N': 128, 'attn_num_stages': 3, 'attn_num_warps': 8, 'flash_kernel': 'tma', 'lin_BLOCK_K': 32, 'lin_BLOCK_M': 64, 'lin_BLOCK_N': 64, 'lin_impl': 'cublas', 'lin_num_stages': 3, 'lin_num_warps': 4, 'qkv_layout': 'split', 'rope_BLOCK_H': 4, 'rope_num_warps': 2}

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


def _attend(q, k_all, v_all, scale, window):
    # a 16-bit prompt without a past or a window (head_dim <= 128): the bf16 flash kernel whose fully visible K/V
    # tiles come by TMA (sm_90+; pointers elsewhere); else, and with flash_kernel = "pointer", attention_prefill
    if CONFIG.get("flash_kernel") == "tma" and tma_applies(q, k_all, window):
        return attention_prefill_tma(q, k_all, v_all, scale, **ATTN)
    return attention_prefill(q, k_all, v_all, scale, sliding_window=window, **ATTN)


def entry(inputs, weights, state, static):
    x = inputs["hidden_states"]  # [B, S, H]
    B, S, _ = x.shape
    D = _head_dim(static)
    q, k, v = _qkv(x, weights, static, B, S, D)
    q, k = _rope(q, k, inputs, weights, static)
    k_all, _ = _with_past(state.get("key_cache"), k)  # [B, Hkv, S_past + S, D]
    v_all, _ = _with_past(state.get("value_cache"), v)
    window = _window(static)
    o = _attend(q, k_all, v_all, float(_static(static, "scaling")), window)  # [B, Hq, S, D]
    out = _out(o, weights, B, S)
    return {"out": out, "state_out.key_cache": _kept(k_all, window), "state_out.value_cache": _kept(v_all, window)}
