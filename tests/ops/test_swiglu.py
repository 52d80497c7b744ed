import pytest
import torch

from kernels_runtime.ops.swiglu import silu_and_mul, silu_and_mul_ref, swiglu_fused, swiglu_fused_ref
from kernels_runtime.tolerances import assert_close

CPU_DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(3, 200), (2, 5, 80)])
@pytest.mark.parametrize("seed", [0, 1])
def test_silu_and_mul_matches_ref(dtype, shape, seed):
    torch.manual_seed(seed)
    g, u = torch.randn(shape, dtype=dtype) * 3, torch.randn(shape, dtype=dtype)
    out = silu_and_mul(g, u, BLOCK_N=64)
    assert_close(out, silu_and_mul_ref(g, u), dtype)
    assert_close(out, silu_and_mul_ref(g.double(), u.double()).to(dtype), dtype, name="vs float64")


def test_silu_and_mul_halves_of_merged_projection():
    gu = torch.randn(4, 2 * 80, dtype=torch.float16)
    g, u = gu[:, :80], gu[:, 80:]
    assert_close(silu_and_mul(g, u), silu_and_mul_ref(g, u))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("mk_n", [((2, 9), 80, 72), ((1,), 200, 40)])
@pytest.mark.parametrize("seed", [0, 1])
def test_swiglu_fused_matches_ref(dtype, mk_n, seed):
    torch.manual_seed(seed)
    lead, K, N = mk_n
    x = torch.randn(*lead, K, dtype=dtype)
    wg, wu = torch.randn(N, K, dtype=dtype) / K**0.5, torch.randn(N, K, dtype=dtype) / K**0.5
    out = swiglu_fused(x, wg, wu, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
    assert out.shape == (*lead, N)
    assert_close(out, swiglu_fused_ref(x, wg, wu), dtype)
    assert_close(out, swiglu_fused_ref(x.double(), wg.double(), wu.double()).to(dtype), dtype, name="vs float64")


def test_swiglu_fused_default_config():
    x, wg, wu = torch.randn(3, 48), torch.randn(40, 48) / 7, torch.randn(40, 48) / 7
    assert_close(swiglu_fused(x, wg, wu), swiglu_fused_ref(x, wg, wu))


def test_swiglu_rejects_bad_shapes():
    with pytest.raises(ValueError, match="expected w_gate and w_up"):
        swiglu_fused(torch.randn(2, 16), torch.randn(8, 16), torch.randn(8, 15))
    with pytest.raises(ValueError, match="expected up like gate"):
        silu_and_mul(torch.randn(2, 16), torch.randn(2, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 67, 512])
def test_swiglu_cuda_bf16(M):
    K, N = 2560, 9728
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    wg = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    wu = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    assert_close(swiglu_fused(x, wg, wu), swiglu_fused_ref(x, wg, wu))
    g, u = x @ wg.T, x @ wu.T
    assert_close(silu_and_mul(g, u), silu_and_mul_ref(g, u))
