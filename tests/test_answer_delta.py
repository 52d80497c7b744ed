"""A judged call's answer sends an in-place state update as its changed elements (llm4llm.verify.answer's delta
coding): a decode step on the static KV cache writes one position, and the whole caches (twice: the state buffer and
the state_out output) went through a file and back to the device on every judged call, most of a serving task's
verification time on the H100 (86 s of a 135 s trial, docs/results/2026-12-07-h100-serving)."""
from __future__ import annotations

import math

import pytest
import torch

from llm4llm.verify.answer import DELTA_MAX_FRACTION, AnswerError, delta_decode, delta_encode


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool])
def test_the_delta_rebuilds_the_tensor_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(4, 3, 16, generator=g) * 5).to(dtype)
    t = base.clone()
    if dtype.is_floating_point:
        t[0, 1, 3], t[2, 0, 0], t[3, 2, 15] = float("nan"), -0.0, 7.0
        base[1, 1, 1] = -0.0  # +0.0 there in t: a changed bit pattern, equal as numbers
        t[1, 1, 1] = 0.0
    else:
        t[0, 1, 3], t[3, 2, 15] = (True, False) if dtype == torch.bool else (-3, 9)
    coded = delta_encode({"buf.state.x": t}, {"buf.state.x": lambda: base})
    assert set(coded) == {"delta.buf.state.x.idx", "delta.buf.state.x.val"}
    assert coded["delta.buf.state.x.idx"].numel() <= 4
    got = delta_decode(coded, {"buf.state.x": base}, "cpu")["buf.state.x"]
    assert got.shape == t.shape and got.dtype == t.dtype
    assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    assert torch.equal(base, base.clone())  # the base is not written


def test_a_tensor_without_a_base_or_with_many_changes_goes_whole():
    base = torch.zeros(100)
    many = base.clone()
    many[: math.ceil(DELTA_MAX_FRACTION * 100) + 1] = 1.0
    other = torch.ones(3, 3)
    coded = delta_encode({"out.state_out.c": many, "out.out": other, "buf.state.s": torch.zeros(5, dtype=torch.int32)},
                         {"out.state_out.c": base, "buf.state.s": torch.zeros(5)})  # the last: another dtype
    assert set(coded) == {"out.state_out.c", "out.out", "buf.state.s"}
    assert torch.equal(delta_decode(coded, {}, "cpu")["out.state_out.c"], many)


def test_a_malformed_delta_is_a_refused_answer():
    base = torch.zeros(8)
    good = delta_encode({"k": torch.arange(8.0) * (torch.arange(8) == 3)}, {"k": base})
    cases = {
        "outside": {**good, "delta.k.idx": torch.tensor([8])},
        "negative": {**good, "delta.k.idx": torch.tensor([-1])},
        "dtype": {**good, "delta.k.val": torch.tensor([1.0], dtype=torch.float64)},
        "lengths": {**good, "delta.k.idx": torch.tensor([1, 2])},
        "idx dtype": {**good, "delta.k.idx": torch.tensor([3], dtype=torch.int32)},
        "half": {"delta.k.idx": good["delta.k.idx"]},
        "both": {**good, "k": base},
    }
    for why, saved in cases.items():
        with pytest.raises(AnswerError):
            delta_decode(saved, {"k": base}, "cpu")
            pytest.fail(why)
    with pytest.raises(AnswerError, match="no base"):
        delta_decode(good, {}, "cpu")


def test_a_static_cache_layer_is_judged_on_its_changed_elements(tmp_path, monkeypatch):
    """The Gemma-2 decoder layer on the static cache (a left-padded batch of 2), verified in a sandboxed worker: the
    caches come back as deltas (state buffer and state_out output alike), and the verdict passes on them."""
    from llm4llm.search.templates import TEMPLATES
    from llm4llm.verify import gates
    from llm4llm.verify.worker import VerifierPool
    from tests.test_gemma2_decoder_layer import _layer_tasks

    seen: list[tuple[dict, dict]] = []  # (the answer's numel by key, the bases' numel by key), a judged call each
    decode = gates.delta_decode

    def spy(saved, bases, device):
        seen.append(({k: v.numel() for k, v in saved.items()},
                     {k: (b() if callable(b) else b).numel() for k, b in bases.items()}))
        return decode(saved, bases, device)

    monkeypatch.setattr(gates, "delta_decode", spy)
    # the parent's references too: each draw's cache state-out (and its fp32 anchor) kept as a DeltaRef
    from llm4llm.verify.judge import DeltaRef
    compacted, compact = [], gates.compact_refs

    def spy_compact(d):
        compact(d)
        compacted.append(sorted(f"{f}.{n}" for f in ("ref", "ref32") for n, r in (getattr(d, f) or {}).items()
                                if isinstance(r, DeltaRef)))

    monkeypatch.setattr(gates, "compact_refs", spy_compact)
    spec, task_dir = _layer_tasks(tmp_path, 2)[0]
    template = {t.name: t for t in TEMPLATES}["decoder_layer.decode_static_gemma2"]
    source = template.render(spec, template.default(spec))
    with VerifierPool("cpu", timeout_s=300.0, draws=1, timing=False) as pool:
        v = pool.verify(task_dir, source)
    assert v.passed, f"{v.failure_class}: {v.message}"
    assert seen, "no judged call was decoded"
    assert compacted and all(len(c) >= 2 for c in compacted), compacted  # key and value caches, at least
    caches = [n for n in spec.state_names if "cache" in n and "len" not in n]
    assert caches, spec.state_names
    shapes = {tuple(c.state[n].shape) for c in spec.cases for n in caches}
    assert len(shapes) == 1, shapes
    (B, H, S, D), = shapes  # [batch, kv heads, cache length, head dim]
    for keys, _ in seen:
        for n in caches:
            for key in (f"buf.state.{n}", f"out.state_out.{n}"):
                assert key not in keys, f"{key} went whole"
                # one new position per row and kv head (a pad row's write included): not the S positions
                assert B * H * D // 2 <= keys[f"delta.{key}.idx"] <= B * H * D < B * H * S * D, keys
