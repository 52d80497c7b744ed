import pytest
import torch

from kernels_runtime.ops.rotary import qk_norm_rotary, qk_norm_rotary_ref, rotary, rotary_ref
from kernels_runtime.tolerances import assert_close

CPU_DTYPES = [torch.float32, torch.float16]


def _inputs(B, Hq, Hkv, S, D, dtype, device="cpu"):
    # q/k as HF builds them: [B, S, H, D] projections viewed as [B, H, S, D]
    q = torch.randn(B, S, Hq, D, dtype=dtype, device=device).transpose(1, 2)
    k = torch.randn(B, S, Hkv, D, dtype=dtype, device=device).transpose(1, 2)
    pos = torch.arange(S, device=device, dtype=torch.float32)[None, :, None] + torch.randint(0, 50, (B, 1, 1), device=device)
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)
    emb = torch.cat([pos * inv_freq, pos * inv_freq], dim=-1)  # [B, S, D]
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(2, 4, 2, 37, 16), (1, 3, 1, 5, 24)])
@pytest.mark.parametrize("seed", [0, 1])
def test_rotary_matches_ref(dtype, shape, seed):
    torch.manual_seed(seed)
    q, k, cos, sin = _inputs(*shape, dtype)
    qo, ko = rotary(q, k, cos, sin, BLOCK_H=2)
    qr, kr = rotary_ref(q, k, cos, sin)
    assert_close(qo, qr, dtype, name="q")
    assert_close(ko, kr, dtype, name="k")
    q64, k64 = rotary_ref(q.double(), k.double(), cos.double(), sin.double())
    assert_close(qo, q64.to(dtype), dtype, name="q vs float64")
    assert_close(ko, k64.to(dtype), dtype, name="k vs float64")


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_qk_norm_rotary_matches_ref(dtype, seed):
    torch.manual_seed(seed)
    q, k, cos, sin = _inputs(2, 4, 2, 13, 32, dtype)
    q, k = q * 4, k * 4
    qw, kw = torch.randn(32, dtype=dtype), torch.randn(32, dtype=dtype)
    q0 = q.clone()
    qo, ko = qk_norm_rotary(q, k, cos, sin, qw, kw, 1e-6)
    qr, kr = qk_norm_rotary_ref(q, k, cos, sin, qw, kw, 1e-6)
    assert_close(qo, qr, dtype, name="q")
    assert_close(ko, kr, dtype, name="k")
    assert torch.equal(q, q0)


def test_rotary_rejects_bad_shapes():
    q, k, cos, sin = _inputs(1, 2, 1, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="cos"):
        rotary(q, k, cos[:, :3], sin)
    with pytest.raises(ValueError, match="even head dim"):
        rotary(q[..., :15], k[..., :15], cos[..., :15], sin[..., :15])
    with pytest.raises(ValueError, match="q_weight"):
        qk_norm_rotary(q, k, cos, sin, torch.ones(8), torch.ones(16))


@pytest.mark.gpu
def test_rotary_cuda_bf16():
    q, k, cos, sin = _inputs(2, 32, 8, 67, 128, torch.bfloat16, "cuda")
    qw, kw = torch.randn(128, device="cuda", dtype=torch.bfloat16), torch.randn(128, device="cuda", dtype=torch.bfloat16)
    for out, ref in zip(rotary(q, k, cos, sin), rotary_ref(q, k, cos, sin)):
        assert_close(out, ref)
    for out, ref in zip(qk_norm_rotary(q, k, cos, sin, qw, kw), qk_norm_rotary_ref(q, k, cos, sin, qw, kw)):
        assert_close(out, ref)
