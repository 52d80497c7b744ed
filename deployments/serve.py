"""`python -m deployments.serve examples/workloads/` serves, on the Prefect API in use (PREFECT_API_URL), from this
one process (Prefect's `serve`: no work pool, no worker; `python -m deployments.deploy` is the work-pool path):
- `nightly-workload/nightly-<name>`: each workload's nightly run (re-validate the bundle in service, re-optimize,
  keep / replace / rollback), staggered from --at by --stagger minutes, for the workloads whose device this host has;
- `optimize-workload/manual`: the closed loop with no schedule, to run from the Prefect UI (one typed `config`);
- `optimize-workload/on-change`: started by the `llm4llm.workload.changed` event that `llm4llm watch` emits, with
  the event's workload path (re-profile and re-extract by default: --on-change-stages);
- `profile-workload/manual`: profiling only.
GPU runs hold the device's global concurrency limit (`gpu-cuda-0`, limit 1), created here if missing."""
from __future__ import annotations

import argparse
from pathlib import Path

from deployments.triggers import EVENT, RESOURCE_PREFIX, workload_files

NIGHTLY_START = "03:00"
STAGGER_MIN = 45  # room for one nightly run of a large workload on one GPU (optimize, e2e, validation)
ON_CHANGE_STAGES = ("profile", "extract")


def nightly_crons(n: int, start: str = NIGHTLY_START, stagger_min: int = STAGGER_MIN) -> list[str]:
    """n daily cron strings from `start` (HH:MM, UTC), each `stagger_min` minutes after the one before."""
    h, m = (int(x) for x in start.split(":"))
    out = []
    for i in range(n):
        t = (h * 60 + m + i * stagger_min) % (24 * 60)
        out.append(f"{t % 60} {t // 60} * * *")
    return out


def on_change_trigger(stages: tuple[str, ...] = ON_CHANGE_STAGES, db_path: str | None = None,
                      device: str | None = None):
    """A deployment trigger on the change event of every workload (of `device` only, when given); the run's
    parameters come from the event."""
    from prefect.events import DeploymentEventTrigger

    params = {"workload_path": "{{ event.payload.path }}", "config": {"stages": list(stages)}}
    if db_path:
        params["db_path"] = db_path
    match = {"prefect.resource.id": RESOURCE_PREFIX + "*"} | ({"llm4llm.device": device} if device else {})
    return DeploymentEventTrigger(name="workload config or script changed", expect={EVENT}, match=match,
                                  parameters=params)


def split_by_device(workloads: list[Path]) -> tuple[list[tuple[Path, str]], list[tuple[Path, str]]]:
    """(workloads whose device this host has, (path, why) of the others). Invalid files raise (WorkloadError)."""
    from llm4llm.workload import device_problem, load_workload

    here, elsewhere = [], []
    for w in workloads:
        wl = load_workload(w, check_device=False)
        problem = device_problem(wl.device)
        (elsewhere if problem else here).append((w, problem or wl.device))
    return here, elsewhere


def nightly_specs(workloads: list[Path], start: str = NIGHTLY_START, stagger_min: int = STAGGER_MIN,
                  db_path: str | None = None) -> list[dict]:
    """One nightly deployment per workload: name, cron, tags, parameters, device (staggered in the given order)."""
    from llm4llm.workload import load_workload

    specs = []
    for w, cron in zip(workloads, nightly_crons(len(workloads), start, stagger_min)):
        device = load_workload(w, check_device=False).device
        params = {"workload_path": str(w.resolve())}
        if db_path:
            params["db_path"] = db_path
        specs.append({"name": f"nightly-{w.stem}", "cron": cron, "device": device, "parameters": params,
                      "tags": ["nightly", w.stem, "gpu" if device.startswith("cuda") else "cpu"]})
    return specs


def build_deployments(workloads: list[Path], start: str = NIGHTLY_START, stagger_min: int = STAGGER_MIN,
                      db_path: str | None = None, on_change_stages: tuple[str, ...] = ON_CHANGE_STAGES,
                      only_here: bool = True):
    """The RunnerDeployments to serve. Entrypoints are module paths (flows.nightly.nightly_workload), so Prefect
    imports the flows as the package's modules. only_here: nightly runs only for workloads whose device this host
    has (the others are printed and left out)."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.types.entrypoint import EntrypointType

    from flows.nightly import nightly_workload
    from flows.optimize import optimize_workload
    from flows.profiling import profile_workload

    if only_here:
        here, elsewhere = split_by_device(workloads)
        for w, why in elsewhere:
            print(f"nightly-{w.stem}: not scheduled on this host ({why})")
        workloads = [w for w, _ in here]
    module = EntrypointType.MODULE_PATH
    one_at_a_time = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
    deps = [nightly_workload.to_deployment(name=s["name"], cron=s["cron"], tags=s["tags"], parameters=s["parameters"],
                                           concurrency_limit=one_at_a_time, entrypoint_type=module)
            for s in nightly_specs(workloads, start, stagger_min, db_path)]
    manual = {"db_path": db_path} if db_path else {}
    deps.append(optimize_workload.to_deployment(name="manual", tags=["manual"], parameters=manual,
                                                entrypoint_type=module))
    deps.append(optimize_workload.to_deployment(name="on-change", tags=["on-change"],
                                                triggers=[on_change_trigger(on_change_stages, db_path)],
                                                concurrency_limit=one_at_a_time, entrypoint_type=module))
    deps.append(profile_workload.to_deployment(name="manual", tags=["manual"], parameters=manual,
                                               entrypoint_type=module))
    return deps


def gpu_devices(workloads: list[Path]) -> list[str]:
    from llm4llm.workload import load_workload

    return sorted({d for w in workloads if (d := load_workload(w, check_device=False).device).startswith("cuda")})


def ensure_gpu_limits(devices: list[str]) -> list[str]:
    """Create the global concurrency limit (one slot) of each CUDA device that is missing; returns their names."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectNotFound

    from flows.gpu import gpu_limit_name

    names = sorted({gpu_limit_name(d) for d in devices if gpu_limit_name(d)})
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    return names


def _args(argv: list[str] | None, doc: str, pool: bool = False):
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if pool:
        ap.add_argument("--pool", default="llm4llm", help="process work pool (default %(default)s)")
    ap.add_argument("workloads", nargs="+", help="workload TOML files or directories")
    ap.add_argument("--at", default=NIGHTLY_START, help="first nightly run, HH:MM UTC (default %(default)s)")
    ap.add_argument("--stagger", type=int, default=STAGGER_MIN, help="minutes between nightly runs (default %(default)s)")
    ap.add_argument("--db", default=None, help="DuckDB file the runs write (default: the flows' default)")
    ap.add_argument("--on-change-stages", default=",".join(ON_CHANGE_STAGES),
                    help="stages of a run started by a config change (default %(default)s)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from prefect import serve

    args = _args(argv, __doc__)
    workloads = workload_files(args.workloads)
    db = str(Path(args.db).resolve()) if args.db else None
    deps = build_deployments(workloads, args.at, args.stagger, db,
                             tuple(s.strip() for s in args.on_change_stages.split(",")))
    ensure_gpu_limits(gpu_devices([w for w, _ in split_by_device(workloads)[0]]))
    serve(*deps, limit=1)  # one run at a time: one times the GPU, one loads a CPU host


if __name__ == "__main__":
    main()
