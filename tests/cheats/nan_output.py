# expect: nan_inf
"""Writes every element, but divides by zero on the way."""
import torch
import triton
import triton.language as tl


@triton.jit
def _bad_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, x / (x - x), mask=offs < n)


def entry(inputs, weights, state, static):
    x = inputs["hidden_states"]
    out = torch.empty_like(x)
    _bad_kernel[(triton.cdiv(x.numel(), 128),)](x, out, x.numel(), BLOCK=128)
    return {"out": out}
