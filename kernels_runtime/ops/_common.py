"""Helpers shared by the Triton ops."""
from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import triton
import triton.language as tl

# torch dtype -> Triton dtype, for the ops' dtype constexprs
_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU test path).

    Triton's interpreter evaluates bf16 `tl.dot` wrongly (numpy has no bf16; checked with triton 3.6 and 3.9), so
    kernels take an `UPCAST_DOT: tl.constexpr` that casts dot operands to fp32 only when interpreting; on the GPU
    the dot stays in bf16/fp16 on the tensor cores. The interpreter also truncates fp32 -> bf16 casts instead of
    rounding to nearest-even, so kernels whose bf16 outputs feed an ill-conditioned chain (a Mamba mixer) store
    through `cast_out(x, dtype, RNE=interpreting())`.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def rnd(x, DTYPE: tl.constexpr):
    # fp32 x rounded to DTYPE and back (a no-op for fp32): reproduces a rounding HF's torch path does. bf16 is
    # rounded to nearest-even by hand because Triton's interpreter truncates fp32 -> bf16 casts (NaN/Inf not handled).
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def cast_out(x, DTYPE: tl.constexpr, RNE: tl.constexpr):
    # fp32 x cast to an output dtype; RNE (pass interpreting()) rounds bf16 to nearest-even first, as the GPU does
    if RNE:
        x = rnd(x, DTYPE)
    return x.to(DTYPE)


def interpret_without_gpu() -> None:
    """Make Triton run under its interpreter when this process has no GPU (must run before triton compiles
    anything). The CLI, the acceptance/evaluation subprocess and the CPU verifier worker all call this."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


# ----------------------------------------------------------------------------------------------------------------
# Cached launches: bind the compiled kernel once per specialization, then call its launcher directly.
#
# `jit_fn[grid](...)` runs Triton's binder, cache-key computation and global-value checks on every call (19.5 us a
# launch on the H200 host, 2026-11-30, against 9.9 us for a torch op); a decode step issues hundreds. `launch` keys
# the compiled kernel by what Triton specializes on (tensor dtypes and 16-byte alignment, ints equal to 1 or
# divisible by 16 and their width, the constexprs and launch options) and calls `CompiledKernel.run` with every
# signature argument in order, as `JITFunction.run` does (Triton 3.6-3.9). The first call of a key, the interpreter,
# or LLM4LLM_CACHED_LAUNCH=0 take Triton's own path.

_LAUNCHERS: dict[tuple, Any] = {}
_CACHED_LAUNCH = {"on": os.environ.get("LLM4LLM_CACHED_LAUNCH", "1") != "0"}


def _spec_of(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return a == 1, a % 16 == 0, -2**31 <= a < 2**31
    if isinstance(a, float):
        return float
    return type(a), a


def _param_defaults(jit_fn) -> list[tuple[str, Any]]:
    out = []
    for p in jit_fn.signature.parameters.values():
        out.append((p.name, p.default))
    return out


def launch(jit_fn, grid: tuple, args: tuple, constexprs: dict, **options):
    """jit_fn[grid](*args, **constexprs, **options), through the cached compiled kernel after the first call."""
    if not _CACHED_LAUNCH["on"] or interpreting() or not (isinstance(args[0], torch.Tensor) and args[0].is_cuda):
        return jit_fn[grid](*args, **constexprs, **options)  # (off the GPU: the sm_90 compile check records launches)
    from triton import knobs

    key = (jit_fn, tuple(_spec_of(a) for a in args), tuple(constexprs.items()), tuple(options.items()),
           torch.cuda.current_device())
    hit = _LAUNCHERS.get(key)
    if hit is None:
        kernel = jit_fn[grid](*args, **constexprs, **options)
        if kernel is not None and hasattr(kernel, "result"):
            kernel = kernel.result()
        params = _param_defaults(jit_fn)
        names = [n for n, _ in params]
        tail = [constexprs[n] if n in constexprs else d for n, d in params[len(args):]]
        if kernel is not None and len(names) == len(args) + len(tail) and all(
                n in constexprs or d is not inspect.Parameter.empty for (n, d) in params[len(args):]):
            _LAUNCHERS[key] = (kernel, tuple(tail))
        return kernel
    kernel, tail = hit
    g = tuple(grid) + (1, 1)
    stream = torch.cuda.current_stream().cuda_stream
    rt = knobs.runtime  # the hooks and launch metadata exactly as JITFunction.run passes them
    try:
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *args, *tail), rt.launch_enter_hook, rt.launch_exit_hook,
                   *args, *tail)
    except TypeError:  # another Triton's launcher convention: its own path from now on
        _CACHED_LAUNCH["on"] = False
        return jit_fn[grid](*args, **constexprs, **options)
    return kernel
