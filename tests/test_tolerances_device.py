"""The tolerance checks compare where the tensors live, a chunk at a time (kernels_runtime.tolerances): a decode
graph's capture check once copied the whole KV cache to the host as float64, 20-50 s and 8 GB of GPU memory per
capture at a serving batch on the H100 (docs/results/2026-12-07-h100-serving-b). On the CPU the same code runs, so
the tests pin what matters there: no host copy (`.cpu()` is never called) and results equal to the whole-tensor
float64 arithmetic, chunk boundaries included."""
from __future__ import annotations

import pytest
import torch

from kernels_runtime import tolerances as T


def _whole(out, ref):
    o, r = out.double(), ref.double()
    diff = (o - r).abs()
    tol = T.tolerance_for(ref.dtype)
    return bool((diff <= tol.atol + tol.rtol * r.abs()).all()), float(diff.max()), \
        float((diff / r.abs().clamp_min(1e-12)).max())


@pytest.fixture
def no_host_copies(monkeypatch):
    def refuse(self, *a, **k):
        raise AssertionError("a tolerance check copied a tensor to the host")

    monkeypatch.setattr(torch.Tensor, "cpu", refuse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_checks_equal_the_whole_tensor_arithmetic(dtype, monkeypatch, no_host_copies):
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 33, generator=g).to(dtype)
    base = torch.randn(64, 33, generator=g).to(dtype)
    near = (ref.double() + 3e-3 * torch.randn(64, 33, generator=g, dtype=torch.float64)).to(dtype)
    far = ref.clone()
    far[40, 7] += 1.0  # one element out of tolerance, in a late chunk
    want = {name: _whole(t, ref) for name, t in (("near", near), ("far", far))}
    l2 = float((near.double() - ref.double()).norm() / ref.double().norm())
    l2_change = float((near.double() - ref.double()).norm() / (ref.double() - base.double()).norm())
    monkeypatch.setattr(T, "_CHUNK", 100)  # 2112 elements: 22 chunks, the last one short
    for name, t in (("near", near), ("far", far)):
        rep = T.compare(t, ref)
        assert (rep.ok, rep.max_abs, rep.max_rel) == want[name], name
    assert T.rel_l2(near, ref) == pytest.approx(l2, rel=1e-12)
    assert T.rel_l2(near, ref, base=base) == pytest.approx(l2_change, rel=1e-12)
    # a transposed (non-contiguous) view compares as its values
    assert T.compare(near.t(), ref.t()).max_abs == want["near"][1]


def test_non_finite_and_integer_state_without_host_copies(monkeypatch, no_host_copies):
    monkeypatch.setattr(T, "_CHUNK", 5)
    ref = torch.zeros(23)
    bad = ref.clone()
    bad[21] = float("nan")  # in the last chunk
    rep = T.compare(bad, ref)
    assert not rep.ok and "non-finite" in rep.reason
    assert T.compare(torch.tensor([3, 4]), torch.tensor([3, 4])).ok
    assert not T.compare(torch.tensor([3, 4]), torch.tensor([3, 5])).ok
    assert T.rel_l2(torch.zeros(4), torch.zeros(4)) == 0.0 and T.rel_l2(torch.ones(4), torch.zeros(4)) == float("inf")
    # the second criteria, reached when the table fails, stay on the device too
    g = torch.Generator().manual_seed(2)
    r32 = torch.randn(300, generator=g)
    r16 = r32.bfloat16()
    off = r16.clone()
    off[7] += 0.5
    assert T.compare_floor(off, r16, r32).criterion == "floor"
    assert T.compare_lossy(off, r16, r32).criterion == "lossy"


def test_a_graph_capture_check_judges_the_state_change_without_host_copies(no_host_copies):
    """graphs._mismatch on a state whose step wrote one row a little off (by rel-L2 of the change): passes by the
    bound, noted; the same row written at a wrong place fails."""
    from kernels_runtime.graphs import _mismatch

    g = torch.Generator().manual_seed(1)
    before = torch.randn(2, 4, 16, 8, generator=g).bfloat16()
    want = before.clone()
    want[:, :, 5] = torch.randn(2, 4, 8, generator=g).bfloat16()
    got = want.clone()
    got[0, 0, 5, 0] += 0.5  # beyond the elementwise table, small against the change
    notes: list[str] = []
    assert _mismatch([got], [want], "state", notes, base=[before]) == ""
    assert notes and "rel-L2 of the step's change" in notes[0], notes
    misplaced = before.clone()
    misplaced[:, :, 6] = want[:, :, 5]
    assert "over" in _mismatch([misplaced], [want], "state", [], base=[before])
