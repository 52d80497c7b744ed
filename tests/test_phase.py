"""The phase predicate and PhaseTracker: one prefill forward, then decode_len - 1 decode forwards."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kernels_runtime.phase import CURRENT_PHASE, PhaseTracker, new_positions, phase_of_call
from llm4llm.workload import load_script, load_workload

WORKLOADS = Path(__file__).resolve().parents[1] / "examples" / "workloads"


def _filled_cache() -> DynamicCache:
    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), layer_idx=0)  # [B, Hkv, S_past, D]
    return cache


def test_new_positions():
    assert new_positions((), {"input_ids": torch.zeros(2, 7, dtype=torch.long)}) == 7
    assert new_positions((torch.zeros(1, 3, dtype=torch.long),), {}) == 3
    assert new_positions((), {"inputs_embeds": torch.zeros(1, 4, 16)}) == 4
    assert new_positions((), {}) is None


@pytest.mark.parametrize(
    ("kwargs", "phase"),
    [
        ({"input_ids": torch.zeros(1, 16, dtype=torch.long)}, "prefill"),
        ({"input_ids": torch.zeros(1, 16, dtype=torch.long), "past_key_values": _filled_cache()}, "prefill"),
        ({"input_ids": torch.zeros(1, 1, dtype=torch.long)}, "prefill"),  # one-token prompt, nothing cached
        ({"input_ids": torch.zeros(1, 1, dtype=torch.long), "past_key_values": DynamicCache()}, "prefill"),
        ({"input_ids": torch.zeros(1, 1, dtype=torch.long), "past_key_values": _filled_cache()}, "decode"),
        ({"input_ids": torch.zeros(1, 1, dtype=torch.long), "cache_position": torch.tensor([16])}, "decode"),
        ({"input_ids": torch.zeros(1, 1, dtype=torch.long), "cache_position": torch.tensor([0])}, "prefill"),
        ({"inputs_embeds": torch.zeros(1, 1, 8), "past_key_values": ((torch.zeros(1, 2, 3, 4),),)}, "decode"),
    ],
    ids=["prompt", "prompt-with-cache", "one-token-prompt", "empty-cache", "kv-cache", "cache-position",
         "cache-position-0", "legacy-tuple"],
)
def test_phase_of_call(kwargs, phase):
    assert phase_of_call((), kwargs) == phase


class _FakeRecurrentLayer:
    has_previous_state = {0: True, 1: True}


class _FakeRecurrentCache:
    layers = [_FakeRecurrentLayer()]


def test_recurrent_state_counts_as_cache():
    ids = torch.zeros(1, 1, dtype=torch.long)
    assert phase_of_call((), {"input_ids": ids, "cache_params": _FakeRecurrentCache()}) == "decode"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mamba", "tiny-mamba2", "tiny-qwen3", "tiny-recurrentgemma"])
def test_tracker_counts_forwards_per_phase(name):
    w = load_workload(WORKLOADS / f"{name}.toml")
    script = load_script(w)
    model = script.build(w)
    batch = script.inputs(w)
    leaf = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    seen: list[str | None] = []
    handle = leaf.register_forward_pre_hook(lambda *_: seen.append(CURRENT_PHASE.get()))
    with PhaseTracker(model) as tracker:
        script.run(model, w, batch)
    handle.remove()
    assert dict(tracker.forwards) == {"prefill": 1, "decode": w.decode_len - 1}
    assert set(seen) == {"prefill", "decode"} and seen[0] == "prefill"
    assert CURRENT_PHASE.get() is None
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_tracker_cleans_up_on_error():
    class Boom(torch.nn.Module):
        def forward(self, input_ids):
            assert CURRENT_PHASE.get() == "prefill"
            raise RuntimeError("boom")

    model = Boom()
    with pytest.raises(RuntimeError, match="boom"):
        with PhaseTracker(model):
            model(torch.zeros(1, 4, dtype=torch.long))
    assert CURRENT_PHASE.get() is None
    assert not model._forward_pre_hooks and not model._forward_hooks


class _SpyTensor(torch.Tensor):
    """Counts every torch operation on it: reading cache_position (a device sync on the GPU) shows up here."""

    ops = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.ops += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_decode_with_a_filled_cache_does_not_read_cache_position():
    """In decode the cache object answers without a device sync; cache_position (a CUDA tensor in generate) is read
    only when no cache object holds content."""
    position = torch.tensor([5]).as_subclass(_SpyTensor)
    _SpyTensor.ops = 0
    ids = torch.zeros(1, 1, dtype=torch.long)
    assert phase_of_call((), {"input_ids": ids, "past_key_values": _filled_cache(), "cache_position": position}) \
        == "decode"
    assert _SpyTensor.ops == 0
    assert phase_of_call((), {"input_ids": ids, "cache_position": position}) == "decode"  # no cache argument
    assert _SpyTensor.ops > 0


def test_static_cache_answers_without_reading_its_device_length():
    """transformers' StaticLayer keeps its length in a device tensor: the predicate decides from `is_initialized`
    and never reads the tensor (on the GPU that read would wait for the device every decode step)."""
    from transformers.cache_utils import StaticLayer

    layer = StaticLayer(max_cache_len=8)
    ids = torch.zeros(1, 1, dtype=torch.long)
    cache = type("C", (), {"layers": [layer]})()
    assert phase_of_call((), {"input_ids": ids, "past_key_values": cache}) == "prefill"  # not yet initialized
    k = torch.zeros(1, 2, 3, 4)
    layer.lazy_initialization(k, k)
    layer.cumulative_length = layer.cumulative_length.as_subclass(_SpyTensor)
    _SpyTensor.ops = 0
    assert phase_of_call((), {"input_ids": ids, "past_key_values": cache}) == "decode"
    assert _SpyTensor.ops == 0
    assert phase_of_call((), {"input_ids": torch.zeros(1, 3, dtype=torch.long), "past_key_values": cache}) == "prefill"
