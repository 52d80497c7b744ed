"""gelu_mlp: both GELU forms, with and without biases, through the dot path (prefill) and the GEMV path (decode), at
odd sizes, against float64 and against the op-by-op reference in the dtype; the linear op's `round_pre`."""
import pytest
import torch

from kernels_runtime.ops.gelu_mlp import gelu_mlp, gelu_mlp_ref
from kernels_runtime.ops.linear import linear, linear_ref
from kernels_runtime.tolerances import assert_close

SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GEMV_BLOCK_N=16, GEMV_BLOCK_K=16)


def _weights(H, I, dtype, g, bias=True):
    w1 = (torch.randn(I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(H, I, generator=g) / I**0.5).to(dtype)
    b1 = (torch.randn(I, generator=g) * 0.5).to(dtype) if bias else None
    b2 = (torch.randn(H, generator=g) * 0.5).to(dtype) if bias else None
    return w1, b1, w2, b2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("lead,seed", [((2, 11), 0), ((3, 1), 1)])  # M = 22: the dot path; M = 3: the GEMV path
def test_gelu_mlp_matches_float64_and_the_op_by_op_reference(dtype, approximate, lead, seed):
    g = torch.Generator().manual_seed(seed)
    H, I = 29, 45
    x = (torch.randn(*lead, H, generator=g) * 2).to(dtype)
    w1, b1, w2, b2 = _weights(H, I, dtype, g)
    out = gelu_mlp(x, w1, b1, w2, b2, approximate, **SMALL)
    assert out.shape == x.shape and out.dtype == dtype
    exact = gelu_mlp_ref(*(t.double() for t in (x, w1, b1, w2, b2)), approximate)
    assert_close(out, exact.to(dtype), dtype, name="vs float64")
    assert_close(out, gelu_mlp_ref(x, w1, b1, w2, b2, approximate), dtype, name="vs the op-by-op reference")


def test_gelu_mlp_split_k_gemv_in_bf16():
    """A decode config with split-K: the pre-activation rounding and the GELU happen in the reduce launch."""
    g = torch.Generator().manual_seed(4)
    H, I = 40, 72
    x = (torch.randn(2, 1, H, generator=g) * 2).to(torch.bfloat16)
    w1, b1, w2, b2 = _weights(H, I, torch.bfloat16, g)
    out = gelu_mlp(x, w1, b1, w2, b2, "tanh", GEMV_BLOCK_N=16, GEMV_BLOCK_K=16, GEMV_SPLIT_K=3)
    assert_close(out, gelu_mlp_ref(x, w1, b1, w2, b2, "tanh"), name="split-K vs the op-by-op reference")
    exact = gelu_mlp_ref(*(t.double() for t in (x, w1, b1, w2, b2)), "tanh")
    assert_close(out, exact.to(torch.bfloat16), name="split-K vs float64")


@pytest.mark.parametrize("gemv", [False, True])
def test_gelu_mlp_without_bias_and_with_a_transposed_weight_view(gemv):
    """Falcon's bias-free MLP; a Conv1D weight [in, out] passed as its .T view (strides honoured, no copy)."""
    g = torch.Generator().manual_seed(2)
    H, I = 24, 40
    x = torch.randn(5, H, generator=g)
    w1, _, w2, _ = _weights(H, I, torch.float32, g, bias=False)
    w1_conv1d = w1.T.contiguous()  # [H, I], as GPT-2's Conv1D stores it
    out = gelu_mlp(x, w1_conv1d.T, None, w2, None, "tanh", gemv=gemv, **SMALL)
    assert_close(out, gelu_mlp_ref(x.double(), w1.double(), None, w2.double(), None, "tanh").float())


def test_gelu_mlp_rejects_bad_arguments():
    x, w1, w2 = torch.randn(2, 8), torch.randn(12, 8), torch.randn(8, 12)
    with pytest.raises(ValueError, match="expected approximate"):
        gelu_mlp(x, w1, None, w2, None, "erf")
    with pytest.raises(ValueError, match="expected w_up"):
        gelu_mlp(x, w1, None, w2.T, None)
    with pytest.raises(ValueError, match="expected b_up"):
        gelu_mlp(x, w1, torch.randn(8), w2, None)


@pytest.mark.parametrize("gemv", [False, True])
def test_round_pre_rounds_the_pre_activation_to_x_dtype(gemv):
    """x = identity, so x @ w.T + b is w + b exactly in fp32, mostly between two bf16 values: with round_pre the
    kernel's GELU sees bf16(w + b), as after an nn.Linear; the unrounded reference differs on many elements."""
    g = torch.Generator().manual_seed(3)
    n = 8
    x = torch.eye(n, dtype=torch.bfloat16)
    w = (torch.randn(32, n, generator=g) * 3).to(torch.bfloat16)
    b = (torch.randn(32, generator=g) * 0.01).to(torch.bfloat16)
    out = linear(x, w, b, "gelu", round_pre=True, gemv=gemv, **SMALL)
    rounded, unrounded = linear_ref(x, w, b, "gelu", round_pre=True), linear_ref(x, w, b, "gelu")
    # Below about -4, GELU = x * (1 + erf(x / sqrt 2)) / 2 cancels in 1 + erf, and erf's last bits differ between
    # hosts' libm (5 of the 256 elements there, on one CPU host, all below -4.5): bit equality is asked elsewhere
    body = (w.float().T + b.float()).abs() < 4  # x @ w.T + b = w.T + b for x = identity
    same_rounded = (out == rounded)[body].float().mean().item()
    same_unrounded = (out == unrounded)[body].float().mean().item()
    assert same_rounded > 0.99 and same_unrounded < 0.95, (same_rounded, same_unrounded)
    assert torch.equal(linear(x.float(), w.float(), b.float(), "gelu", round_pre=True, gemv=gemv, **SMALL),
                       linear(x.float(), w.float(), b.float(), "gelu", gemv=gemv, **SMALL))  # fp32: a no-op
