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


class _NoHostRead(torch.Tensor):
    """A length tensor whose value must not reach the host."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("item", "tolist", "__int__", "__index__", "__bool__", "__float__"):
            raise AssertionError(f"the host read the device length ({func.__name__})")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("cache_len", [0, 5, 17, 39])
@pytest.mark.parametrize("num_splits", [None, 4])
def test_attention_decode_update_device_length(dtype, cache_len, num_splits):
    """The length as a device tensor (StaticLayer.cumulative_length): same result and the same in-place writes as the
    host int, with the grid sized for the whole cache (most splits past a short length are empty)."""
    q, kc, vc = _inputs(2, 4, 2, 40, 16, dtype)
    k_new, v_new = torch.randn(2, 2, 1, 16, dtype=dtype), torch.randn(2, 2, 1, 16, dtype=dtype)
    out_ref, k_ref, v_ref = attention_decode_update_ref(q, k_new, v_new, kc, vc, cache_len)
    k_mut, v_mut = kc.clone(), vc.clone()
    length = torch.tensor(cache_len)
    out = attention_decode_update(q, k_new, v_new, k_mut, v_mut, length, BLOCK_N=16, num_splits=num_splits)
    assert_close(out, out_ref, dtype)
    assert torch.equal(k_mut, k_ref) and torch.equal(v_mut, v_ref)
    assert length.item() == cache_len  # read, not advanced
    # read by the kernel only: the host never turns it into a Python number (a sync on the GPU, frozen in a graph)
    spy = torch.tensor(cache_len).as_subclass(_NoHostRead)
    out2 = attention_decode_update(q, k_new, v_new, kc.clone(), vc.clone(), spy, BLOCK_N=16, num_splits=num_splits)
    assert_close(out2, out_ref, dtype)


def test_attention_decode_update_device_length_past_the_end_writes_nothing():
    q, kc, vc = _inputs(1, 4, 2, 24, 16, torch.float32)
    k_new, v_new = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    k_mut, v_mut = kc.clone(), vc.clone()
    out = attention_decode_update(q, k_new, v_new, k_mut, v_mut, torch.tensor(24), BLOCK_N=16)
    assert torch.equal(k_mut, kc) and torch.equal(v_mut, vc)
    assert_close(out, attention_decode_ref(q, kc, vc))
    with pytest.raises(ValueError, match="one-element integer tensor"):
        attention_decode_update(q, k_new, v_new, kc, vc, torch.tensor([1.0]))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits,pads", [(3, (0, 6, 19)), (None, (13, 0, 2))])
def test_left_padded_rows_attend_only_their_own_keys(dtype, num_splits, pads):
    """HF's dynamic-cache decode mask for a left-padded batch ([B, 1, 1, S_kv], its row a strided view): each row
    matches float64 SDPA over its own keys, with pad tiles and whole pad splits (no NaN); with the fused update too
    (a device length); the unpadded row equals the causal output."""
    B, Hq, Hkv, S, D = 3, 4, 2, 33, 16
    q, k, v = _inputs(B, Hq, Hkv, S, D, dtype)
    j = torch.arange(S)
    mask = torch.stack([j >= p for p in pads])[:, None, None, :]  # [B, 1, 1, S]
    ref = attention_decode_ref(q.double(), k.double(), v.double(), 0.3, kv_mask=mask[:, 0, -1])
    out = attention_decode(q, k, v, 0.3, kv_mask=mask[:, 0, -1], BLOCK_N=8, num_splits=num_splits)
    assert torch.isfinite(out).all()
    assert_close(out, ref.to(dtype), dtype, name="vs float64")
    assert_close(out[1 if pads[1] == 0 else 0], attention_decode_ref(q, k, v, 0.3)[1 if pads[1] == 0 else 0], dtype)
    k_new, v_new = k[:, :, -1:].clone(), v[:, :, -1:].clone()
    kc, vc = k.clone(), v.clone()
    kc[:, :, -1], vc[:, :, -1] = 0, 0
    upd = attention_decode_update(q, k_new, v_new, kc, vc, torch.tensor(S - 1), 0.3, kv_mask=mask[:, 0, -1],
                                  BLOCK_N=8, num_splits=num_splits)
    assert_close(upd, ref.to(dtype), dtype, name="fused update vs float64")


def test_a_row_with_every_key_masked_gets_zeros_and_a_float_mask_is_refused():
    q, k, v = _inputs(2, 4, 2, 20, 16, torch.float32)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1] = False
    out = attention_decode(q, k, v, 0.3, kv_mask=mask, BLOCK_N=8, num_splits=3)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match=r"expected kv_mask a \[2, 20\] bool or integer"):
        attention_decode(q, k, v, kv_mask=torch.zeros(2, 20))
