"""Retry and cache policies shared by the tasks."""
from __future__ import annotations

from typing import Any

from llm4llm.errors import Llm4llmError


def infrastructure_only(task: Any, task_run: Any, state: Any) -> bool:
    """Retry condition: retry unexpected (infrastructure) failures, never bad input or bad user code."""
    exc = getattr(state, "data", None)
    if not isinstance(exc, BaseException):
        try:
            exc = state.result(raise_on_failure=False)
        except Exception as e:  # noqa: BLE001 - reading a failed state may itself raise
            exc = e
    return not isinstance(exc, Llm4llmError)


def stage_cache_key(stage: str, parameters: dict, *keys: str) -> str:
    """Cache key = stage + workload hash + code version + hardware + the named parameters (paths, options)."""
    from llm4llm.stages.common import code_version, hardware_fingerprint

    wl = parameters["workload"]
    parts = [stage, wl["workload_hash"], code_version(), hardware_fingerprint(wl["device"])]
    parts += [f"{k}={parameters.get(k)}" for k in keys]
    return "|".join(parts)
