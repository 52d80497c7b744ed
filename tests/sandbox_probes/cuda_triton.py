"""Run inside the sandbox on a GPU: CUDA initialises, a Triton kernel compiles (its cache and launcher in the
private dir) and runs, and its result is right."""
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _add(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1.0, mask=m)


x = torch.randn(4096, device="cuda")
y = torch.empty_like(x)
_add[(4,)](x, y, 4096, BLOCK=1024)
torch.cuda.synchronize()
print(json.dumps({"cuda": torch.cuda.get_device_name(0), "ok": bool(torch.equal(y, x + 1.0))}))
