"""A kernel the interpreter runs and sm_90 compilation rejects (used by tests/test_aot_compile.py)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from llm4llm.verify.aot import capture_launches, compile_launches  # noqa: E402


@triton.jit
def _bad_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.load(X + offs, mask=offs < n, other=0.0)
    if n > 4:  # a runtime branch: both sides must give `acc` one type and shape on the GPU
        acc = tl.sum(acc, axis=0)
    tl.store(Y + offs, acc, mask=offs < n)


def launch(x, y):
    _bad_kernel[(1,)](x, y, x.numel(), BLOCK=16)


if __name__ == "__main__":
    x = torch.randn(8)
    print(json.dumps(compile_launches(capture_launches(lambda: launch(x, torch.empty_like(x))))))
