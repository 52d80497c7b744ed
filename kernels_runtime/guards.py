"""Guards: tiny pure predicates deciding whether a patched kernel may take a call.

Each check returns (ok, reason); the reason says what was expected and what was got, and is the key under which
a fallback is counted. They read only `.dtype`, `.shape`, `.device` and `.is_contiguous()` of the call's tensors, so
they are unit-tested on the CPU with fakes. Dispatch calls them on every call: keep them cheap.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from kernels_runtime.bundle import Guard

OK: tuple[bool, str] = (True, "")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _is_floating(t: Any) -> bool:
    fp = getattr(t, "is_floating_point", None)
    return bool(fp()) if callable(fp) else _dtype_name(getattr(t, "dtype", "")).startswith(("float", "bfloat"))


def _is_tensor_like(t: Any) -> bool:
    return hasattr(t, "shape") and hasattr(t, "dtype")


def check_dtype(allowed: Sequence[str], inputs: Mapping[str, Any]) -> tuple[bool, str]:
    """Every floating-point input has a dtype in `allowed` (empty: any)."""
    if not allowed:
        return OK
    for name, t in inputs.items():
        if _is_tensor_like(t) and _is_floating(t) and _dtype_name(t.dtype) not in allowed:
            return False, f"dtype: expected {'|'.join(allowed)}, got {_dtype_name(t.dtype)} ({name})"
    return OK


def check_device(allowed: Sequence[str], device_type: str) -> tuple[bool, str]:
    if allowed and device_type not in allowed:
        return False, f"device: expected {'|'.join(allowed)}, got {device_type}"
    return OK


def check_capability(minimum: tuple[int, int] | None, device_type: str, capability: tuple[int, int] | None) -> tuple[bool, str]:
    """Only meaningful on cuda; a minimum on another device type rejects (the kernel was tuned for a GPU)."""
    if minimum is None:
        return OK
    if device_type != "cuda" or capability is None:
        return False, f"capability: expected cuda >= {minimum[0]}.{minimum[1]}, got {device_type}"
    if tuple(capability) < tuple(minimum):
        return False, f"capability: expected >= {minimum[0]}.{minimum[1]}, got {capability[0]}.{capability[1]}"
    return OK


def dim_ok(spec: Any, size: int) -> bool:
    """spec: an exact size, None (any), or an inclusive range [lo, hi] with hi None for unbounded."""
    if spec is None:
        return True
    if isinstance(spec, int):
        return size == spec
    lo, hi = spec
    return size >= lo and (hi is None or size <= hi)


def _fmt_dim(spec: Any) -> str:
    if spec is None:
        return "*"
    if isinstance(spec, int):
        return str(spec)
    lo, hi = spec
    return f"{lo}..{'' if hi is None else hi}"


def check_shape(name: str, spec: Sequence[Any], shape: Sequence[int]) -> tuple[bool, str]:
    if len(shape) != len(spec) or not all(dim_ok(s, n) for s, n in zip(spec, shape)):
        want = "[" + ", ".join(_fmt_dim(s) for s in spec) + "]"
        return False, f"shape {name}: expected {want}, got {list(shape)}"
    return OK


def missing_input(name: str) -> str:
    return f"shape {name}: expected an input named {name}, got none"


def check_shapes(specs: Mapping[str, Sequence[Any]], inputs: Mapping[str, Any],
                 optional: Sequence[str] = ()) -> tuple[bool, str]:
    """Every input of `specs` has its dims; one named in `optional` may be absent (passed as None)."""
    for name, spec in specs.items():
        t = inputs.get(name)
        if t is None:
            if name in optional:
                continue
            return False, missing_input(name)
        ok, reason = check_shape(name, spec, tuple(t.shape))
        if not ok:
            return ok, reason
    return OK


def check_signatures(signatures: Sequence[Mapping[str, Sequence[int]]], inputs: Mapping[str, Any],
                     optional: Sequence[str] = ()) -> tuple[bool, str]:
    """The call's shapes equal one verified joint signature (empty: not checked), the optional inputs it passes
    included (a signature verified without one admits no call with it)."""
    if not signatures:
        return OK
    given = [n for n in optional if inputs.get(n) is not None]
    for sig in signatures:
        if all(n in inputs and tuple(inputs[n].shape) == tuple(shape) for n, shape in sig.items()) \
                and all(n in sig for n in given):
            return OK
    got = {n: list(inputs[n].shape) for n in signatures[0] if n in inputs}
    return False, f"signature: expected one of the {len(signatures)} verified shape signatures, got {got}"


def check_contiguous(names: Sequence[str], inputs: Mapping[str, Any]) -> tuple[bool, str]:
    for name in names:
        t = inputs.get(name)
        if t is not None and not t.is_contiguous():
            return False, f"contiguity {name}: expected contiguous, got strides {tuple(t.stride())}"
    return OK


def check_batch(buckets: Sequence[int], inputs: Mapping[str, Any]) -> tuple[bool, str]:
    """The call's batch (dim 0 of its first tensor input) is one of the verified buckets (empty: not checked)."""
    if not buckets:
        return OK
    t = next((t for t in inputs.values() if _is_tensor_like(t) and len(t.shape)), None)
    if t is None or t.shape[0] in buckets:
        return OK
    pad = min((b for b in buckets if b >= t.shape[0]), default=None)
    hint = f" (pad to {pad})" if pad is not None else ""
    return False, f"batch: expected one of the verified buckets {list(buckets)}, got {t.shape[0]}{hint}"


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    import torch

    return tuple(torch.cuda.get_device_capability(index))


def first_device(inputs: Mapping[str, Any]) -> Any:
    for t in inputs.values():
        device = getattr(t, "device", None)
        if device is not None:
            return device
    return None


def capability_of(device: Any) -> tuple[int, int] | None:
    """Compute capability of a cuda device (cached per index), None for any other device."""
    if getattr(device, "type", None) != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else 0)


def is_supported(guard: Guard, call: Any) -> tuple[bool, str]:
    """May a kernel guarded by `guard` take `call`? `call` is a BoundaryCall (or anything with `.inputs`), or the
    inputs mapping itself. A fake may carry `device_type` / `capability` attributes to stand in for the hardware."""
    inputs = call if isinstance(call, Mapping) else call.inputs
    device = first_device(inputs)
    device_type = getattr(call, "device_type", None) or getattr(device, "type", None) or "none"

    def capability():
        return call.capability if hasattr(call, "capability") else capability_of(device)

    checks = (
        lambda: check_device(guard.device_types, device_type),
        lambda: check_capability(guard.min_capability, device_type, capability()) if guard.min_capability else OK,
        lambda: check_dtype(guard.dtypes, inputs),
        lambda: check_shapes(guard.shapes, inputs, guard.optional),
        lambda: check_signatures(guard.signatures, inputs, guard.optional),
        lambda: check_batch(guard.batch_buckets, inputs),
        lambda: check_contiguous(guard.contiguous, inputs),
    )
    for check in checks:
        ok, reason = check()
        if not ok:
            return ok, reason
    return OK


__all__ = [
    "check_batch", "check_capability", "check_contiguous", "check_signatures", "check_device", "check_dtype",
    "check_shape", "check_shapes",
    "capability_of", "dim_ok", "first_device", "is_supported",
]
