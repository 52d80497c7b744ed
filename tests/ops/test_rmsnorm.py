import pytest
import torch

from kernels_runtime.ops.rmsnorm import (
    gated_rmsnorm,
    gated_rmsnorm_ref,
    rmsnorm,
    rmsnorm_gemma_ref,
    rmsnorm_ref,
    rmsnorm_residual,
    rmsnorm_residual_ref,
    rmsnorm_rows,
)
from kernels_runtime.tolerances import assert_close

CPU_DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(3, 80), (2, 5, 200), (1, 37)])
@pytest.mark.parametrize("seed", [0, 1])
def test_rmsnorm_matches_ref(dtype, shape, seed):
    torch.manual_seed(seed)
    x = torch.randn(shape, dtype=dtype) * 3
    w = torch.randn(shape[-1], dtype=dtype)
    out = rmsnorm(x, w, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, rmsnorm_ref(x, w, 1e-5), dtype)
    assert_close(out, rmsnorm_ref(x.double(), w.double(), 1e-5).to(dtype), dtype, name="vs float64")


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_rmsnorm_residual_matches_ref_and_keeps_inputs(dtype, seed):
    torch.manual_seed(seed)
    x, r = torch.randn(2, 3, 200, dtype=dtype), torch.randn(2, 3, 200, dtype=dtype)
    w = torch.randn(200, dtype=dtype)
    x0, r0 = x.clone(), r.clone()
    out, res = rmsnorm_residual(x, r, w)
    out_ref, res_ref = rmsnorm_residual_ref(x, r, w)
    assert_close(out, out_ref, dtype)
    assert_close(res, res_ref, dtype, name="new_residual")
    assert torch.equal(x, x0) and torch.equal(r, r0)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_rmsnorm_gemma_matches_hf_recurrent_gemma(dtype, seed):
    """gemma=True: RecurrentGemmaRMSNorm's numerics (fp32 throughout, 1 + weight, one rounding; output in x's
    dtype), against HF's module itself and a float64 reference; the Llama numerics differ from it."""
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRMSNorm

    torch.manual_seed(seed)
    x = torch.randn(2, 3, 200, dtype=dtype) * 3
    hf = RecurrentGemmaRMSNorm(200, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(200) * 0.5)
        want = hf(x)
    out = rmsnorm(x, hf.weight, 1e-6, gemma=True)
    assert out.dtype == dtype
    assert_close(out, want, dtype)
    assert_close(out, rmsnorm_gemma_ref(x.double(), hf.weight.double(), 1e-6).to(dtype), dtype, name="vs float64")
    assert not torch.allclose(rmsnorm(x, hf.weight, 1e-6).float(), want.float(), atol=1e-3)


def test_rmsnorm_strided_rows_and_fp32_weight():
    x = torch.randn(4, 160, dtype=torch.float16)[:, :80]  # row stride 160
    w = torch.randn(80, dtype=torch.float32)
    out = rmsnorm(x, w)
    assert out.dtype == torch.float32
    assert_close(out, rmsnorm_ref(x, w), torch.float16)


def test_rmsnorm_rejects_bad_weight():
    with pytest.raises(ValueError, match="expected weight of shape"):
        rmsnorm(torch.randn(2, 80), torch.randn(64))
    with pytest.raises(ValueError, match="residual"):
        rmsnorm_residual(torch.randn(2, 80), torch.randn(2, 81), torch.randn(80))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(3, 80), (2, 5, 200), (1, 37)])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_rmsnorm_rows_matches_ref(dtype, shape, rows, seed):
    """Several rows a program, a row count that is no multiple of `rows` (masked tail) and odd widths."""
    torch.manual_seed(seed)
    x = torch.randn(shape, dtype=dtype) * 3
    w = torch.randn(shape[-1], dtype=dtype)
    out = rmsnorm_rows(x, w, 1e-5, rows=rows, num_warps=2)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, rmsnorm_ref(x, w, 1e-5), dtype)
    assert_close(out, rmsnorm_ref(x.double(), w.double(), 1e-5).to(dtype), dtype, name="vs float64")


