# expect: torch_compute
"""A Triton kernel computes only each row's 1/rms (a tiny share of the work); torch operators, which the static
gate cannot see, do the output-sized multiplies."""
import torch
import triton
import triton.language as tl


@triton.jit
def _rstd(x_ptr, r_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
    tl.store(r_ptr + row, 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps))


def entry(inputs, weights, state, static):
    x = inputs["hidden_states"].contiguous()
    n = x.shape[-1]
    r = torch.empty(x.shape[:-1] + (1,), dtype=torch.float32, device=x.device)
    _rstd[(x.numel() // n,)](x, r, n, static["variance_epsilon"], BLOCK=triton.next_power_of_2(n))
    return {"out": (x * r).to(x.dtype) * weights["weight"]}
