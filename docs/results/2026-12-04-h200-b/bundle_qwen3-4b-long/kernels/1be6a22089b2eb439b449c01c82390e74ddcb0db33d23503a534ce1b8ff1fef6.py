"""Candidate from template attention.prefill_tilemix for a attention/prefill task (bfloat16)."""
import torch
import triton
import triton.language as tl
from kernels_runtime.ops.linear import linear
from kernels_runtime.ops.rotary import rotary, qk_norm_rotary
from kernels_runtime.ops.attention_prefill import attention_prefill
from kernels_runtime.ops.tilemix_attention import tilemix_attention
from kernels_runtime.ops.tilemix_masks import build_tile_mask

CONFIG = {'attn_BLOCK_M': 128, 'attn_BLOCK_N': 128, 'attn_num_stages': 3, 'attn_num_warps': 8, 'lin_BLOCK_K': 32, 'lin_BLOCK_M': 64, 'lin_BLOCK_N': 64, 'lin_impl': 'cublas', 'lin_num_stages': 3, 'lin_num_warps': 4, 'rope_BLOCK_H': 4, 'rope_num_warps': 2, 'tm_coverage': 0.25, 'tm_template': 'sink_local', 'tm_tma': True}

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

LOSSY = {"kind": "tilemix", "template": CONFIG["tm_template"], "coverage": CONFIG["tm_coverage"]}
_MASKS = {}  # the routing of a prompt length: static, built once


def _mask(S, device):
    if (S, str(device)) not in _MASKS:
        _MASKS[(S, str(device))] = build_tile_mask(CONFIG["tm_template"], CONFIG["tm_coverage"], S, device=device)
    return _MASKS[(S, str(device))]


def entry(inputs, weights, state, static):
    x = inputs["hidden_states"]  # [B, S, H]
    B, S, _ = x.shape
    D = int(_static(static, "head_dim"))
    scale = float(_static(static, "scaling"))
    q, k, v = (_proj(x, weights, n, B, S, D) for n in ("q_proj", "k_proj", "v_proj"))
    q, k = _rope(q, k, inputs, weights, static)
    if state.get("key_cache") is None:  # a prompt without a past: the kernel takes k, v through their strides
        k_all, v_all, sp = k, v, 0  # and the cache keeps them as they are (no copy into a fresh buffer)
    else:
        k_all, sp = _with_past(state.get("key_cache"), k)  # [B, Hkv, S_past + S, D]
        v_all, _ = _with_past(state.get("value_cache"), v)
    if sp == 0:  # self-attention over the prompt: routed per tile group
        o = tilemix_attention(q, k_all, v_all, _mask(S, q.device), scale, TMA=CONFIG.get("tm_tma", False),
                              **ATTN)  # [B, Hq, S, D]
    else:  # a prefill that extends a cache: TileMix routes one prompt's own score matrix, so the plain kernel
        o = attention_prefill(q, k_all, v_all, scale, **ATTN)
    out = linear(o.transpose(1, 2).reshape(B, S, -1), weights["o_proj.weight"], weights.get("o_proj.bias"), **LIN)
    return {"out": out, "state_out.key_cache": k_all, "state_out.value_cache": v_all}
