"""Guards are pure predicates: tested on the CPU with fake tensors and fake hardware."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from kernels_runtime.bundle import Guard
from kernels_runtime.guards import check_capability, check_shape, dim_ok, is_supported


@dataclass
class FakeTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    device: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(type="cuda", index=0))
    contiguous: bool = True

    def is_contiguous(self) -> bool:
        return self.contiguous

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def stride(self) -> tuple[int, ...]:
        return (1,) * len(self.shape)


@dataclass
class FakeCall:
    inputs: dict
    capability: tuple[int, int] | None = (9, 0)


def call(**inputs) -> FakeCall:
    return FakeCall(inputs=inputs)


def test_empty_guard_accepts_anything():
    assert is_supported(Guard(), call(x=FakeTensor((3, 5), torch.float16))) == (True, "")


@pytest.mark.parametrize("dtype,ok", [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False)])
def test_dtype(dtype, ok):
    got, reason = is_supported(Guard(dtypes=["bfloat16", "float16"]), call(hidden_states=FakeTensor((1, 7, 64), dtype)))
    assert got is ok
    if not ok:
        assert reason == "dtype: expected bfloat16|float16, got float32 (hidden_states)"


def test_dtype_ignores_integer_inputs():
    c = call(x=FakeTensor((2, 3), torch.bfloat16), position_ids=FakeTensor((2, 3), torch.int64))
    assert is_supported(Guard(dtypes=["bfloat16"]), c)[0]


@pytest.mark.parametrize("cap,ok", [((8, 0), False), ((9, 0), True), ((10, 0), True)])
def test_min_capability(cap, ok):
    c = FakeCall(inputs={"x": FakeTensor((4,))}, capability=cap)
    got, reason = is_supported(Guard(min_capability="9.0"), c)
    assert got is ok
    if not ok:
        assert reason == "capability: expected >= 9.0, got 8.0"


def test_capability_on_cpu_rejects():
    assert check_capability((8, 0), "cpu", None) == (False, "capability: expected cuda >= 8.0, got cpu")


def test_device_type():
    cpu = FakeTensor((4,), device=SimpleNamespace(type="cpu", index=None))
    assert is_supported(Guard(device_types=["cuda"]), call(x=cpu)) == (False, "device: expected cuda, got cpu")
    assert is_supported(Guard(device_types=["cuda"]), call(x=FakeTensor((4,))))[0]


@pytest.mark.parametrize("spec,size,ok", [
    (None, 17, True), (16, 16, True), (16, 17, False), ((1, 8), 1, True), ((1, 8), 8, True), ((1, 8), 9, False),
    ((2, None), 4096, True), ((2, None), 1, False),
])
def test_dim(spec, size, ok):
    assert dim_ok(spec, size) is ok


def test_shape_exact_and_range():
    guard = Guard(shapes={"hidden_states": [1, [1, 2048], 64]})
    assert is_supported(guard, call(hidden_states=FakeTensor((1, 1823, 64))))[0]
    ok, reason = is_supported(guard, call(hidden_states=FakeTensor((1, 4096, 64))))
    assert not ok and reason == "shape hidden_states: expected [1, 1..2048, 64], got [1, 4096, 64]"
    ok, reason = is_supported(guard, call(hidden_states=FakeTensor((1, 7, 64, 1))))
    assert not ok and "expected [1, 1..2048, 64]" in reason  # rank mismatch


def test_shape_missing_input():
    ok, reason = is_supported(Guard(shapes={"x": [None]}), call(y=FakeTensor((3,))))
    assert not ok and reason == "shape x: expected an input named x, got none"


def test_an_optional_input_may_be_absent_and_is_checked_when_given():
    """An input verified both as None and as a tensor (HF's attention mask, unpadded and padded batches): its absence
    is admitted, its shape checked where given; a signature verified without it admits no call that passes it."""
    x, mask = FakeTensor((3, 6, 64)), FakeTensor((3, 1, 6, 6), dtype=torch.bool)
    shapes = {"x": [3, [6, 16], 64], "attention_mask": [3, 1, 16, 16]}
    assert is_supported(Guard(shapes=shapes, optional=["attention_mask"]), call(x=x))[0]
    assert not is_supported(Guard(shapes=shapes), call(x=x))[0]  # never verified without it
    ok, why = is_supported(Guard(shapes=shapes, optional=["attention_mask"]), call(x=x, attention_mask=mask))
    assert not ok and why.startswith("shape attention_mask: expected [3, 1, 16, 16]"), why
    sigs = [{"x": [3, 6, 64]}, {"x": [3, 16, 64], "attention_mask": [3, 1, 16, 16]}]
    g = Guard(shapes=shapes, signatures=sigs, optional=["attention_mask"])
    assert is_supported(g, call(x=x))[0]
    assert is_supported(g, call(x=FakeTensor((3, 16, 64)), attention_mask=FakeTensor((3, 1, 16, 16))))[0]
    ok, why = is_supported(g, call(x=x, attention_mask=FakeTensor((3, 1, 16, 16))))
    assert not ok and why.startswith("signature:"), why


def test_check_shape_unbounded_range_formats():
    assert check_shape("x", [[2, None]], (1,)) == (False, "shape x: expected [2..], got [1]")


def test_contiguity():
    guard = Guard(contiguous=["x"])
    assert is_supported(guard, call(x=FakeTensor((3, 4))))[0]
    ok, reason = is_supported(guard, call(x=FakeTensor((3, 4), contiguous=False)))
    assert not ok and reason.startswith("contiguity x: expected contiguous")


def test_first_failing_check_is_reported():
    guard = Guard(dtypes=["bfloat16"], shapes={"x": [8]})
    assert is_supported(guard, call(x=FakeTensor((9,))))[1].startswith("dtype:")


def test_real_tensors_on_cpu():
    x = torch.randn(2, 5, 8)
    assert is_supported(Guard(dtypes=["float32"], device_types=["cpu"], shapes={"x": [2, None, 8]}), {"x": x})[0]
    assert not is_supported(Guard(contiguous=["x"]), {"x": x.transpose(0, 1)})[0]


def test_guard_json_round_trip():
    guard = Guard(dtypes=["bfloat16"], min_capability="8.9", shapes={"x": [1, [1, None], 64, None]}, contiguous=["x"])
    again = Guard.model_validate_json(guard.model_dump_json())
    assert again == guard and again.min_capability == (8, 9)


def test_verified_signatures_admit_no_unseen_combination():
    """Cases (2, 3, 80) and (1, 5, 80) give per-dim ranges [1..2, 3..5, 80]; only the two verified joint shapes
    may take the kernel, not (1, 4, 80) or (2, 5, 80), which no case covered."""
    from types import SimpleNamespace

    from kernels_runtime.bundle import Guard
    from kernels_runtime.guards import is_supported

    g = Guard(shapes={"x": [[1, 2], [3, 5], 80]}, signatures=[{"x": [2, 3, 80]}, {"x": [1, 5, 80]}])
    call = lambda *shape: {"x": SimpleNamespace(shape=shape, dtype="float32", device=None,  # noqa: E731
                                                is_floating_point=lambda: True, is_contiguous=lambda: True)}
    assert is_supported(g, call(2, 3, 80))[0] and is_supported(g, call(1, 5, 80))[0]
    for unseen in [(1, 4, 80), (2, 5, 80), (1, 3, 80)]:
        ok, why = is_supported(g, call(*unseen))
        assert not ok and why.startswith("signature: expected one of the 2 verified"), why
    assert not is_supported(g, call(3, 3, 80))[0]  # outside the range: the range check says so first


def test_guard_for_records_the_cases_joint_signatures():
    from llm4llm.patchspec import guard_for
    from llm4llm.taskspec import CaseSig, TaskSpec, TensorSig

    spec = TaskSpec(family="norm", module_class="m.C", instances=["a"], phase="prefill", input_names=["x"],
                    weight_names=[],
                    output_names=["out"], dtype="float32",
                    cases=[CaseSig(inputs={"x": TensorSig(shape=list(s), dtype="float32")}) for s in
                           [(2, 3, 80), (1, 5, 80)]])
    g = guard_for(spec, "cpu")
    assert g.shapes == {"x": [(1, 2), (3, 5), 80]}
    assert g.signatures == [{"x": [2, 3, 80]}, {"x": [1, 5, 80]}]


def test_an_input_whose_rank_varies_is_guarded_by_its_verified_shapes():
    """Cases with x of rank 2 and of rank 3 give x no per-dim box; the guard must still admit only the two verified
    shapes (it used to leave x unguarded: any shape took the kernel); anything else falls back, and dispatch
    counts the fallback under this reason."""
    from llm4llm.patchspec import guard_for
    from llm4llm.taskspec import CaseSig, TaskSpec, TensorSig

    spec = TaskSpec(family="norm", module_class="m.C", instances=["a"], phase="prefill", input_names=["x"],
                    weight_names=[], output_names=["out"], dtype="float32",
                    cases=[CaseSig(inputs={"x": TensorSig(shape=list(s), dtype="float32")}) for s in
                           [(6, 80), (2, 3, 80)]])
    g = guard_for(spec, "cpu")
    assert is_supported(g, {"x": torch.empty(6, 80)})[0] and is_supported(g, {"x": torch.empty(2, 3, 80)})[0]
    for unseen in [(7, 80), (2, 4, 80), (1, 1, 1, 80)]:
        ok, why = is_supported(g, {"x": torch.empty(*unseen)})
        assert not ok and why.startswith("signature:"), (unseen, why)
