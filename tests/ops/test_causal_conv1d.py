import pytest
import torch

from kernels_runtime.ops.causal_conv1d import (
    causal_conv1d,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)
from kernels_runtime.tolerances import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(B, C, L, K, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, L, generator=g).to(dtype)
    w = (torch.randn(C, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(C, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,C,L,K,S", [(2, 40, 37, 4, 4), (1, 33, 3, 4, 4), (2, 40, 37, 4, 3), (1, 24, 2, 4, 3)])
@pytest.mark.parametrize("silu,bias", [(True, True), (False, False)])
@pytest.mark.parametrize("seed", [0, 1])
def test_causal_conv1d_prefill(dtype, B, C, L, K, S, silu, bias, seed):
    x, w, b = _inputs(B, C, L, K, dtype, seed, bias)
    y_ref, s_ref = causal_conv1d_ref(x, w, b, silu, state_len=S)
    y, s = causal_conv1d(x, w, b, silu, state_len=S, BLOCK_C=16, BLOCK_L=16)
    assert_close(y, y_ref, name="y")
    assert torch.equal(s, s_ref), "conv state: expected the last S inputs"


def test_causal_conv1d_strided_input():
    # HF passes a transposed view of the in_proj output: [B, L, 2C] -> [B, C, L]
    xz = torch.randn(2, 37, 80)
    x = xz.transpose(1, 2)[:, :40]
    w, b = torch.randn(40, 4), torch.randn(40)
    y_ref, s_ref = causal_conv1d_ref(x, w, b, True)
    y, s = causal_conv1d(x, w, b, True)
    assert_close(y, y_ref)
    assert torch.equal(s, s_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S", [4, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_causal_conv1d_update_matches_prefill(dtype, S, seed):
    B, C, L, K = 2, 40, 9, 4
    x, w, b = _inputs(B, C, L + 1, K, dtype, seed)
    y_full, s_full = causal_conv1d_ref(x, w, b, True, state_len=S)
    _, state = causal_conv1d(x[:, :, :L], w, b, True, state_len=S)
    state_ref = state.clone()
    y_ref = causal_conv1d_update_ref(x[:, :, L], state_ref, w, b, True)
    y = causal_conv1d_update(x[:, :, L], state, w, b, True, BLOCK_C=16)
    assert_close(y, y_ref, name="y")
    assert_close(y, y_full[:, :, L], name="decode vs prefill")
    assert torch.equal(state, state_ref), "conv state after update"
    assert torch.equal(state, s_full), "conv state vs prefill over L+1"


def test_causal_conv1d_rejects_bad_weight():
    with pytest.raises(ValueError, match="expected weight"):
        causal_conv1d(torch.randn(1, 8, 5), torch.randn(7, 4))
