"""Host code of the RecurrentGemma RG-LRU block templates (`RecurrentGemmaRecurrentBlock`): y = act(linear_y(x))
(the GELU in the linear's epilogue), x = linear_x(x) -> temporal conv (bias, no activation) -> RG-LRU (the `* y`
multiply fused) -> linear_out.

Config keys: `lin_*`, `conv_*`, `rg_*` (the RG-LRU op's), and in decode `state_inplace`: the conv and RG-LRU states
are updated where they are held (kernels_runtime then copies nothing and never falls back once the entry started);
a state that is not contiguous (HF's first one after prefill may be a slice) or not fp32 is copied first, as
without it. The template passes `epilogue` (the block's GELU form: "gelu_tanh" or "gelu").
"""
from __future__ import annotations

import torch

from kernels_runtime.hosts import prefixed
from kernels_runtime.hosts.ssm import copy
from kernels_runtime.ops.causal_conv1d import causal_conv1d, causal_conv1d_update
from kernels_runtime.ops.linear import linear
from kernels_runtime.ops.rglru import rglru


def _lru(config: dict):
    rg = prefixed(config, "rg_")

    def lru(xc, pos, weights, h0, y, inplace=False):
        return rglru(xc, pos, weights["rg_lru.recurrent_param"], weights["rg_lru.input_gate_weight"],
                     weights["rg_lru.input_gate_bias"], weights["rg_lru.recurrent_gate_weight"],
                     weights["rg_lru.recurrent_gate_bias"], state=h0, y_branch=y, inplace=inplace,
                     **rg)  # y [B, L, W], h [B, W] fp32
    return lru


def rglru_prefill(config: dict, epilogue: str = "gelu_tanh"):
    lin, lru = prefixed(config, "lin_"), _lru(config)
    conv = {"BLOCK_C": config["conv_BLOCK_C"], "BLOCK_L": config["conv_BLOCK_L"]}

    def entry(inputs, weights, state, static):
        x, pos = inputs["input_states"], inputs["position_ids"]  # [B, L, Hd], [B, L]
        y = linear(x, weights["linear_y.weight"], weights.get("linear_y.bias"), epilogue=epilogue,
                   **lin)  # [B, L, W]
        xb = linear(x, weights["linear_x.weight"], weights.get("linear_x.bias"), **lin)  # [B, L, W]
        conv_w = weights["conv_1d.weight"]  # [W, 1, K]
        W, K = conv_w.shape[0], conv_w.shape[-1]
        xc, conv_state = causal_conv1d(xb.transpose(1, 2), conv_w.view(W, K), weights.get("conv_1d.bias"),
                                       silu=False, state_len=K - 1, **conv)  # [B, W, L], [B, W, K - 1]
        h, lru_state = lru(xc.transpose(1, 2), pos, weights, None, y)
        out = linear(h, weights["linear_out.weight"], weights.get("linear_out.bias"), **lin)  # [B, L, Hd]
        return {"out": out, "state_out.conv_state": conv_state, "state_out.rg_lru_state": lru_state}
    return entry


def rglru_decode(config: dict, epilogue: str = "gelu_tanh"):
    lin, lru, conv_c, inplace = prefixed(config, "lin_"), _lru(config), config["conv_BLOCK_C"], config["state_inplace"]

    def entry(inputs, weights, state, static):
        x, pos = inputs["input_states"], inputs["position_ids"]  # [B, 1, Hd], [B, 1]
        Bsz = x.shape[0]
        cs, hs = state["conv_state"], state["rg_lru_state"]
        conv_state = cs if inplace and cs.is_contiguous() else copy(cs)  # [B, W, K - 1], advanced in place below
        in_place_lru = inplace and hs.is_contiguous() and hs.dtype == torch.float32
        y = linear(x, weights["linear_y.weight"], weights.get("linear_y.bias"), epilogue=epilogue,
                   **lin)  # [B, 1, W]
        xb = linear(x[:, 0], weights["linear_x.weight"], weights.get("linear_x.bias"), **lin)  # [B, W]
        conv_w = weights["conv_1d.weight"]  # [W, 1, K]
        W, K = conv_w.shape[0], conv_w.shape[-1]
        xc = causal_conv1d_update(xb, conv_state, conv_w.view(W, K), weights.get("conv_1d.bias"), silu=False,
                                  BLOCK_C=conv_c)  # [B, W]
        h, lru_state = lru(xc.view(Bsz, 1, W), pos, weights, hs, y, inplace=in_place_lru)
        out = linear(h, weights["linear_out.weight"], weights.get("linear_out.bias"), **lin)  # [B, 1, Hd]
        return {"out": out, "state_out.conv_state": conv_state, "state_out.rg_lru_state": lru_state}
    return entry
