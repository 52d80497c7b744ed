# expect: worker_crash gpu_fault
"""Stores far outside any allocation: the process dies (SIGSEGV on the CPU, illegal address on the GPU)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _wild_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK).to(tl.int64)
    tl.store(out_ptr + offs * (1 << 38), tl.load(x_ptr + offs, mask=offs < n, other=0.0))


def entry(inputs, weights, state, static):
    x = inputs["hidden_states"]
    out = torch.empty_like(x)
    _wild_kernel[(1,)](x, out, x.numel(), BLOCK=128)
    return {"out": out}
