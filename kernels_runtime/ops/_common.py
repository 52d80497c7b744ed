"""Helpers shared by the Triton ops."""
from __future__ import annotations

import os

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
