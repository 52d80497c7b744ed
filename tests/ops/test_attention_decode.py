import pytest
import torch

from kernels_runtime.ops.attention_decode import (
    attention_decode,
    attention_decode_ref,
    attention_decode_update,
    attention_decode_update_ref,
)
from kernels_runtime.tolerances import assert_close

CPU_DTYPES = [torch.float32, torch.float16]


def _inputs(B, Hq, Hkv, S, D, dtype, device="cpu"):
    q = torch.randn(B, Hq, 1, D, dtype=dtype, device=device)
    kc = torch.randn(B, Hkv, S, D, dtype=dtype, device=device)
    vc = torch.randn(B, Hkv, S, D, dtype=dtype, device=device)
    return q, kc, vc


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(2, 4, 2, 37, 16), (1, 4, 4, 50, 32), (1, 6, 1, 9, 16)])
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_attention_decode_matches_ref(dtype, shape, num_splits, seed):
    torch.manual_seed(seed)
    q, kc, vc = _inputs(*shape, dtype)
    out = attention_decode(q, kc, vc, 0.25, BLOCK_N=16, num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, attention_decode_ref(q, kc, vc, 0.25), dtype)
    ref64 = attention_decode_ref(q.double(), kc.double(), vc.double(), 0.25)
    assert_close(out, ref64.to(dtype), dtype, name="vs float64")


def test_attention_decode_kv_len_prefix():
    q, kc, vc = _inputs(2, 4, 2, 40, 16, torch.float32)
    out = attention_decode(q, kc, vc, kv_len=23, BLOCK_N=16)
    assert_close(out, attention_decode_ref(q, kc, vc, kv_len=23))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("cache_len", [0, 17, 39])
def test_attention_decode_update_writes_cache(dtype, cache_len):
    q, kc, vc = _inputs(2, 4, 2, 40, 16, dtype)
    k_new, v_new = torch.randn(2, 2, 1, 16, dtype=dtype), torch.randn(2, 2, 1, 16, dtype=dtype)
    out_ref, k_ref, v_ref = attention_decode_update_ref(q, k_new, v_new, kc, vc, cache_len)
    k_mut, v_mut = kc.clone(), vc.clone()
    out = attention_decode_update(q, k_new, v_new, k_mut, v_mut, cache_len, BLOCK_N=16, num_splits=2)
    assert_close(out, out_ref, dtype)
    assert torch.equal(k_mut, k_ref) and torch.equal(v_mut, v_ref)


def test_attention_decode_phase_contract():
    q, kc, vc = _inputs(1, 4, 2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="q_len == 1"):
        attention_decode(q.expand(1, 4, 2, 16), kc, vc)
    with pytest.raises(ValueError, match="kv_len"):
        attention_decode(q, kc, vc, kv_len=9)
    with pytest.raises(ValueError, match="cache_len"):
        attention_decode_update(q, kc[:, :, :1], vc[:, :, :1], kc, vc, 8)
    with pytest.raises(ValueError, match="k_new"):
        attention_decode_update(q, kc[:, :1, :1], vc[:, :, :1], kc, vc, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 32, 8, 576, 128), (4, 32, 32, 513, 128), (2, 8, 2, 1000, 64)])
def test_attention_decode_cuda_bf16(shape):
    q, kc, vc = _inputs(*shape, torch.bfloat16, "cuda")
    assert_close(attention_decode(q, kc, vc), attention_decode_ref(q, kc, vc))
    k_new, v_new = torch.randn_like(kc[:, :, :1]), torch.randn_like(vc[:, :, :1])
    out_ref, k_ref, v_ref = attention_decode_update_ref(q, k_new, v_new, kc, vc, shape[3] - 1)
    assert_close(attention_decode_update(q, k_new, v_new, kc, vc, shape[3] - 1), out_ref)
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)
