"""The rounding floor: a second, calibrated correctness criterion for 16-bit tasks (kernels_runtime.tolerances.
compare_floor). An output passes against the 16-bit reference under TOLERANCES[dtype], or, per tensor, when it is no
farther from an fp32 copy of the reference (ref32) than FLOOR_FACTOR times the 16-bit reference itself is, in L2
and in max abs. End to end through the real spawned worker on the CPU (Triton's interpreter)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_verify import shared_pool

from kernels_runtime.tolerances import (
    FLOOR_FACTOR,
    FLOOR_MAX_REL_L2,
    compare,
    compare_floor,
)
from llm4llm.taskspec import Case, CaseSig, TaskSpec, TensorSig, load_task, write_task
from llm4llm.verify.gates import is_16bit, reference_fn

K, N, EPS = 64, 48, 1e-5
SHAPES = [(2, 3, K)]

# ------------------------------------------------------------------------------------------- synthetic tensors


def _rounded_pair(seed: int = 0):
    """ref32, ref16 = ref32 after an amplified rounding of an intermediate, and a candidate that rounds once."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(64, 64, generator=g)
    w = torch.randn(64, 64, generator=g) * 4
    ref32 = h @ w
    ref16 = (h.bfloat16().float() @ w).bfloat16()
    cand = ref32.bfloat16()
    return ref32, ref16, cand


def test_compare_floor_passes_a_once_rounded_output_the_table_rejects():
    ref32, ref16, cand = _rounded_pair()
    assert not compare(cand, ref16).ok
    rep = compare_floor(cand, ref16, ref32)
    assert rep.ok and rep.criterion == "floor" and rep.reason.startswith("floor: rel-L2 vs fp32"), rep.reason
    assert rep.max_abs == compare(cand, ref16).max_abs  # errors are still reported against ref16


def test_compare_floor_table_pass_is_reported_as_table():
    ref32, ref16, _ = _rounded_pair()
    rep = compare_floor(ref16.clone(), ref16, ref32)
    assert rep.ok and rep.criterion == "table"


@pytest.mark.parametrize("bug", ["scale_1pct", "sign", "zeros", "one_element", "nan", "inf", "shape", "dtype"])
def test_compare_floor_never_rescues_garbage(bug):
    ref32, ref16, cand = _rounded_pair()
    bad = {
        "scale_1pct": lambda: (ref32 * 1.01).bfloat16(),
        "sign": lambda: -cand,
        "zeros": lambda: torch.zeros_like(cand),
        "one_element": lambda: cand.clone().index_put_((torch.tensor([3]), torch.tensor([5])), torch.tensor(
            float(cand[3, 5]) + 50 * float((ref16.float() - ref32).abs().max()), dtype=torch.bfloat16)),
        "nan": lambda: cand.clone().index_fill_(0, torch.tensor([0]), float("nan")),
        "inf": lambda: cand.clone().index_fill_(0, torch.tensor([0]), float("inf")),
        "shape": lambda: cand[:, :-1],
        "dtype": lambda: cand.half(),
    }[bug]()
    assert not compare_floor(bad, ref16, ref32).ok


def test_compare_floor_admits_one_output_ulp_where_ref16_rounded_close():
    """ref16 sits 0.3 from ref32 everywhere (outputs 130-230, where bf16's ulp is 1, and one output of 1.0 where the
    table rejects ref16's own error); a candidate one ulp from ref16 at one large output (0.7 > 2 x 0.3 + atol, as a
    truncating cast or a once-rounded fp32 result can be) passes; two ulps fail."""
    ref32 = torch.cat([torch.arange(130, 230, dtype=torch.float64) + 0.3, torch.tensor([1.0], dtype=torch.float64)])
    ref16 = torch.cat([torch.floor(ref32[:-1]), torch.tensor([1.296875], dtype=torch.float64)]).bfloat16()
    assert torch.equal(ref16.double()[:-1], torch.floor(ref32[:-1]))  # integers in [130, 230) are bf16 values
    one_ulp, two_ulps = ref16.clone(), ref16.clone()
    one_ulp[-1] = two_ulps[-1] = 1.0  # exact where ref16 is off by more than the table allows: the floor decides
    one_ulp[0] += 1
    two_ulps[0] += 2
    assert not compare(one_ulp, ref16).ok
    rep = compare_floor(one_ulp, ref16, ref32)
    assert rep.ok and rep.criterion == "floor", rep.reason
    bad = compare_floor(two_ulps, ref16, ref32)
    assert not bad.ok and "beyond one torch.bfloat16 ulp" in bad.reason, bad.reason


def test_compare_floor_not_applied_where_the_16bit_reference_is_noise():
    ref32 = torch.randn(256)
    ref16 = (ref32 + 0.5 * FLOOR_MAX_REL_L2 * 4 * torch.randn(256)).bfloat16()  # rel-L2 ~ 2 x the cap
    rep = compare_floor(torch.zeros_like(ref16), ref16, ref32)
    assert not rep.ok and "not applied" in rep.reason
    assert FLOOR_FACTOR == 2.0


# ------------------------------------------------------------------------------------ end to end: the worker

