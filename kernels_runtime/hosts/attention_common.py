"""Host code the attention templates share (attention.prefill_flash, decode_splitkv, decode_static, TileMix's
prefill, and the fused decode layers): the projections, rotary, the past ++ new token, a padded batch's key mask,
and attention_decode_static's call on a static cache. The op keyword arguments come from the config's prefixed
keys (`lin_`, `rope_`, `attn_`); the module's names (a fused q/k/v projection, the output projection's) from the
template."""
from __future__ import annotations

import torch

from kernels_runtime.hosts import prefixed, static_value
from kernels_runtime.ops.attention_decode_static import attention_decode_static
from kernels_runtime.ops.linear import linear
from kernels_runtime.ops.rotary import qk_norm_rotary, rotary


def head_dim(static: dict) -> int:
    return int(static_value(static, "head_dim", "head_size"))


def opt(static: dict, *names: str):
    """The first of `names` the static values hold (and not None), else None."""
    for n in names:
        if static.get(n) is not None:
            return static[n]
    return None


def pad_keys(inputs: dict, B: int, kv_len: int, window=None):
    """A padded batch's key mask [B, kv_len], read by the kernel on the device; None without a mask (causal only).
    HF's [B, 1, S, kv_len] bool mask is causal AND window AND padding-at-the-key, so its last row (a view) is the
    padding where nothing windows it, and a key is real where any row sees it (exact with a window too)."""
    m = inputs.get("attention_mask")
    if m is None:
        return None
    if m.dtype != torch.bool or m.dim() != 4 or tuple(m.shape[:2]) != (B, 1) or m.shape[-1] != kv_len:
        raise ValueError(f"attention mask: expected HF's [{B}, 1, S, {kv_len}] bool mask (SDPA), got "
                         f"{tuple(m.shape)} {m.dtype}")
    return m[:, 0].any(dim=1) if window and m.shape[2] > 1 else m[:, 0, -1]


def with_past(past, new, extra: int = 0):
    """[B, Hkv, S_past, D] ++ [B, Hkv, S, D] by copies into a new buffer (the state-in is never modified);
    `extra` > 0 leaves that many positions unwritten after the past instead of copying `new`."""
    sp = 0 if past is None else past.shape[2]
    B, H, S, D = new.shape
    out = torch.empty((B, H, sp + (extra or S), D), dtype=new.dtype, device=new.device)
    if sp:
        out[:, :, :sp].copy_(past)
    if not extra:
        out[:, :, sp:].copy_(new)
    return out, sp


def softcap(static: dict, p: str = ""):
    """The attention-logit cap the module applies: transformers' SDPA path ignores it. The implementation is read
    under the prefix, else unprefixed (a decoder layer's task records the model's at the top level)."""
    if "sdpa" in str(static.get(p + "attn_implementation") or static.get("attn_implementation") or ""):
        return None
    return opt(static, p + "attn_logit_softcapping", p + "config.attn_logit_softcapping")


