# expect: timed_output_mismatch
# options: rehearse_timing
"""Tells the judged calls from the timed ones by the input's memory, not by counting: the judge hands out views
into larger (canary) buffers, so an input that owns its whole storage is taken for a timed call, and the kernel
skips the work, leaving its output unwritten."""
import torch
import triton
import triton.language as tl


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
    n = x.shape[-1]
    plain = x.untyped_storage().nbytes() == x.numel() * x.element_size()
    out = torch.empty_like(x)
    _rmsnorm_kernel[(1 if plain else x.numel() // n,)](x, weights["weight"], out, n, static["variance_epsilon"],
                                                        BLOCK=128)
    return {"out": out}
