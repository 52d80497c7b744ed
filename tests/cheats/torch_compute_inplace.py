# expect: torch_compute
"""Launches a real kernel that copies the input, then finishes the result with in-place torch operators on the
copy (augmented assignment, invisible to the static gate)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def entry(inputs, weights, state, static):
    x = inputs["hidden_states"].contiguous()
    y = torch.empty_like(x)
    _copy[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    sq = y * y
    ms = sq[..., 0:1] * 0.0
    for i in range(x.shape[-1]):
        ms += sq[..., i:i + 1]
    ms /= x.shape[-1]
    ms += static["variance_epsilon"]
    y *= ms ** -0.5
    y *= weights["weight"]
    return {"out": y}
