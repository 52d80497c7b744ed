# expect: static
"""A correct kernel that also replaces torch.cuda.Event, which the timing harness in its process measures with, by
an event reporting 0.1 us for every interval: on a GPU every timed latency would be forged. (On the CPU nothing is
timed, so only the static gate can show it; the module-level rebinding is what it refuses.)"""
import torch
import triton
import triton.language as tl


class _FastEvent:
    def __init__(self, *args, **kwargs):
        self.t = 0.0

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 1e-4


torch.cuda.Event = _FastEvent


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
    out = torch.empty_like(x)
    n = x.shape[-1]
    _rmsnorm_kernel[(x.numel() // n,)](x, weights["weight"], out, n, static["variance_epsilon"],
                                       BLOCK=triton.next_power_of_2(n))
    return {"out": out}
