"""`python -m deployments.serve examples/workloads/qwen3-4b.toml ...` serves, on the Prefect API in use:
- `optimize-workload/nightly-<name>`: a nightly re-optimization of each workload (cron, default 03:00),
- `optimize-workload/manual`: the same flow with no schedule, to run from the Prefect UI with any workload path,
- `profile-workload/manual`: profiling only.
Re-profiling on a config change is `llm4llm watch` (deployments.triggers)."""
from __future__ import annotations

import argparse
from pathlib import Path

from deployments.triggers import workload_files


def build_deployments(workloads: list[Path], cron: str = "0 3 * * *", db_path: str | None = None):
    from flows.optimize import optimize_workload
    from flows.profiling import profile_workload

    deps = []
    for w in workloads:
        deps.append(optimize_workload.to_deployment(
            name=f"nightly-{w.stem}", cron=cron, tags=["nightly", w.stem],
            parameters={"workload_path": str(w.resolve()), "db_path": db_path}))
    deps.append(optimize_workload.to_deployment(name="manual", tags=["manual"]))
    deps.append(profile_workload.to_deployment(name="manual", tags=["manual"]))
    return deps


def main(argv: list[str] | None = None) -> None:
    from prefect import serve

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="+", help="workload TOML files or directories")
    ap.add_argument("--cron", default="0 3 * * *")
    ap.add_argument("--db", default=None)
    args = ap.parse_args(argv)
    serve(*build_deployments(workload_files(args.workloads), args.cron, args.db))


if __name__ == "__main__":
    main()
