"""linear: odd shapes exercise the masks of both kernels (dot and GEMV), every epilogue, bias, the gated form."""
import pytest
import torch

from kernels_runtime.ops.linear import linear, linear_ref
from kernels_runtime.tolerances import assert_close, compare_floor

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [2, 3, 8])
@pytest.mark.parametrize("gated", [False, True])
def test_gemv_split_k_matches_ref(dtype, split, gated, monkeypatch):
    """Split-K GEMV: K = 200 over 2, 3 or 8 splits of 32-wide blocks (the last split short or empty), bias, the
    gated form; the same result as one pass within the table, and deterministic (a fixed reduction order)."""
    x = torch.randn(2, 200, dtype=dtype)
    w = (torch.randn(37, 200) / 200**0.5).to(dtype)
    wu = (torch.randn(37, 200) / 200**0.5).to(dtype) if gated else None
    b = torch.randn(37, dtype=dtype)
    kw = dict(w_up=wu, GEMV_BLOCK_N=16, GEMV_BLOCK_K=32, GEMV_SPLIT_K=split)
    out = linear(x, w, b, "silu", **kw)
    assert out.shape == (2, 37) and out.dtype == dtype
    assert_close(out, linear_ref(x, w, b, "silu", w_up=wu), name=f"split-K {split}")
    assert torch.equal(out, linear(x, w, b, "silu", **kw))
    # the split path ran, not the one-pass GEMV
    import kernels_runtime.ops.linear as mod

    launched = []

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in ("_gemv_kernel", "_gemv_split_kernel", "_gemv_reduce_kernel"):
        monkeypatch.setattr(mod, name, Spy(name, getattr(mod, name)))
    linear(x, w, b, "silu", **kw)
    assert launched == ["_gemv_split_kernel", "_gemv_reduce_kernel"]


def test_gemv_split_k_bad_value_is_one_error():
    with pytest.raises(ValueError, match="GEMV_SPLIT_K an int >= 1"):
        linear(torch.randn(1, 8), torch.randn(4, 8), GEMV_SPLIT_K=0)


@pytest.mark.parametrize("dtype,res_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("M,split", [(1, 1), (2, 3), (21, 1)])  # GEMV, split-K GEMV + reduce, the dot path
def test_linear_residual_epilogue(dtype, res_dtype, M, split):
    """y = residual + linear(x): the projection rounded to x's dtype, the add in fp32, the result in the promoted
    dtype (a Mamba block's out_proj on the fp32 residual stream), in all three store paths."""
    g = torch.Generator().manual_seed(M + split)
    K, N = 70, 33
    x = torch.randn(M, 1, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    res = (torch.randn(M, 1, N, generator=g) * 4).to(res_dtype)
    out = linear(x, w, b, residual=res, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GEMV_BLOCK_N=16, GEMV_BLOCK_K=16,
                 GEMV_SPLIT_K=split)
    ref = linear_ref(x, w, b, residual=res)
    assert out.dtype == ref.dtype == torch.promote_types(dtype, res_dtype) and out.shape == (M, 1, N)
    assert_close(out, ref, dtype, name="linear + residual")
    assert_close(out, (res.float() + linear_ref(x, w, b).float()).to(out.dtype), dtype, name="vs the unfused add")
    with pytest.raises(ValueError, match="residual"):
        linear(x, w, b, residual=res[..., :-1])


@pytest.mark.gpu
@pytest.mark.parametrize("M,split", [(1, 1), (1, 4), (512, 1)])
def test_linear_residual_on_cuda_at_mamba_sizes(M, split):
    """out_proj with the block's residual add on the GPU (mamba-130m: K 1536 -> N 768, bf16, fp32 residual)."""
    g = torch.Generator(device="cuda").manual_seed(M + split)
    x = torch.randn(1, M, 1536, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(768, 1536, device="cuda", generator=g) / 1536**0.5).to(torch.bfloat16)
    res = torch.randn(1, M, 768, device="cuda", generator=g) * 4
    out = linear(x, w, residual=res, GEMV_BLOCK_N=16, GEMV_BLOCK_K=32, GEMV_SPLIT_K=split)
    assert out.dtype == torch.float32
    # out = res + bf16(x @ w): a different accumulation order may round x @ w to the neighbouring bf16 (one ulp, 0.0156
    # at |x @ w| in [2, 4)) while |out| is small, so the elementwise table is the wrong yardstick (it failed so on the
    # H200, 2026-11-30); the rounding floor against the unrounded sum is the verifier's own criterion for this
    exact = res + torch.nn.functional.linear(x.float(), w.float())
    rep = compare_floor(out, linear_ref(x, w, residual=res), exact, torch.bfloat16)
    assert rep.ok, f"linear + residual: {rep.reason}"


def test_linear_cublas_is_the_plain_projection_and_refuses_fused_work():
    x = torch.randn(2, 9, 40, dtype=torch.bfloat16)
    w = (torch.randn(24, 40) / 40**0.5).to(torch.bfloat16)
    b = torch.randn(24, dtype=torch.bfloat16)
    out = linear(x, w, b, impl="cublas", BLOCK_M=16)  # the Triton kernel's block sizes are ignored
    assert out.shape == (2, 9, 24) and out.dtype == torch.bfloat16
    assert_close(out, linear_ref(x, w, b), name="linear cublas")
    for bad in ({"epilogue": "silu"}, {"w_up": w}, {"residual": torch.zeros(2, 9, 24)}, {"round_pre": True}):
        with pytest.raises(ValueError, match="plain projection"):
            linear(x, w, impl="cublas", **bad)
    with pytest.raises(ValueError, match="impl"):
        linear(x, w, impl="cutlass")


def test_library_linear_on_cublas_is_glue_only_in_an_attention_task():
    """The verifier's does_the_work gate counts heavy aten ops a candidate runs outside Triton. The library's launcher
    choosing cuBLAS for a projection is reviewed library code, glue around an attention kernel (the prefill
    templates' projections); in a linear or MLP task the GEMM is the work, so a candidate calling it fails the gate."""
    from llm4llm.verify.gates import AtenCounter, torch_work_failure

    x, w = torch.randn(6, 16), torch.randn(8, 16)
    counter = AtenCounter()
    with counter.mode:
        linear(x, w, impl="cublas")
    assert torch_work_failure(counter.report(), 48, "attention") is None
    for family in ("linear", "mlp", None):
        assert "linear(impl='cublas')" in torch_work_failure(counter.report(), 48, family)
    counter = AtenCounter()
    with counter.mode:
        linear(x, w)  # the library's Triton kernel: no aten compute at all
    assert torch_work_failure(counter.report(), 48, "mlp") is None
    with counter.mode:
        torch.nn.functional.linear(x, w)  # the same op called by the candidate itself is torch doing the work
    assert "heavy aten ops" in torch_work_failure(counter.report(), 48, "attention")
