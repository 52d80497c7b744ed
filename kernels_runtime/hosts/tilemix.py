"""Host code of attention.prefill_tilemix (llm4llm/search/templates/tilemix.py): q/k/v/o projections by name,
rotary, and TileMix attention (kernels_runtime.ops.tilemix_attention) over an unpadded prompt, each 128 x 128 tile
group of its causal score matrix on the bf16 or the INT8 path as the config's routing template and coverage say;
a padded batch or a prefill that extends a cache takes the exact kernel."""
from __future__ import annotations

from kernels_runtime.hosts import static_value
from kernels_runtime.hosts.attention_common import Attention, pad_keys, with_past
from kernels_runtime.ops.attention_prefill import attention_prefill
from kernels_runtime.ops.tilemix_attention import tilemix_attention
from kernels_runtime.ops.tilemix_masks import build_tile_mask


def prompt_or_past(state: dict, k, v):
    """(k_all, v_all, S_past): a prompt without a past hands k, v to the kernel through their strides and the cache
    keeps them as they are (no copy into a fresh buffer); else past ++ new by copies."""
    if state.get("key_cache") is None:
        return k, v, 0
    k_all, sp = with_past(state.get("key_cache"), k)  # [B, Hkv, S_past + S, D]
    v_all, _ = with_past(state.get("value_cache"), v)
    return k_all, v_all, sp


def prefill_tilemix(config: dict):
    a = Attention(config)
    masks: dict = {}  # the routing of a prompt length: static, built once
    tma = config.get("tm_tma", False)

    def mask(S, device):
        if (S, str(device)) not in masks:
            masks[(S, str(device))] = build_tile_mask(config["tm_template"], config["tm_coverage"], S, device=device)
        return masks[(S, str(device))]

    def attend(q, k_all, v_all, sp, inputs, scale):
        B, _, S, _ = q.shape
        if sp:  # a prefill that extends a cache: TileMix routes one prompt's own score matrix, so the plain kernel
            return attention_prefill(q, k_all, v_all, scale, kv_mask=pad_keys(inputs, B, k_all.shape[2]), **a.attn)
        # self-attention over the prompt: routed per tile group; TileMix routes an unpadded prompt's tiles, so a
        # padded batch (HF's mask given) takes the exact kernel, each row's pad keys excluded
        kv_mask = pad_keys(inputs, B, S)  # [B, S] or None
        if kv_mask is None:
            return tilemix_attention(q, k_all, v_all, mask(S, q.device), scale, TMA=tma, **a.attn)  # [B, Hq, S, D]
        return attention_prefill(q, k_all, v_all, scale, kv_mask=kv_mask, **a.attn)

    def entry(inputs, weights, state, static):
        x = inputs["hidden_states"]  # [B, S, H]
        B, S, _ = x.shape
        D = int(static_value(static, "head_dim"))
        scale = float(static_value(static, "scaling"))
        q, k, v = (a.proj(x, weights, n, B, S, D) for n in ("q_proj", "k_proj", "v_proj"))
        q, k = a.rope(q, k, inputs, weights, static)
        k_all, v_all, sp = prompt_or_past(state, k, v)
        o = attend(q, k_all, v_all, sp, inputs, scale)
        return {"out": a.out(o, weights, B, S), "state_out.key_cache": k_all, "state_out.value_cache": v_all}
    return entry
