"""Where candidate evaluation runs: in the flow's process on its one device (local, the default), or fanned out over
a Ray cluster, one GPU per task search (prefect-ray's RayTaskRunner; docs/scale-out.md).

Only the settings and the task-directory transport live here (no Prefect, no Ray): the flow turns `ScaleOut` into a
task runner (flows/search.py), and a remote search gets its task as bytes, since a Ray worker on another machine
does not see the flow's data directory.
"""
from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llm4llm.errors import Llm4llmError

TASK_RUNNERS = ("local", "ray")


class ScaleOut(BaseModel):
    """How the searches of a run are spread (the `search` stage; acceptance and evaluation stay in the flow's
    process, on the workload's device)."""

    model_config = ConfigDict(extra="forbid")

    task_runner: Literal["local", "ray"] = Field(
        "local", description="local: every search in the flow's process, one verifier worker per device, timing "
                             "one job at a time (the default); ray: one task search per Ray task, each with its own "
                             "GPU and its own verifier worker")
    ray_address: str | None = Field(
        None, description="Ray cluster to join: None starts a local Ray instance (all GPUs of this machine), 'auto' "
                          "the cluster this machine is a node of, 'ray://HEAD:10001' a remote cluster (Ray Client)")
    gpus_per_eval: float = Field(1.0, ge=0, description="GPUs reserved by each remote search (0: CPU workloads)")
    cpus_per_eval: float = Field(1.0, ge=0, description="CPUs reserved by each remote search")
    ray_init: dict[str, Any] = Field(
        default_factory=dict, description="extra ray.init keyword arguments, e.g. {\"runtime_env\": {\"working_dir\": "
                                          "\".\"}} to ship this checkout to the cluster's workers")


def scale_options(task_runner: str = "local", ray_address: str | None = None,
                  gpus_per_eval: float = 1.0) -> ScaleOut:
    """The CLI's --task-runner / --ray-address / --ray-gpus-per-eval as a ScaleOut; one clear error otherwise."""
    if task_runner not in TASK_RUNNERS:
        raise Llm4llmError(f"--task-runner: expected one of {', '.join(TASK_RUNNERS)}, got {task_runner!r}")
    if ray_address and task_runner != "ray":
        raise Llm4llmError(f"--ray-address: expected --task-runner ray beside it, got --task-runner {task_runner}")
    if gpus_per_eval < 0:
        raise Llm4llmError(f"--ray-gpus-per-eval: expected >= 0, got {gpus_per_eval}")
    if task_runner == "ray":
        try:
            import prefect_ray  # noqa: F401
            import ray  # noqa: F401
        except ImportError as e:
            raise Llm4llmError(f"--task-runner ray: expected ray and prefect-ray installed "
                               f"(pip install -e '.[ray]'), got {e}") from e
    return ScaleOut(task_runner=task_runner, ray_address=ray_address or None, gpus_per_eval=gpus_per_eval)


def pack_dir(path: str | Path) -> bytes:
    """A directory as an uncompressed tar (task artifacts are mostly safetensors, which do not compress)."""
    path = Path(path)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(path, arcname=path.name)
    return buf.getvalue()


def unpack_dir(blob: bytes, into: str | Path) -> Path:
    """Unpack a `pack_dir` tar under `into`; returns the directory it held."""
    into = Path(into)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
        names = {m.name.split("/", 1)[0] for m in tar.getmembers()}
        if len(names) != 1:
            raise ValueError(f"task archive: expected one top-level directory, got {sorted(names)}")
        tar.extractall(into, filter="data")
    return into / names.pop()


def placement() -> dict:
    """Where this evaluation runs: host, process, and the GPUs Ray gave it (CUDA_VISIBLE_DEVICES is what the
    verifier worker it spawns inherits)."""
    import os
    import socket

    gpu_ids = None
    try:
        import ray

        if ray.is_initialized():
            gpu_ids = [str(g) for g in ray.get_gpu_ids()]
    except ImportError:
        pass
    return {"host": socket.gethostname(), "pid": os.getpid(), "gpu_ids": gpu_ids,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