def build_task(root: Path, dtype: torch.dtype) -> Path:
    """RMSNorm(64) then a 64→48 projection with large random weights, in `dtype`: in bf16 the module rounds the
    normalised activations twice before the projection, which amplifies that rounding beyond the elementwise table."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    module = torch.nn.Sequential(LlamaRMSNorm(K, eps=EPS), torch.nn.Linear(K, N, bias=False)).eval()
    with torch.no_grad():
        module[0].weight.copy_(1.0 + 0.5 * torch.randn(K))
        module[1].weight.copy_(4.0 * torch.randn(N, K))
    module = module.to(dtype)
    weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    name = str(dtype).removeprefix("torch.")
    cases, sigs = [], []
    for shape in SHAPES:
        x = (torch.randn(shape) * 0.1).to(dtype)
        with torch.no_grad():
            ref = module(x)
        cases.append(Case(inputs={"x": x}, weights=weights, state={}, ref={"out": ref}))
        sigs.append(CaseSig(inputs={"x": TensorSig(shape=list(shape), dtype=name)},
                            outputs={"out": TensorSig(shape=[*shape[:-1], N], dtype=name)}))
    spec = TaskSpec(family="norm", module_class="torch.nn.modules.container.Sequential", instances=["model.proj"],
                    phase="prefill", input_names=["x"], weight_names=list(weights), output_names=["out"],
                    static={"eps": EPS}, cases=sigs, dtype=name,
                    recipe={"args": [{"kind": "tensor", "name": "x"}], "kwargs": {}})
    return write_task(root / name, spec, module, cases)


CANDIDATE = '''
import torch
import triton
import triton.language as tl


@triton.jit
def _norm_proj(x_ptr, w_ptr, p_ptr, out_ptr, K, N, eps, sign, BK: tl.constexpr, BN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BK)
    n = tl.arange(0, BN)
    mk = k < K
    mn = n < N
    x = tl.load(x_ptr + row * K + k, mask=mk, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + k, mask=mk, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
    h = x * rstd * WEIGHT
    p = tl.load(p_ptr + n[None, :] * K + k[:, None], mask=mk[:, None] & mn[None, :], other=0.0).to(tl.float32)
    y = sign * tl.sum(h[:, None] * p, axis=0)
    tl.store(out_ptr + row * N + n, y.to(out_ptr.dtype.element_ty), mask=mn)


def entry(inputs, weights, state, static):
    x = inputs["x"]
    w = weights["0.weight"]
    p = weights["1.weight"]
    k = x.shape[-1]
    n = p.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    rows = x.numel() // k
    _norm_proj[(rows,)](x, w, p, out, k, n, static["eps"] * EPS_FACTOR, SIGN_VALUE,
                        BK=triton.next_power_of_2(k), BN=triton.next_power_of_2(n))
    return {"out": out}
'''


def candidate(bug: str = "") -> str:
    return (CANDIDATE.replace("WEIGHT", "1.0" if bug == "no_weight" else "w")
            .replace("EPS_FACTOR", "100.0" if bug == "eps100" else "1.0")
            .replace("SIGN_VALUE", "-1.0" if bug == "sign" else "1.0"))


_TASKS: dict = {}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    if not _TASKS:
        root = tmp_path_factory.mktemp("floor")
        _TASKS.update({d: build_task(root, d) for d in (torch.bfloat16, torch.float32)})
    return _TASKS


def test_the_table_alone_rejects_the_correct_bf16_candidate(tasks):
    """The premise: computing in fp32 and rounding once lands beyond 1e-2 + 1e-2·|ref| of the bf16 module, and
    the fp32 reference the floor uses is the same module upcast."""
    task = load_task(tasks[torch.bfloat16])
    assert is_16bit(task) and not is_16bit(load_task(tasks[torch.float32]))
    case = task.cases[0]
    x, w, p = case.inputs["x"].float(), case.weights["0.weight"].float(), case.weights["1.weight"].float()
    once = ((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w) @ p.T).bfloat16()
    assert not compare(once, case.ref["out"]).ok
    ref32 = reference_fn(task, torch.device("cpu"), upcast=True)(case.inputs, case.weights, {}, task.spec.static)
    assert ref32["out"].dtype == torch.float32
    assert compare_floor(once, case.ref["out"], ref32["out"]).ok


def test_correct_bf16_candidate_passes_by_the_floor(tasks):
    v = shared_pool().verify(tasks[torch.bfloat16], candidate())
    assert v.passed, v.message
    detail = next(g.detail for g in v.gates if g.name == "correctness")
    assert "rounding floor" in detail and "rel-L2 vs fp32" in detail, detail
    assert v.max_abs_err is not None and v.max_abs_err > 1e-2  # still reported against the bf16 reference


@pytest.mark.parametrize("bug", ["eps100", "no_weight", "sign"])
def test_buggy_bf16_candidate_still_fails(tasks, bug):
    v = shared_pool().verify(tasks[torch.bfloat16], candidate(bug))
    assert not v.passed and v.failure_class == "wrong_output", v.message
    assert "floor:" in v.message, v.message


def test_fp32_task_is_unaffected(tasks):
    ok = shared_pool().verify(tasks[torch.float32], candidate())
    assert ok.passed, ok.message
    assert "floor" not in next(g.detail for g in ok.gates if g.name == "correctness")
    bad = shared_pool().verify(tasks[torch.float32], candidate("eps100"))
    assert not bad.passed and bad.failure_class == "wrong_output" and "floor" not in bad.message, bad.message
