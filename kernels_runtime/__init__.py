"""Runtime half of llm4llm: Triton ops, the shared tolerance table, the phase predicate, call-boundary adapters
and patch bundles. Imports without Prefect, DuckDB or litellm.

A user's serving code adopts a bundle with one call:

    import kernels_runtime
    report = kernels_runtime.apply(model, "path/to/bundle")   # PatchReport; print(report), report.counters()
    kernels_runtime.revert(model)
    kernels_runtime.enable_decode_graphs(model)                # decode steps replayed from CUDA graphs

Names are imported on first use, so `import kernels_runtime` stays light; importing it (or any op) patches nothing
outside it: Triton's interpreter gets kernels_runtime's speed-ups only through
`kernels_runtime.enable_fast_interpreter()` (kernels_runtime/interp.py).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "apply": "patch", "revert": "patch", "report_of": "patch", "dispatch_overhead_us": "patch",
    "PatchReport": "patch", "PatchError": "patch", "KernelLoadError": "patch", "DispatchOverhead": "patch",
    "PatchBundle": "bundle", "PatchSpec": "bundle", "Guard": "bundle", "Provenance": "bundle",
    "load_bundle": "bundle", "save_bundle": "bundle", "BundleError": "bundle", "BundleFormatError": "bundle",
    "BundleIntegrityError": "bundle", "FORMAT_VERSION": "bundle",
    "is_supported": "guards",
    "enable_decode_graphs": "graphs", "disable_decode_graphs": "graphs", "decode_graphs_of": "graphs",
    "enable_batch_buckets": "buckets", "disable_batch_buckets": "buckets", "batch_buckets_of": "buckets",
    "enable_fast_interpreter": "interp",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kernels_runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kernels_runtime.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
