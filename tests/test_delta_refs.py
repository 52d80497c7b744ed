"""A static KV cache's reference state-out kept as its changes from the draw's state (llm4llm.verify.judge.DeltaRef):
bit for bit the same tensor where a check reads it (judge.resident), a fraction of the memory beside the draw."""
from __future__ import annotations

import torch

from llm4llm.verify import gates
from llm4llm.verify.judge import DeltaRef, Draw, resident


def _cache_ref(inputs, weights, state, static):
    """A layer's reference on a static cache: writes position 3 of the cache (k and -0.0 at one element), returns
    the row and the cache."""
    k = state["k"].clone()
    k[:, :, 3] = inputs["x"][:, None, :] * 2
    k[0, 0, 5, 0] = -0.0
    return {"out": inputs["x"] + 1, "state_out.k": k}


def _draw(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    state = {"k": torch.randn(2, 3, 16, 8, generator=g).to(dtype)}
    return Draw((0, 1), {"x": torch.randn(2, 8, generator=g).to(dtype)}, {}, state)


def test_a_delta_rebuilds_its_tensor_bit_for_bit_and_an_fp32_anchor_too():
    d = _draw()
    full = _cache_ref(d.inputs, {}, d.state, {})["state_out.k"]
    delta = DeltaRef.of(full, d.state["k"], "k")
    assert delta is not None and delta.numel() == full.numel() and delta.element_size() == 2
    assert 2 * 3 * 8 <= delta.idx.numel() <= 2 * 3 * 8 + 1  # the written position (and the -0.0)
    assert torch.equal(delta.full(d.state).view(torch.int16), full.view(torch.int16))
    wide = full.float()
    delta32 = DeltaRef.of(wide, d.state["k"], "k")  # against the state upcast: exact
    assert torch.equal(delta32.full(d.state).view(torch.int32), wide.view(torch.int32))
    other = torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert DeltaRef.of(other, d.state["k"], "k") is None  # most of it changed
    assert DeltaRef.of(full[:1], d.state["k"], "k") is None  # another shape


def test_fill_reference_keeps_the_state_out_compact_and_a_judged_block_sees_it_whole():
    whole, compact = _draw(), _draw()
    up = lambda i, w, s, st: {n: t.float() for n, t in _cache_ref(i, w, s, st).items()}  # noqa: E731
    gates.fill_reference(_spec_task(), [whole], _cache_ref, up)
    gates.fill_reference(_spec_task(), [compact], _cache_ref, up, device=torch.device("cpu"), compact=True)
    assert isinstance(compact.ref["state_out.k"], DeltaRef) and isinstance(compact.ref32["state_out.k"], DeltaRef)
    assert isinstance(compact.ref["out"], torch.Tensor)  # not a state-out: whole
    with resident(compact, torch.device("cpu")) as d:
        for f in ("ref", "ref32"):
            for n, t in getattr(whole, f).items():
                assert torch.equal(getattr(d, f)[n], t), (f, n)
    assert isinstance(compact.ref["state_out.k"], DeltaRef)  # compact again after the block
    host = _draw()  # a host-kept draw judged on another device: its delta goes over and comes back
    gates.fill_reference(_spec_task(), [host], _cache_ref, up, device=torch.device("cpu"), compact=True)
    with resident(host, torch.device("meta")) as d:
        assert d.ref["state_out.k"].device.type == "meta" and d.ref["state_out.k"].shape == (2, 3, 16, 8)
    assert isinstance(host.ref["state_out.k"], DeltaRef) and host.ref["state_out.k"].device.type == "cpu"


def _spec_task():
    """The few fields of a task fill_reference reads."""
    from types import SimpleNamespace

    return SimpleNamespace(spec=SimpleNamespace(output_names=["out"], state_names=["k"], static={}))
