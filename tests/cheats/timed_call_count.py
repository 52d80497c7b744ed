# expect: timed_output_mismatch
# options: rehearse_timing
"""A time bomb set past the judged calls: correct for the first 24 calls of its module (the correctness gates make
at most (1 + 5 + 3) draws x 2 cases + the first call), then it computes only the first row: timing would see
a kernel doing a fraction of the work."""
import torch
import triton
import triton.language as tl

_CALLS = [0]


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(out_ptr + row * n_cols + offs, (x * rstd).to(w.dtype) * w, mask=mask)


def entry(inputs, weights, state, static):
    _CALLS[0] += 1
    x = inputs["hidden_states"]
    n = x.shape[-1]
    out = torch.zeros_like(x)
    rows = x.numel() // n if _CALLS[0] <= 24 else 1
    _rmsnorm_kernel[(rows,)](x, weights["weight"], out, n, static["variance_epsilon"], BLOCK=128)
    return {"out": out}
