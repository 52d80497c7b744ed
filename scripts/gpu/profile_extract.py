"""Device evidence: profile + extract real workloads through the Prefect flows into one DuckDB file, then (optionally)
a short search on the top tasks with the built-in proposer. Prints the hotspot tables and a summary.

    python3 scripts/gpu/profile_extract.py --db $OUT/gpu.duckdb --search-budget 4 --search-top 3 \
        examples/workloads/qwen3-4b.toml examples/workloads/mamba-130m.toml
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from rich.console import Console  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads", nargs="+")
    ap.add_argument("--db", required=True)
    ap.add_argument("--search-budget", type=int, default=0)
    ap.add_argument("--search-top", type=int, default=3)
    ap.add_argument("--search-workloads", default="", help="comma-separated names to search (default: all)")
    ap.add_argument("--summary", default=None)
    args = ap.parse_args()
    from flows.optimize import optimize_workload
    from flows.search import search_tasks
    from llm4llm.config import OptimizeConfig, SearchSettings
    from llm4llm.stages.profile import load_profile
    from llm4llm.profiler import format_hotspots
    from storage import repo
    from storage.db import Database

    console = Console(width=200)
    summary = []
    for wl in args.workloads:
        t0 = time.time()
        out = optimize_workload(wl, OptimizeConfig(stages=["profile", "extract"]), db_path=args.db)
        t_prof = time.time() - t0
        _, prof = load_profile(out["profile_path"])
        console.print(format_hotspots(prof, top=25))
        for name, ph in prof.phases.items():
            console.print(f"  {name}: {ph.forwards} forwards, {ph.time_ms:.2f} ms, weight {ph.weight:.3f}")
        with Database(args.db) as db:
            tasks = repo.task_rows(db, out["run_id"])
        console.print(tasks[["task_id", "family", "phase", "instances", "score", "deployable", "reason"]]
                      .to_string(max_colwidth=70))
        entry = {"workload": wl, "run_id": out["run_id"], "profile_extract_s": round(t_prof, 1),
                 "tasks": int(len(tasks)), "deployable": int(tasks["deployable"].sum())}
        name = os.path.basename(wl).removesuffix(".toml")
        if args.search_budget and (not args.search_workloads or name in args.search_workloads.split(",")):
            t1 = time.time()
            res = search_tasks(out["run_id"], SearchSettings(mode="episodic", budget=args.search_budget,
                                                             top=args.search_top, timeout_s=180),
                               db_path=args.db, device="cuda")
            entry["search_s"] = round(time.time() - t1, 1)
            entry["searches"] = res
            for r in res:
                console.print(f"search {r['task_id']}: {r['trials']} trials, pass rate {r['pass_rate']:.0%}, "
                              f"best utility {r['best_utility']}")
        summary.append(entry)
        console.print(json.dumps(entry, default=str))
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=1, default=str)


if __name__ == "__main__":
    main()
