"""Helpers shared by the Triton ops."""
from __future__ import annotations

import os


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU test path).

    Triton's interpreter evaluates bf16 `tl.dot` wrongly (numpy has no bf16; checked with triton 3.6 and 3.9), so
    kernels take an `UPCAST_DOT: tl.constexpr` that casts dot operands to fp32 only when interpreting; on the GPU
    the dot stays in bf16/fp16 on the tensor cores.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
