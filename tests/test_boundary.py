"""Call boundaries on tiny HF models: capture during generate, then call_reference reproduces outputs and state."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import Cache, StaticIndexedLayer

from kernels_runtime.boundary import (BoundaryCall, UnsupportedBoundary, boundary_names, call_reference,
                                      capture_boundary, capture_call, find_cache, flatten_outputs, rebuild_outputs,
                                      record_outputs, weights_of)
from kernels_runtime.phase import CURRENT_PHASE, PhaseTracker

TINY = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256),
    "mamba": dict(hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4, vocab_size=256),
    "mamba2": dict(hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4, num_heads=8,
                   head_dim=16, n_groups=1, chunk_size=8, vocab_size=256),
    # layers: recurrent, recurrent, attention (window 8 < prompt 16: the sliding KV layer drops entries)
    "recurrent_gemma": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=1, head_dim=16, lru_width=64, attention_window_size=8,
                            vocab_size=256),
}
NO_SPECIAL = {"eos_token_id": None, "bos_token_id": None, "pad_token_id": 0}


def tiny_model(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **TINY[model_type], **NO_SPECIAL)
    return AutoModelForCausalLM.from_config(config).eval()


def generate(model: torch.nn.Module, prompt_len: int = 16) -> torch.Tensor:
    ids = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                              do_sample=False, pad_token_id=0)


def capture_generate(model: torch.nn.Module, class_names: set[str]) -> list[tuple[str, str, torch.nn.Module,
                                                                                  BoundaryCall]]:
    """(path, phase, module, call) for every call of a module whose class is in `class_names` during generate."""
    calls, pending, handles = [], {}, []

    def pre(path, module, args, kwargs):
        pending[path] = capture_boundary(module, args, kwargs)

    def post(path, module, args, kwargs, output):
        call = record_outputs(pending.pop(path), module, output, find_cache(args, kwargs))
        calls.append((path, CURRENT_PHASE.get(), module, call))

    for path, module in model.named_modules():
        if type(module).__name__ in class_names:
            handles.append(module.register_forward_pre_hook(
                lambda m, a, k, p=path: pre(p, m, a, k), with_kwargs=True))
            handles.append(module.register_forward_hook(
                lambda m, a, k, o, p=path: post(p, m, a, k, o), with_kwargs=True))
    try:
        with PhaseTracker(model):
            generate(model)
    finally:
        for h in handles:
            h.remove()
    return calls


def assert_reproduces(module: torch.nn.Module, call: BoundaryCall) -> dict[str, torch.Tensor]:
    got = call_reference(module, weights_of(module), call.inputs, call.state, call.static, call.recipe)
    ref = call.reference()
    assert set(got) == set(ref)
    for name, expected in ref.items():
        assert torch.equal(got[name], expected), name
    return got


def by_phase(calls, cls: str, phase: str):
    return [(p, m, c) for p, ph, m, c in calls if type(m).__name__ == cls and ph == phase]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_attention_mlp_norm_reproduce_with_kv_cache(model_type):
    prefix = "Llama" if model_type == "llama" else "Qwen3"
    attn, mlp, norm = f"{prefix}Attention", f"{prefix}MLP", f"{prefix}RMSNorm"
    calls = capture_generate(tiny_model(model_type), {attn, mlp, norm})
    prefill, decode = by_phase(calls, attn, "prefill"), by_phase(calls, attn, "decode")
    assert len(prefill) == 2 and len(decode) == 2 * 3  # 2 layers; 4 new tokens = prefill + 3 decode steps

    _, module, call = prefill[0]
    assert list(call.inputs) == ["hidden_states", "position_ids", "position_embeddings.0", "position_embeddings.1"]
    assert call.state == {}  # a fresh layer: nothing cached before the prefill
    assert sorted(call.reference()) == ["out", "state_out.key_cache", "state_out.value_cache"]
    assert call.static["use_cache"] is True and call.static["head_dim"] == 16
    assert call.static["attn_implementation"] == "sdpa"
    assert_reproduces(module, call)

    for _, module, call in decode:
        assert call.inputs["hidden_states"].shape == (1, 1, 64)
        past = call.state["key_cache"].shape[-2]
        assert call.state["key_cache"].shape == (1, 2, past, 16)  # [B, Hkv, S_past, D]
        assert call.state_out["key_cache"].shape == (1, 2, past + 1, 16)
        state_before = {k: v.clone() for k, v in call.state.items()}
        assert_reproduces(module, call)
        assert all(torch.equal(call.state[k], v) for k, v in state_before.items())  # state-in untouched

    for cls, names in ((mlp, ["x"]), (norm, ["hidden_states"])):
        for phase in ("prefill", "decode"):
            for _, module, call in by_phase(calls, cls, phase):
                assert list(call.inputs) == names and list(call.reference()) == ["out"]
                assert_reproduces(module, call)
    _, module, call = by_phase(calls, norm, "prefill")[0]
    assert call.static["variance_epsilon"] == module.variance_epsilon
    assert boundary_names(module) == {"weights": ["weight"]}
    assert boundary_names(by_phase(calls, mlp, "prefill")[0][1])["weights"] == [
        "gate_proj.weight", "up_proj.weight", "down_proj.weight"]


@pytest.mark.parametrize("model_type,cls,ssm_shape", [("mamba", "MambaMixer", (1, 128, 8)),
                                                      ("mamba2", "Mamba2Mixer", (1, 8, 16, 8))])
def test_ssm_mixer_reproduces_conv_and_ssm_state(model_type, cls, ssm_shape):
    calls = capture_generate(tiny_model(model_type), {cls})
    prefill, decode = by_phase(calls, cls, "prefill"), by_phase(calls, cls, "decode")
    assert len(prefill) == 2 and len(decode) == 6
    for _, module, call in prefill:
        assert call.state == {}
        assert sorted(call.state_out) == ["conv_state", "ssm_state"]
        assert_reproduces(module, call)
    for _, module, call in decode:
        assert sorted(call.state) == ["conv_state", "ssm_state"]
        assert call.state["ssm_state"].shape == ssm_shape
        state_before = {k: v.clone() for k, v in call.state.items()}
        got = assert_reproduces(module, call)
        assert not torch.equal(got["state_out.ssm_state"], call.state["ssm_state"])  # the step did update it
        # the decode kernels update the cache in place: call_reference must work on copies
        assert all(torch.equal(call.state[k], v) for k, v in state_before.items())


def test_recurrent_gemma_block_and_sliding_attention():
    model = tiny_model("recurrent_gemma")
    calls = capture_generate(model, {"RecurrentGemmaRecurrentBlock", "RecurrentGemmaAttention"})
    block = "RecurrentGemmaRecurrentBlock"
    decode = by_phase(calls, block, "decode")
    assert len(by_phase(calls, block, "prefill")) == 2 and len(decode) == 6
    for _, module, call in by_phase(calls, block, "prefill") + decode:
        assert_reproduces(module, call)
    _, module, call = decode[0]
    assert list(call.inputs) == ["input_states", "position_ids", "attention_mask"]
    assert sorted(call.state) == ["conv_state", "rg_lru_state"]
    assert call.state["rg_lru_state"].dtype == torch.float32
    live = (module.conv1d_state, module.rg_lru.recurrent_states)
    assert_reproduces(module, call)
    assert module.conv1d_state is live[0] and module.rg_lru.recurrent_states is live[1]  # module state restored

    for _, module, call in by_phase(calls, "RecurrentGemmaAttention", "decode"):
        assert call.recipe["state"] == {"adapter": "DynamicSlidingWindowLayer", "sliding_window": 8}
        assert call.state["key_cache"].shape[-2] == 7  # window - 1 entries kept
        assert_reproduces(module, call)


class _Toy(torch.nn.Module):
    layer_idx = 0

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, cache=None, scale=1.0):
        return self.proj(x) * scale, None


def test_stateless_capture_outputs_and_rebuild():
    toy, x = _Toy(), torch.randn(2, 4)
    with torch.inference_mode():
        out = toy(x, scale=2.0)
    call = capture_boundary(toy, (x,), {"scale": 2.0}, outputs=out)
    assert call.static["scale"] == 2.0 and list(call.outputs) == ["out"]
    named, node = flatten_outputs(out)
    rebuilt = rebuild_outputs(node, named)
    assert isinstance(rebuilt, tuple) and rebuilt[1] is None and torch.equal(rebuilt[0], out[0])
    assert_reproduces(toy, call)
    assert torch.equal(capture_call(toy, x, scale=2.0).outputs["out"], out[0])


def test_unadaptable_state_and_arguments_are_unsupported():
    toy, x = _Toy(), torch.randn(2, 4)
    with pytest.raises(UnsupportedBoundary, match="no state adapter for cache layer StaticIndexedLayer"):
        capture_boundary(toy, (x, Cache(layers=[StaticIndexedLayer(max_cache_len=8)])), {})
    with pytest.raises(UnsupportedBoundary, match="argument scale: expected a tensor"):
        capture_boundary(toy, (x,), {"scale": object()})


def test_merge_recipes_makes_a_none_or_tensor_argument_optional_and_nothing_else():
    """Two calls that differ only by an argument passed as None or as a tensor share one recipe, which rebuilds a
    call without that input as None and one with it as the tensor; any other difference does not merge."""
    from kernels_runtime.boundary import merge_recipes, rebuild_call, recipe_inputs

    t = lambda n: {"kind": "tensor", "name": n}  # noqa: E731
    masked = {"args": [t("x")], "kwargs": {"attention_mask": t("attention_mask"), "past_key_values": {"kind": "cache"},
                                          "pe": {"kind": "tuple", "items": [t("pe.0"), t("pe.1")]}},
              "state": {"adapter": "DynamicLayer"}}
    plain = {**masked, "kwargs": {**masked["kwargs"], "attention_mask": {"kind": "none"}}}
    merged = merge_recipes(plain, masked)
    assert merged == merge_recipes(masked, plain) and merge_recipes(merged, plain) == merged
    assert merged["kwargs"]["attention_mask"] == {**t("attention_mask"), "optional": True}
    assert recipe_inputs(merged) == ["x", "attention_mask", "pe.0", "pe.1"]
    x, m = torch.zeros(2), torch.ones(2, dtype=torch.bool)
    inputs = {"x": x, "pe.0": x, "pe.1": x}
    assert rebuild_call(merged, inputs, {}, "cache")[1]["attention_mask"] is None
    assert rebuild_call(merged, {**inputs, "attention_mask": m}, {}, "cache")[1]["attention_mask"] is m
    with pytest.raises(KeyError):  # a required tensor is still required
        rebuild_call(merged, {"attention_mask": m}, {}, "cache")
    other_state = {**plain, "state": {"adapter": "StaticLayer", "max_cache_len": 19}}
    renamed = {**masked, "kwargs": {**masked["kwargs"], "attention_mask": t("mask")}}
    nested = {**masked, "kwargs": {**masked["kwargs"], "pe": {"kind": "none"}}}  # a tuple is not one tensor
    fewer = {**masked, "args": []}
    for b in (other_state, renamed, nested, fewer):
        assert merge_recipes(masked, b) is None