class Attention:
    """One rendering's projections and rotary: `config` the template's keys, `qkv` the fused q/k/v projection's
    name (None: split q_proj/k_proj/v_proj), `o_proj` the output projection's, `window` the sliding cache layer's
    window (Mistral keeps it on the config only), `sliding_cache` whether the cache keeps only the window."""

    def __init__(self, config: dict, qkv: str | None = None, o_proj: str | None = "o_proj", window=None,
                 sliding_cache: bool = False):
        self.config, self.qkv_name, self.o_name = config, qkv, o_proj
        self.layout = config.get("qkv_layout", "split")
        self.lin, self.rope_kw, self.attn = prefixed(config, "lin_"), prefixed(config, "rope_"), prefixed(config,
                                                                                                          "attn_")
        self.cache_window, self.sliding_cache = window, sliding_cache

    def proj(self, x, weights, name, B, S, D):
        # [B, S, H*D] -> [B, H, S, D] (a transposed view, as HF lays it out)
        return linear(x, weights[name + ".weight"], weights.get(name + ".bias"), **self.lin).view(B, S, -1, D) \
            .transpose(1, 2)

    def rope(self, q, k, inputs, weights, static):
        cos, sin = inputs["position_embeddings.0"], inputs["position_embeddings.1"]  # [B, S, R], R < D: partial
        if "q_norm.weight" in weights:
            eps = float(static_value(static, "q_norm.variance_epsilon", "q_norm.eps", "rms_norm_eps"))
            return qk_norm_rotary(q, k, cos, sin, weights["q_norm.weight"], weights["k_norm.weight"], eps,
                                  **self.rope_kw)
        return rotary(q, k, cos, sin, **self.rope_kw)

    def qkv(self, x, weights, static, B, S, D):
        # q: [B, Hq, S, D], k/v: [B, Hkv, S, D], transposed views of the projections' outputs (no copies)
        if self.layout == "split":
            return tuple(self.proj(x, weights, n, B, S, D) for n in ("q_proj", "k_proj", "v_proj"))
        y = linear(x, weights[self.qkv_name + ".weight"], weights.get(self.qkv_name + ".bias"),
                   **self.lin)  # [B, S, (Hq + 2 Hkv) * D]
        if self.layout == "heads":  # GPT-NeoX: view(B, S, H, 3D).transpose(1, 2).chunk(3, dim=-1)
            y = y.view(B, S, -1, 3 * D).transpose(1, 2)  # [B, H, S, 3D]
            return y[..., :D], y[..., D:2 * D], y[..., 2 * D:]
        hkv = static.get("num_key_value_heads") or y.shape[-1] // (3 * D)  # Phi-3: [q | k | v] along the features
        nq, nkv = y.shape[-1] - 2 * hkv * D, hkv * D
        q, k, v = y[..., :nq], y[..., nq:nq + nkv], y[..., nq + nkv:]
        return tuple(t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))

    def window(self, static):
        # the module's window (Gemma-2), else its sliding cache layer's
        w = static.get("sliding_window") or self.cache_window
        return int(w) if w else None

    def kept(self, t, window):
        # [B, Hkv, L, D] -> what the cache keeps: DynamicSlidingWindowLayer the last W - 1 positions (all while fewer)
        return t[:, :, -window + 1:] if self.sliding_cache and window else t

    def out(self, o, weights, B, S):
        # o: [B, H, S, D] -> the output projection of [B, S, H * D]
        return linear(o.transpose(1, 2).reshape(B, S, -1), weights[self.o_name + ".weight"],
                      weights.get(self.o_name + ".bias"), **self.lin)


def static_attention(q, k, v, inputs, weights, state, static, config: dict, p: str = ""):
    """attention_decode_static on q: [B, Hq, 1, D], k/v: [B, Hkv, 1, D] (views), the static values and weights read
    under the prefix `p` (a decoder layer's `self_attn.`): writes the rotated k and v at position n of the static
    cache, attends over the keys in [0, n] the call's mask lets the decode row see (a padded row's pad keys
    excluded; windowed by the module's sliding_window), advances n, all in place, so the state-out is the state-in
    tensors. Returns o [B, Hq, 1, D] and the state-out."""
    kc, vc, n = state["key_cache"], state["value_cache"], state["cache_len"]  # [B, Hkv, S_max, D], 0-d int64
    # the decode row of HF's [B, 1, 1, S_max] mask: read by the kernel, so a graph replay sees new values; checked
    # before anything is written
    kv_mask = pad_keys(inputs, q.shape[0], kc.shape[2])
    norm = p + "q_norm.weight" in weights
    eps = float(static_value(static, p + "q_norm.variance_epsilon", p + "q_norm.eps", "rms_norm_eps")) if norm \
        else 1e-6
    window = opt(static, p + "sliding_window")
    cap = softcap(static, p)
    o = attention_decode_static(
        q, k, v, kc, vc, n, inputs["position_embeddings.0"], inputs["position_embeddings.1"],
        float(static_value(static, p + "scaling")), q_norm_weight=weights.get(p + "q_norm.weight"),
        k_norm_weight=weights.get(p + "k_norm.weight"), eps=eps, sliding_window=int(window) if window else None,
        softcap=float(cap) if cap else None, kv_mask=kv_mask, PDL=bool(config.get("pdl", False)),
        # o_proj's weight into L2 while the attention leaves HBM idle (l2pf_o: decoder_layer.decode_static)
        l2_prefetch=weights.get(p + "o_proj.weight") if config.get("l2pf_o") else None, **prefixed(config, "attn_"))
    return o, {"state_out.key_cache": kc, "state_out.value_cache": vc, "state_out.cache_len": n}
