# expect: timeout
# timeout_s: 3
"""Launches a kernel, then never returns."""
import torch
import triton
import triton.language as tl


@triton.jit
def _copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def entry(inputs, weights, state, static):
    x = inputs["hidden_states"]
    out = torch.empty_like(x)
    _copy_kernel[(triton.cdiv(x.numel(), 128),)](x, out, x.numel(), BLOCK=128)
    while True:
        pass
