"""linear: odd shapes exercise the masks of both kernels (dot and GEMV), every epilogue, bias, the gated form."""
import pytest
import torch

from kernels_runtime.ops.linear import linear, linear_ref
from kernels_runtime.tolerances import assert_close

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,K,N", [((37,), 45, 19), ((2, 13), 70, 33), ((1,), 45, 19), ((3, 1), 70, 33)])
@pytest.mark.parametrize("epilogue", [None, "silu"])
def test_linear_matches_ref(dtype, lead, K, N, epilogue):
    x = torch.randn(*lead, K, dtype=dtype)
    w = (torch.randn(N, K) / K**0.5).to(dtype)
    b = torch.randn(N, dtype=dtype)
    out = linear(x, w, b, epilogue, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GEMV_BLOCK_N=16, GEMV_BLOCK_K=32)
    assert out.shape == (*lead, N) and out.dtype == dtype
    assert_close(out, linear_ref(x, w, b, epilogue), name="linear")


@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize("epilogue", ["gelu", "gelu_tanh"])
def test_linear_gelu_and_forced_path(gemv, epilogue):
    x, w = torch.randn(5, 29), torch.randn(23, 29) / 29**0.5
    out = linear(x, w, epilogue=epilogue, gemv=gemv, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GEMV_BLOCK_N=16,
                 GEMV_BLOCK_K=16)
    assert_close(out, linear_ref(x, w, epilogue=epilogue), name="linear")


@pytest.mark.parametrize("M", [3, 21])
def test_linear_gated_silu_mul(M):
    x = torch.randn(M, 38, dtype=torch.bfloat16)
    wg = (torch.randn(27, 38) / 38**0.5).to(torch.bfloat16)
    wu = (torch.randn(27, 38) / 38**0.5).to(torch.bfloat16)
    out = linear(x, wg, epilogue="silu", w_up=wu, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GEMV_BLOCK_N=16, GEMV_BLOCK_K=16)
    assert_close(out, linear_ref(x, wg, epilogue="silu", w_up=wu), name="gated linear")


def test_linear_strided_input_and_checks():
    x = torch.randn(40, 17)[::2]  # row stride 34: the kernel must honour strides, not assume contiguity
    w = torch.randn(11, 17)
    assert_close(linear(x, w, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16), linear_ref(x, w))
    with pytest.raises(ValueError, match="expected x"):
        linear(torch.randn(3, 5), w)
    with pytest.raises(ValueError, match="epilogue"):
        linear(x, w, epilogue="relu")
