"""Host code of the attention templates (llm4llm/search/templates/attention.py): attention.prefill_flash (causal
flash attention over past ++ prompt, TMA or pointer kernel), attention.decode_splitkv (split-KV flash decoding, the
new token copied into the cache or written by the kernel) and attention.decode_static (everything in one kernel on
transformers' static cache). Each factory takes the config and the module's names (`Attention`'s keywords: the
fused q/k/v projection, the output projection, the sliding cache layer's window and whether the cache keeps only
the window) and returns the candidate's `entry`."""
from __future__ import annotations

from kernels_runtime.hosts import prefixed, static_value
from kernels_runtime.hosts.attention_common import Attention, head_dim, pad_keys, static_attention, with_past
from kernels_runtime.ops.attention_decode import attention_decode
from kernels_runtime.ops.attention_prefill import attention_prefill


def flash_attend(config: dict):
    """`attend(q, k_all, v_all, scale, window, kv_mask=None)` of the config's flash_kernel: with "tma", a 16-bit
    prompt without a past, a window or padding (head_dim <= 128) takes the bf16 flash kernel whose fully visible K/V
    tiles come by TMA (sm_90+; pointers elsewhere); else, and with "pointer", attention_prefill (the padded rows' pad
    keys excluded)."""
    attn = prefixed(config, "attn_")

    def pointer(q, k_all, v_all, scale, window, kv_mask=None):
        return attention_prefill(q, k_all, v_all, scale, sliding_window=window, kv_mask=kv_mask, **attn)
    if config.get("flash_kernel") != "tma":
        return pointer
    from kernels_runtime.ops.attention_prefill import attention_prefill_tma, tma_applies  # the choice's own op

    def attend(q, k_all, v_all, scale, window, kv_mask=None):
        if kv_mask is None and tma_applies(q, k_all, window):
            return attention_prefill_tma(q, k_all, v_all, scale, **attn)
        return pointer(q, k_all, v_all, scale, window, kv_mask)
    return attend


def prefill_flash(config: dict, **names):
    """attention.prefill_flash: projections, rotary, past ++ prompt (copies), causal flash attention (windowed where
    the module is), the output projection; the cache keeps what the module's cache layer keeps."""
    a, attend = Attention(config, **names), flash_attend(config)

    def entry(inputs, weights, state, static):
        x = inputs["hidden_states"]  # [B, S, H]
        B, S, _ = x.shape
        D = head_dim(static)
        q, k, v = a.qkv(x, weights, static, B, S, D)
        q, k = a.rope(q, k, inputs, weights, static)
        k_all, _ = with_past(state.get("key_cache"), k)  # [B, Hkv, S_past + S, D]
        v_all, _ = with_past(state.get("value_cache"), v)
        window = a.window(static)
        kv_mask = pad_keys(inputs, B, k_all.shape[2], window)  # [B, S_past + S] or None
        o = attend(q, k_all, v_all, float(static_value(static, "scaling")), window, kv_mask)  # [B, Hq, S, D]
        out = a.out(o, weights, B, S)
        return {"out": out, "state_out.key_cache": a.kept(k_all, window),
                "state_out.value_cache": a.kept(v_all, window)}
    return entry


def _masked(kv_mask, lo):
    return None if kv_mask is None else kv_mask[:, lo:]


def _copy_step(attn: dict):
    """cache_update = "copy": past ++ the new token by copies, then attention_decode over the window."""
    def step(q, k, v, inputs, state, window, scale):
        k_all, _ = with_past(state.get("key_cache"), k)  # [B, Hkv, S_past + 1, D]
        v_all, _ = with_past(state.get("value_cache"), v)
        lo = max(0, k_all.shape[2] - window) if window else 0  # the window's first position
        kv_mask = pad_keys(inputs, q.shape[0], k_all.shape[2])  # [B, S_past + 1] or None
        o = attention_decode(q, k_all[:, :, lo:], v_all[:, :, lo:], scale, kv_mask=_masked(kv_mask, lo), **attn)
        return o, k_all, v_all
    return step


def _fused_step(attn: dict):
    """cache_update = "fused": the past copied with one position left unwritten, which attention_decode_update
    writes (through the views) while it attends over [lo, S_past]."""
    from kernels_runtime.ops.attention_decode import attention_decode_update  # the choice's own op

    def step(q, k, v, inputs, state, window, scale):
        k_all, sp = with_past(state.get("key_cache"), k, extra=1)  # [B, Hkv, S_past + 1, D]
        v_all, _ = with_past(state.get("value_cache"), v, extra=1)
        lo = max(0, sp + 1 - window) if window else 0  # the window's first position
        kv_mask = pad_keys(inputs, q.shape[0], k_all.shape[2])  # [B, S_past + 1] or None
        o = attention_decode_update(q, k, v, k_all[:, :, lo:], v_all[:, :, lo:], sp - lo, scale,
                                    kv_mask=_masked(kv_mask, lo), **attn)
        return o, k_all, v_all
    return step


def decode_splitkv(config: dict, **names):
    """attention.decode_splitkv: projections, rotary, the cache step of the config's cache_update (chosen here,
    once), the output projection."""
    a = Attention(config, **names)
    step = (_fused_step if config["cache_update"] == "fused" else _copy_step)(prefixed(config, "attn_"))

    def entry(inputs, weights, state, static):
        x = inputs["hidden_states"]  # [B, 1, H]
        B, S, _ = x.shape
        D = head_dim(static)
        scale = float(static_value(static, "scaling"))
        q, k, v = a.qkv(x, weights, static, B, S, D)
        q, k = a.rope(q, k, inputs, weights, static)  # q: [B, Hq, 1, D], k: [B, Hkv, 1, D]
        window = a.window(static)
        o, k_all, v_all = step(q, k, v, inputs, state, window, scale)
        out = a.out(o, weights, B, S)
        return {"out": out, "state_out.key_cache": a.kept(k_all, window),
                "state_out.value_cache": a.kept(v_all, window)}
    return entry


def decode_static(config: dict, **names):
    """attention.decode_static: projections, then norms, rotary, the cache write at the device-side length and
    split-KV attention in one kernel (static_attention), the output projection; nothing a graph would freeze."""
    a = Attention(config, **names)

    def entry(inputs, weights, state, static):
        x = inputs["hidden_states"]  # [B, 1, H]
        B, S, _ = x.shape
        D = head_dim(static)
        q, k, v = a.qkv(x, weights, static, B, S, D)  # [B, H, 1, D] views
        o, state_out = static_attention(q, k, v, inputs, weights, state, static, config)  # [B, Hq, 1, D]
        return {"out": a.out(o, weights, B, S), **state_out}
    return entry
