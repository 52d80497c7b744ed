import pytest
import torch

from kernels_runtime.ops.neg_exp import neg_exp, neg_exp_ref
from kernels_runtime.tolerances import assert_close


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(24, 16), (7,), (3, 1100)])
@pytest.mark.parametrize("seed", [0, 1])
def test_neg_exp_matches_ref(dtype, shape, seed):
    """A = -exp(A_log) in fp32, over sizes that leave a masked tail of the 1024-wide block (and span two blocks)."""
    torch.manual_seed(seed)
    a_log = (torch.rand(shape) * 3).to(dtype)
    out = neg_exp(a_log)
    assert out.dtype == torch.float32 and out.shape == a_log.shape
    assert_close(out, neg_exp_ref(a_log), torch.float32)
    assert_close(out, (-torch.exp(a_log.double())).float(), torch.float32, name="vs float64")


def test_neg_exp_non_contiguous_input():
    a_log = torch.rand(16, 10)[:, ::2]
    assert_close(neg_exp(a_log), neg_exp_ref(a_log), torch.float32)
