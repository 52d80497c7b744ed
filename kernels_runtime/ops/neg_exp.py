"""A = -exp(A_log) in fp32: the SSM ops that take A, not A_log (HF's `-torch.exp(self.A_log.float())`)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _neg_exp_kernel(
    # Pointers
    X, Y,
    # Matrix dimensions
    n,
    # Meta-parameters
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(Y + offs, -tl.exp(x), mask=offs < n)


def neg_exp_ref(a_log: torch.Tensor) -> torch.Tensor:
    """a_log: any shape -> -exp(a_log) in fp32, same shape."""
    return -torch.exp(a_log.float())


def neg_exp(a_log: torch.Tensor, *, BLOCK: int = 1024) -> torch.Tensor:
    """a_log: any shape -> -exp(a_log) in fp32, same shape (contiguous)."""
    a = torch.empty(a_log.shape, dtype=torch.float32, device=a_log.device)
    _neg_exp_kernel[(triton.cdiv(a_log.numel(), BLOCK),)](a_log.contiguous(), a, a_log.numel(), BLOCK=BLOCK)
    return a


__all__ = ["neg_exp", "neg_exp_ref"]
