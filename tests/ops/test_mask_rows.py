import pytest
import torch

from kernels_runtime.ops.mask_rows import mask_rows, mask_rows_ref

CPU_DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(2, 19, 70), (3, 1, 33)])
@pytest.mark.parametrize("seed", [0, 1])
def test_mask_rows_channels_last_is_exact(dtype, shape, seed):
    """[B, L, C] with a 0/1 mask over (B, L): padded positions zeroed, the rest bit-exact; x untouched."""
    torch.manual_seed(seed)
    x = torch.randn(shape, dtype=dtype)
    mask = (torch.rand(shape[:2]) > 0.3).to(torch.int64)
    x0 = x.clone()
    out = mask_rows(x, mask)
    assert out.dtype == dtype and out.shape == x.shape and torch.equal(x, x0)
    assert torch.equal(out, mask_rows_ref(x, mask))
    assert torch.equal(out, (x.double() * mask[:, :, None]).to(dtype))


@pytest.mark.parametrize("seed", [0, 1])
def test_mask_rows_channels_first_view_keeps_its_layout(seed):
    """x a [B, C, L] transposed view of a [B, L, C] tensor (the conv's output layout): the copy has x's layout."""
    torch.manual_seed(seed)
    x = torch.randn(2, 21, 40).transpose(1, 2)  # [B, C=40, L=21], strides of a [B, L, C] tensor
    mask = (torch.rand(2, 21) > 0.5).to(torch.int64)
    out = mask_rows(x, mask, channels_last=False)
    assert out.shape == x.shape
    assert torch.equal(out, mask_rows_ref(x, mask, channels_last=False))


def test_mask_rows_without_a_mask_returns_x():
    x = torch.randn(2, 3, 4)
    assert mask_rows(x, None) is x
