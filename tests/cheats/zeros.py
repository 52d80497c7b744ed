# expect: wrong_output
"""Launches a kernel that writes zeros: every element written, every element wrong."""
import torch
import triton
import triton.language as tl


@triton.jit
def _zero_kernel(out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.zeros([BLOCK], tl.float32), mask=offs < n)


def entry(inputs, weights, state, static):
    x = inputs["hidden_states"]
    out = torch.empty_like(x)
    _zero_kernel[(triton.cdiv(out.numel(), 128),)](out, out.numel(), BLOCK=128)
    return {"out": out}
