# expect: compile
"""tl.arange needs a power-of-two range: the kernel does not compile (interpreted: fails on first launch)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _bad_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, 80)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs))


def entry(inputs, weights, state, static):
    x = inputs["hidden_states"]
    out = torch.empty_like(x)
    _bad_kernel[(1,)](x, out, x.numel(), BLOCK=128)
    return {"out": out}
