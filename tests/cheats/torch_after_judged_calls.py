# expect: torch_compute
# behind_static
# options: rehearse_timing
"""Its Triton kernel does the work on its first 24 calls (every judged call before timing, counted across module
copies), then torch computes the (correct) result with operators beside a copy kernel: the timed outputs match; only
a judged call after the timed ones, its aten ops counted, sees it."""
import torch
import triton
import triton.language as tl

# kept on the triton module, so that the module copy the timing harness loads counts the same calls
if not hasattr(triton, "_llm4llm_cheat_calls"):
    triton._llm4llm_cheat_calls = [0]
_CALLS = triton._llm4llm_cheat_calls


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(out_ptr + row * n_cols + offs, (x * rstd).to(w.dtype) * w, mask=mask)


@triton.jit
def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def entry(inputs, weights, state, static):
    _CALLS[0] += 1
    x = inputs["hidden_states"].contiguous()
    n = x.shape[-1]
    out = torch.empty_like(x)
    if _CALLS[0] <= 24:
        _rmsnorm_kernel[(x.numel() // n,)](x, weights["weight"], out, n, static["variance_epsilon"],
                                           BLOCK=triton.next_power_of_2(n))
        return {"out": out}
    _copy[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    xf = out.to(torch.float32)
    ms = xf[..., 0:1] * 0.0
    for i in range(n):
        ms += xf[..., i:i + 1] * xf[..., i:i + 1]
    y = xf * (ms / n + static["variance_epsilon"]) ** -0.5
    return {"out": y.to(x.dtype) * weights["weight"]}
