import pytest
import torch

from kernels_runtime.ops.layernorm import layernorm, layernorm_ref
from kernels_runtime.tolerances import assert_close

CPU_DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(3, 80), (2, 5, 200), (1, 37)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_layernorm_matches_torch(dtype, shape, bias, rows, seed):
    """Against torch.nn.LayerNorm itself and a float64 reference; odd widths and a masked row tail."""
    torch.manual_seed(seed)
    n = shape[-1]
    x = torch.randn(shape, dtype=dtype) * 3 + 1
    ln = torch.nn.LayerNorm(n, eps=1e-5, bias=bias).to(dtype)
    with torch.no_grad():
        ln.weight.copy_(torch.randn(n))
        if bias:
            ln.bias.copy_(torch.randn(n))
        want = ln(x)
    x0 = x.clone()
    out = layernorm(x, ln.weight, ln.bias, 1e-5, rows=rows, num_warps=2)
    assert out.shape == x.shape and out.dtype == dtype and torch.equal(x, x0)
    assert_close(out, want, dtype)
    b64 = ln.bias.double() if bias else None
    assert_close(out, layernorm_ref(x.double(), ln.weight.double(), b64, 1e-5).to(dtype), dtype, name="vs float64")


def test_layernorm_strided_rows():
    x = torch.randn(5, 160, dtype=torch.float32)[:, :80]  # row stride 160
    w, b = torch.randn(80), torch.randn(80)
    assert_close(layernorm(x, w, b, rows=2), layernorm_ref(x, w, b), torch.float32)


def test_layernorm_rejects_a_bad_weight():
    with pytest.raises(ValueError, match="expected weight of shape"):
        layernorm(torch.randn(2, 80), torch.randn(64))
