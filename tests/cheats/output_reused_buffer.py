# expect: output_aliased
"""Correct values, but one module-level output buffer per shape, returned on every call: a caller that still holds
the previous result (a residual, a cache) sees it overwritten by the next call."""
import torch
import triton
import triton.language as tl

_OUT = {}


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
    x = inputs["hidden_states"]
    key = (tuple(x.shape), x.dtype)
    if key not in _OUT:
        _OUT[key] = torch.empty_like(x)
    out = _OUT[key]
    n = x.shape[-1]
    _rmsnorm_kernel[(x.numel() // n,)](x, weights["weight"], out, n, static["variance_epsilon"],
                                       BLOCK=triton.next_power_of_2(n))
    return {"out": out}
