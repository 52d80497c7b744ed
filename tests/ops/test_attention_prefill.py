import pytest
import torch

from kernels_runtime.ops.attention_prefill import attention_prefill, attention_prefill_ref
from kernels_runtime.tolerances import assert_close

CPU_DTYPES = [torch.float32, torch.float16]


def _qkv(B, Hq, Hkv, S_q, S_kv, D, dtype, device="cpu"):
    q = torch.randn(B, Hq, S_q, D, dtype=dtype, device=device)
    k = torch.randn(B, Hkv, S_kv, D, dtype=dtype, device=device)
    v = torch.randn(B, Hkv, S_kv, D, dtype=dtype, device=device)
    return q, k, v


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(1, 4, 2, 37, 37, 16), (2, 2, 2, 19, 19, 32), (1, 4, 1, 11, 30, 16)])
@pytest.mark.parametrize("seed", [0, 1])
def test_attention_prefill_matches_ref(dtype, shape, seed):
    torch.manual_seed(seed)
    q, k, v = _qkv(*shape, dtype)
    out = attention_prefill(q, k, v, 0.3, BLOCK_M=16, BLOCK_N=16)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, attention_prefill_ref(q, k, v, 0.3), dtype)
    assert_close(out, attention_prefill_ref(q.double(), k.double(), v.double(), 0.3).to(dtype), dtype, name="vs float64")


def test_attention_prefill_strided_inputs_default_scale():
    # HF layout: projections [B, S, H, D] viewed as [B, H, S, D]
    q = torch.randn(1, 21, 4, 16).transpose(1, 2)
    k, v = torch.randn(1, 21, 2, 16).transpose(1, 2), torch.randn(1, 21, 2, 16).transpose(1, 2)
    assert_close(attention_prefill(q, k, v, BLOCK_M=16, BLOCK_N=16), attention_prefill_ref(q, k, v))


def test_attention_prefill_phase_contract():
    q, k, v = _qkv(1, 4, 2, 1, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="q_len > 1"):
        attention_prefill(q, k, v)
    q, k, v = _qkv(1, 4, 3, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="Hkv dividing"):
        attention_prefill(q, k, v)
    q, k, v = _qkv(1, 4, 2, 8, 6, 16, torch.float32)
    with pytest.raises(ValueError, match="S_kv >= S_q"):
        attention_prefill(q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 32, 8, 512, 512, 128), (2, 32, 32, 67, 67, 128), (1, 8, 2, 300, 300, 64)])
def test_attention_prefill_cuda_bf16(shape):
    q, k, v = _qkv(*shape, torch.bfloat16, "cuda")
    assert_close(attention_prefill(q, k, v), attention_prefill_ref(q, k, v))


def _hf_left_padded_mask(B, S_q, S_kv, pads):
    """HF's 4-D SDPA mask for left padding: causal (queries at the last S_q positions) AND the 2-D padding mask."""
    j = torch.arange(S_kv)
    rows = torch.arange(S_q)[:, None] + (S_kv - S_q)
    pad = torch.stack([j >= p for p in pads])  # [B, S_kv]
    return (rows >= j[None, :])[None, None] & pad[:, None, None, :]  # [B, 1, S_q, S_kv]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape,pads", [((3, 4, 2, 37, 37, 16), (0, 5, 20)), ((3, 2, 2, 9, 30, 32), (25, 0, 3))])
def test_left_padded_rows_match_sdpa_on_hf_mask(dtype, shape, pads):
    """Rows left-padded by different lengths (one not at all), the key mask the last query row of HF's 4-D mask (a
    strided view): the output equals SDPA over HF's mask in float64, the pad queries' own rows (no key to see)
    included: zeros, no NaN; a padded row differs from attending causally over the pads."""
    B, Hq, Hkv, S_q, S_kv, D = shape
    q, k, v = _qkv(*shape, dtype)
    mask4 = _hf_left_padded_mask(B, S_q, S_kv, pads)
    out = attention_prefill(q, k, v, 0.3, kv_mask=mask4[:, 0, -1], BLOCK_M=16, BLOCK_N=8)
    wide = [t.double() for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(Hq // Hkv, dim=1) for t in wide[1:])
    ref = torch.nn.functional.scaled_dot_product_attention(wide[0], kk, vv, attn_mask=mask4, scale=0.3)
    assert torch.isfinite(out).all()
    assert_close(out, ref.to(dtype), dtype, name="vs SDPA float64 on HF's mask")
    assert_close(out, attention_prefill_ref(q, k, v, 0.3, kv_mask=mask4[:, 0, -1]), dtype)
    causal = attention_prefill_ref(q, k, v, 0.3)
    for b, p in enumerate(pads):  # the unpadded row is the causal one; a padded row is far from it
        if p == 0:
            assert_close(out[b], causal[b], dtype, name=f"row {b}")
        else:
            assert (out[b].float() - causal[b].float()).abs().max() > 0.05, b


def test_attention_prefill_rejects_a_float_key_mask():
    q, k, v = _qkv(2, 4, 2, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match=r"expected kv_mask a \[2, 8\] bool or integer"):
        attention_prefill(q, k, v, kv_mask=torch.zeros(2, 8))
