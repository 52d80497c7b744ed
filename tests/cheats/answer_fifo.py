# expect: worker_crash
# behind_static
"""Correct outputs, then the worker's answer file replaced by a FIFO: it reaches `os` through Triton's own modules
(the static gate refuses that route now; this tests the parent's answer read behind it) and swaps safetensors' writer for mkfifo, so the parent,
reading the answer, would block on the FIFO forever. The parent must refuse anything but a regular file."""
import torch
import triton
import triton.language as tl

_os = triton.runtime.cache.os


@triton.jit
def _rmsnorm_kernel(
    # Pointers
    x_ptr, w_ptr, out_ptr,
    # Matrix dimensions
    n_cols, eps,
    # Meta-parameters
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = (x * rstd).to(w.dtype) * w
    tl.store(out_ptr + row * n_cols + offs, y, mask=mask)


def entry(inputs, weights, state, static):
    x = inputs["hidden_states"]  # [B, S, H]
    w = weights["weight"]  # [H]
    out = torch.empty_like(x)
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    _rmsnorm_kernel[(n_rows,)](x, w, out, n_cols, static["variance_epsilon"], BLOCK=triton.next_power_of_2(n_cols))
    _os.sys.modules["safetensors.torch"].save_file = lambda tensors, path, metadata=None: _os.mkfifo(path)
    return {"out": out}
