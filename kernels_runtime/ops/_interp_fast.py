"""Two pure-speed fixes to Triton's interpreter (the CPU path; on the GPU neither code path runs).

1. `tl.associative_scan`: the same combine, one step along the scan axis at a time over whole slices, instead of
one element at a time.

Triton's interpreter (`ScanOps.generic_scan`, triton 3.6-3.9) falls back, for any combine function other than sum
and product, to a Python loop over every element of the block: per element it wraps numpy scalars as Triton tensors
and calls the combine on them. A scan combine is elementwise (Triton calls it on scalars), so calling it once per
position along the axis on the whole slice of the other axes computes every element with the same numpy operations
in the same order: the same bits, far fewer Python calls. Only the interpreter calls `generic_scan`; on the GPU the
scan is compiled and this changes nothing. Mamba's prefill scan (`selective_scan`) spent most of its interpreted
time in that loop (`tests/test_interp_fast.py` checks the two against each other bit for bit).

2. Device-function calls inside a launch: the interpreter's `InterpretedFunction.__call__` patches `triton.language`
again (`_patch_lang`: `inspect.getmembers` over tl, tl.tensor and tl.math, about 1 ms) on every call of a
`@triton.jit` helper from a kernel, and drops the patch scope without restoring it. The launch (`GridExecutor`) has
already patched the same modules for its whole duration, and the repeat sets the same (stateless) replacements, so
it changes nothing: a helper whose `triton.language` modules are patched already in the running launch (by the
launch, or by an earlier helper's never-restored patch) is called without it. A helper called outside a launch, or
the first to see a module not patched yet, takes the interpreter's own path.

Nothing here runs on import: `kernels_runtime.interp.enable_fast_interpreter()` installs the fixes on request.
"""
from __future__ import annotations

import threading

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


_STATE = threading.local()  # .pending: the launch's kernel fn before its patch; .active: the modules it patched


def _langs(fn) -> frozenset:
    """ids of the triton.language modules `_patch_lang(fn)` patches (those in fn's globals)."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


class _Restoring:
    """The launch's patch scope: restoring it also ends the launch's patched state."""

    def __init__(self, scope):
        self.scope = scope

    def restore(self) -> None:
        try:
            self.scope.restore()
        finally:
            _STATE.active = None


def patch_lang_once(fn):
    """`_patch_lang`, skipped for a device function whose modules the running launch already patched."""
    from triton.runtime import interpreter

    if getattr(_STATE, "pending", None) is fn:  # the launch's own patch (GridExecutor.__call__)
        _STATE.pending = None
        scope = _ORIGINAL["patch_lang"](fn)
        _STATE.active = _langs(fn)
        return _Restoring(scope)
    active = getattr(_STATE, "active", None)
    if active is None:
        return _ORIGINAL["patch_lang"](fn)
    langs = _langs(fn)
    if langs and langs <= active:
        return interpreter._LangPatchScope()  # nothing to set: the launch's patch is in place
    scope = _ORIGINAL["patch_lang"](fn)
    # the interpreter never restores a device function's patch: its modules (tl.core for triton.language's own
    # helpers) stay patched for the rest of the launch, as the repeats would leave them
    _STATE.active = active | langs
    return scope


def launch_call(self, *args, **kwargs):
    """GridExecutor.__call__, telling `patch_lang_once` which fn the launch patches."""
    _STATE.pending, _STATE.active = self.fn, None
    try:
        return _ORIGINAL["grid_call"](self, *args, **kwargs)
    finally:
        _STATE.pending, _STATE.active = None, None


def installed() -> bool:
    """Whether `install` has patched this process's interpreter."""
    return "generic_scan" in _ORIGINAL


def install() -> bool:
    """Both fixes (once per process); False where this Triton's interpreter lacks what they replace."""
    try:
        from triton.runtime import interpreter
        from triton.runtime.interpreter import GridExecutor, ScanOps
    except ImportError:
        return False
    if "generic_scan" in _ORIGINAL:
        return True
    if not callable(getattr(ScanOps, "generic_scan", None)) or not hasattr(ScanOps, "to_tensor") or \
            not callable(getattr(interpreter, "_patch_lang", None)) or \
            not hasattr(interpreter, "_LangPatchScope") or not callable(getattr(GridExecutor, "__call__", None)):
        return False
    _ORIGINAL["generic_scan"] = ScanOps.generic_scan
    ScanOps.generic_scan = sliced_generic_scan
    _ORIGINAL["patch_lang"] = interpreter._patch_lang
    interpreter._patch_lang = patch_lang_once
    _ORIGINAL["grid_call"] = GridExecutor.__call__
    GridExecutor.__call__ = launch_call
    return True
