"""One GPU run at a time per device: a Prefect global concurrency limit per CUDA device (`gpu-cuda-0`, limit 1,
created by the deployments), held by the outermost flow of a run for as long as it runs. Nightly runs that fire
together queue on it instead of timing kernels against each other."""
from __future__ import annotations

import contextvars
from contextlib import contextmanager

_HELD: contextvars.ContextVar[frozenset] = contextvars.ContextVar("llm4llm_gpu_slots", default=frozenset())


def gpu_limit_name(device: str) -> str | None:
    """The global concurrency limit of a workload's device ("cuda", "cuda:1"), None for the CPU."""
    if not device.startswith("cuda"):
        return None
    return f"gpu-cuda-{device.partition(':')[2] or '0'}"


@contextmanager
def gpu_slot(device: str):
    """Occupy the device's slot (waiting for it), once per run: a subflow of a run that holds it passes through."""
    name = gpu_limit_name(device)
    if name is None or name in _HELD.get() or not _limit_exists(name):
        # no limit: a plain run on Prefect's ephemeral API (the deployments create it where runs can collide)
        yield
        return
    from prefect.concurrency.sync import concurrency

    token = _HELD.set(_HELD.get() | {name})
    try:
        # the lease is renewed while the run is alive; a crashed run's slot frees itself when the lease expires
        with concurrency(name, occupy=1, strict=False):
            yield
    finally:
        _HELD.reset(token)


def _limit_exists(name: str) -> bool:
    """Whether the API has the global concurrency limit (without it, Prefect would warn and go on anyway)."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.read_global_concurrency_limit_by_name(name)
        return True
    except Exception:  # noqa: BLE001 - ObjectNotFound, or an API that cannot say: run without the slot
        return False