def test_rmsnorm_rows_strided_rows_and_fp32_weight():
    x = torch.randn(5, 160, dtype=torch.float16)[:, :80]  # row stride 160
    w = torch.randn(80, dtype=torch.float32)
    out = rmsnorm_rows(x, w, rows=2)
    assert out.dtype == torch.float32
    assert_close(out, rmsnorm_ref(x, w), torch.float16)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(3, 80), (2, 5, 48), (1, 37)])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_gated_rmsnorm_matches_ref_and_hf(dtype, shape, gated, seed):
    """Mamba2's MambaRMSNormGated, with and without the gate: against HF's module and a float64 reference."""
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    torch.manual_seed(seed)
    x = torch.randn(shape, dtype=dtype) * 3
    z = torch.randn(shape, dtype=dtype) if gated else None
    hf = MambaRMSNormGated(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(shape[-1]) * 0.5)
        want = hf(x, z)
    x0 = x.clone()
    out = gated_rmsnorm(x, z, hf.weight, 1e-6, rows=2, num_warps=1)
    assert out.shape == x.shape and out.dtype == dtype and torch.equal(x, x0)
    assert_close(out, want, dtype)
    assert_close(out, gated_rmsnorm_ref(x, z, hf.weight, 1e-6), dtype, name="vs ref")
    z64 = z.double() if gated else None
    assert_close(out, gated_rmsnorm_ref(x.double(), z64, hf.weight.double(), 1e-6).to(dtype), dtype,
                 name="vs float64")


def test_gated_rmsnorm_fp32_input_into_a_16_bit_output_over_strided_rows():
    """Mamba2's prefill: the scan's fp32 output normalised into the activation dtype; the gate a column slice of
    in_proj's output (row stride > N)."""
    torch.manual_seed(0)
    y = torch.randn(7, 48, dtype=torch.float32)
    gate = torch.randn(7, 100, dtype=torch.float16)[:, 10:58]
    w = torch.randn(48, dtype=torch.float16)
    out = gated_rmsnorm(y, gate, w, 1e-5, out_dtype=torch.float16, rows=4)
    assert out.dtype == torch.float16
    assert_close(out, gated_rmsnorm_ref(y, gate, w, 1e-5).to(torch.float16), torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2560, 4096, 4000])
def test_rmsnorm_cuda_bf16(n):
    x, r = torch.randn(67, n, device="cuda", dtype=torch.bfloat16), torch.randn(67, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    assert_close(rmsnorm(x, w), rmsnorm_ref(x, w))
    assert_close(rmsnorm(x, w, gemma=True), rmsnorm_gemma_ref(x, w), name="gemma")
    out, res = rmsnorm_residual(x, r, w)
    out_ref, res_ref = rmsnorm_residual_ref(x, r, w)
    assert_close(out, out_ref)
    assert_close(res, res_ref)


@pytest.mark.parametrize("stream", [torch.float32, torch.bfloat16])
def test_rmsnorm_in_dtype_is_hf_block_norm(stream):
    """in_dtype: the norm of x.to(in_dtype), as HF's Mamba blocks feed the fp32 residual stream to a bf16 norm."""
    from transformers.models.mamba.modeling_mamba import MambaRMSNorm

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 5, 96, generator=g) * 3).to(stream)
    norm = MambaRMSNorm(96, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(96, generator=g))
        ref = norm(x.to(torch.bfloat16))
    out = rmsnorm(x, norm.weight.detach(), 1e-5, in_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert_close(out, ref, name="block norm")
    # the same roundings as HF's (x to bf16, x * rstd to bf16, the weight product to bf16): equal but for a rare
    # 1-ulp rstd from another summation order (without the first rounding about half the elements differ)
    assert (out == ref).float().mean() > 0.98
    with pytest.raises(ValueError, match="in_dtype"):
        rmsnorm(x, norm.weight.detach(), 1e-5, in_dtype=torch.int8)
