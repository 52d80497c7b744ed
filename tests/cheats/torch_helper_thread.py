# expect: torch_compute static
"""Launches a copy kernel on the calling thread and has a helper thread (reached through torch.cuda's own
`threading` import) compute the result with torch operators: a dispatch mode on the calling thread alone sees
nothing. The static gate refuses the route to `threading`; the worker counts every thread's aten ops anyway."""
import torch
import triton
import triton.language as tl


@triton.jit
def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def _work(x, w, eps, box):
    xf = x.to(torch.float32)
    n = x.shape[-1]
    ms = xf[..., 0:1] * 0.0
    for i in range(n):
        ms += xf[..., i:i + 1] * xf[..., i:i + 1]
    box.append(((xf * (ms / n + eps) ** -0.5).to(x.dtype) * w))


def entry(inputs, weights, state, static):
    x = inputs["hidden_states"].contiguous()
    y = torch.empty_like(x)
    _copy[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    box = []
    t = torch.cuda.threading.Thread(target=_work, args=(x, weights["weight"], static["variance_epsilon"], box))
    t.start()
    t.join()
    y.copy_(box[0])
    return {"out": y}
