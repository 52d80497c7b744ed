"""`python -m deployments.deploy examples/workloads/ --pool llm4llm` registers the same deployments as
deployments.serve on a Prefect **process work pool**, for workers to run (`prefect worker start --pool llm4llm
--work-queue cpu` on a CPU host, `--work-queue gpu-cuda-0` on a GPU host). The flow code is pulled from this
checkout (Flow.from_source on the project directory: the worker's host must see the same path, as with any
process pool). Runs are routed by device: a workload on `cuda[:N]` goes to work queue `gpu-cuda-N`, created with a
concurrency limit of 1 (one GPU run at a time, the rest wait in the queue), the others to `cpu` (one
slot too: one CPU-hungry run at a time); so a nightly run is
only ever picked up by a worker on a host that has its device. The pool, the queues and the GPU global concurrency
limits are created when missing."""
from __future__ import annotations

from pathlib import Path

from deployments.serve import (ON_CHANGE_STAGES, _args, ensure_gpu_limits, gpu_devices, nightly_specs,
                               on_change_trigger)
from deployments.triggers import workload_files

ROOT = Path(__file__).resolve().parent.parent
CPU_QUEUE = "cpu"


def queue_of(device: str) -> str:
    from flows.gpu import gpu_limit_name

    return gpu_limit_name(device) or CPU_QUEUE


def ensure_pool(pool: str, queues: list[str]) -> None:
    """The process work pool and its queues, created when missing. Every queue has one slot: a GPU times one run
    at a time, and a CPU host runs one closed loop at a time."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkQueueCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        except ObjectAlreadyExists:
            pass
        for q in queues:
            try:
                client.create_work_queue(name=q, work_pool_name=pool, concurrency_limit=1)
            except ObjectAlreadyExists:
                pass


def deploy_all(workloads: list[Path], pool: str, start: str, stagger_min: int, db_path: str | None,
               on_change_stages: tuple[str, ...] = ON_CHANGE_STAGES) -> list:
    """Every deployment on `pool`; returns their ids. Nightly runs for every workload (the queue decides where)."""
    from prefect import flow as prefect_flow
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    one_at_a_time = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
    specs = nightly_specs(workloads, start, stagger_min, db_path)
    ensure_pool(pool, sorted({CPU_QUEUE} | {queue_of(s["device"]) for s in specs}))
    ensure_gpu_limits(gpu_devices(workloads))

    def load(entrypoint: str):
        return prefect_flow.from_source(source=str(ROOT), entrypoint=entrypoint)

    nightly = load("flows/nightly.py:nightly_workload")
    optimize = load("flows/optimize.py:optimize_workload")
    profile = load("flows/profiling.py:profile_workload")
    common = {"work_pool_name": pool, "build": False, "push": False, "print_next_steps": False}
    manual = {"db_path": db_path} if db_path else {}
    ids: list = []

    def deploy(flow, name: str, **options) -> None:
        # Prefect prints its process-work-pool advice on every deploy call: once is enough
        ids.append(flow.deploy(name, ignore_warnings=bool(ids), **options, **common))

    for s in specs:
        deploy(nightly, s["name"], cron=s["cron"], tags=s["tags"], parameters=s["parameters"],
               work_queue_name=queue_of(s["device"]), concurrency_limit=one_at_a_time)
    for q in sorted({CPU_QUEUE} | {queue_of(s["device"]) for s in specs}):  # manual and on-change runs per device
        suffix, device = ("", "cpu") if q == CPU_QUEUE else (f"-{q}", "cuda:" + q.rsplit("-", 1)[1])
        deploy(optimize, f"manual{suffix}", tags=["manual"], parameters=manual, work_queue_name=q)
        deploy(optimize, f"on-change{suffix}", tags=["on-change"], work_queue_name=q,
               triggers=[on_change_trigger(on_change_stages, db_path, device)], concurrency_limit=one_at_a_time)
        deploy(profile, f"manual{suffix}", tags=["manual"], parameters=manual, work_queue_name=q)
    return ids


def main(argv: list[str] | None = None) -> None:
    args = _args(argv, __doc__, pool=True)
    pool = args.pool
    db = str(Path(args.db).resolve()) if args.db else None
    ids = deploy_all(workload_files(args.workloads), pool, args.at, args.stagger, db,
                     tuple(s.strip() for s in args.on_change_stages.split(",")))
    print(f"{len(ids)} deployments on work pool {pool!r}: start a worker with "
          f"`prefect worker start --pool {pool} --work-queue {CPU_QUEUE}` (a GPU host: --work-queue gpu-cuda-0)")


if __name__ == "__main__":
    main()
