"""A faster `tl.associative_scan` for Triton's interpreter (the CPU path): the same combine, one step along the scan
axis at a time over whole slices, instead of one element at a time.

Triton's interpreter (`ScanOps.generic_scan`, triton 3.6-3.9) falls back, for any combine function other than sum
and product, to a Python loop over every element of the block: per element it wraps numpy scalars as Triton tensors
and calls the combine on them. A scan combine is elementwise (Triton calls it on scalars), so calling it once per
position along the axis on the whole slice of the other axes computes every element with the same numpy operations
in the same order: the same bits, far fewer Python calls. Only the interpreter calls `generic_scan`; on the GPU the
scan is compiled and this changes nothing. Mamba's prefill scan (`selective_scan`) spent most of its interpreted
time in that loop (`tests/test_interp_scan.py` checks the two against each other bit for bit).
"""
from __future__ import annotations

import numpy as np

_ORIGINAL: dict = {}


def sliced_generic_scan(self, input):
    """`ScanOps.generic_scan` computed a slice along the scan axis at a time (same inputs, outputs and dtypes)."""
    import triton.language as tl

    data = [arg.handle.data for arg in input]
    shape = data[0].shape
    axis = self.axis
    out = [np.zeros(shape, dtype=d.dtype) for d in data]
    if data[0].size == 0 or len(shape) == 0:
        return _ORIGINAL["generic_scan"](self, input)

    def at(i: int) -> tuple:
        return tuple(i if a == axis else slice(None) for a in range(len(shape)))

    for j in range(len(out)):  # the first position along the axis: the input itself
        out[j][at(0)] = data[j][at(0)]
    for i in range(1, shape[axis]):
        acc = tuple(self.to_tensor(np.ascontiguousarray(o[at(i - 1)]), input[k].dtype) for k, o in enumerate(out))
        cur = tuple(self.to_tensor(np.ascontiguousarray(d[at(i)]), input[k].dtype) for k, d in enumerate(data))
        ret = self.combine_fn.fn(*acc, *cur)
        ret = ret if isinstance(ret, tuple) else (ret,)
        for j in range(len(out)):
            got = ret[j].handle.data if isinstance(ret[j], tl.core.tensor) else ret[j]
            # as the element loop's `.item()`: the value cast to the output's dtype, in the slice's shape
            out[j][at(i)] = got if len(shape) > 1 else np.asarray(got).reshape(())
    return [self.to_tensor(d, input[k].dtype) for k, d in enumerate(out)]


def install() -> bool:
    """Replace the interpreter's element-at-a-time scan (once per process); False where this Triton has none."""
    try:
        from triton.runtime.interpreter import ScanOps
    except ImportError:
        return False
    if "generic_scan" in _ORIGINAL:
        return True
    if not callable(getattr(ScanOps, "generic_scan", None)) or not hasattr(ScanOps, "to_tensor"):
        return False
    _ORIGINAL["generic_scan"] = ScanOps.generic_scan
    ScanOps.generic_scan = sliced_generic_scan
    return True
