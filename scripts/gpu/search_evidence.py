"""Device evidence for the search: profile + extract workloads through the flows, then searches on their tasks with
the built-in proposer, and the mode ablation (sample-N vs iter-N vs episodic at equal budget). Every trial is a
`candidates` row in the DuckDB file. Stops starting new searches at --deadline-s and prints what it has.

    python3 scripts/gpu/search_evidence.py --db $OUT/search.duckdb --budget 15 --deadline-s 520 \
        --ablate qwen3-4b:6 --search llama-2-7b:4 examples/workloads/qwen3-4b.toml examples/workloads/llama-2-7b.toml
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

T0 = time.time()


def _pick(tasks, n: int):
    """Top-n deployable tasks by score, prefill and decode both represented."""
    dep = tasks[tasks["deployable"] & tasks["artifact_path"].notna()].sort_values("score", ascending=False)
    dec, pre = dep[dep["phase"] == "decode"], dep[dep["phase"] == "prefill"]
    half = max(n // 2, 1)
    chosen = list(dec.head(half).itertuples()) + list(pre.head(n - half).itertuples())
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads", nargs="+")
    ap.add_argument("--db", required=True)
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--deadline-s", type=float, default=520)
    ap.add_argument("--ablate", default="", help="name:n_tasks: all three modes on the top tasks")
    ap.add_argument("--search", default="", help="comma list of name:n_tasks: episodic only")
    ap.add_argument("--summary", default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from flows.optimize import optimize_workload
    from llm4llm.config import OptimizeConfig
    from llm4llm import isolation
    from tasks.search import run_task_search
    from storage import repo
    from storage.db import Database

    runs = {}
    for wl in args.workloads:
        name = os.path.basename(wl).removesuffix(".toml")
        t = time.time()
        out = optimize_workload(wl, OptimizeConfig(stages=["profile", "extract"]), db_path=args.db)
        runs[name] = out["run_id"]
        print(f"[{time.time() - T0:6.1f}s] {name}: profile+extract {time.time() - t:.1f}s run {out['run_id']}", flush=True)
    plan = []
    if args.ablate:
        name, n = args.ablate.split(":")
        with Database(args.db) as db:
            tasks = repo.task_rows(db, runs[name])
        for t in _pick(tasks, int(n)):
            for mode in ("episodic", "sample", "iter"):
                plan.append((name, t, mode))
    for item in filter(None, args.search.split(",")):
        name, n = item.split(":")
        with Database(args.db) as db:
            tasks = repo.task_rows(db, runs[name])
        plan += [(name, t, "episodic") for t in _pick(tasks, int(n))]
    # interleave so that a deadline cuts every task's ablation evenly rather than dropping whole tasks
    results = []
    data_dir = os.environ.get("LLM4LLM_HOME", "/tmp/l4l")
    for name, t, mode in plan:
        if time.time() - T0 > args.deadline_s:
            print(f"deadline: skipped {name} {t.task_id} {mode}", flush=True)
            continue
        s = time.time()
        r = run_task_search(t.artifact_path, args.db, data_dir, mode=mode, budget=args.budget,
                            device=args.device, timeout_s=180, run_id=runs[name],
                            use_prior=False)  # modes compared from the same starting point
        r.update(workload=name, mode=mode, family=t.family, phase=t.phase, seconds=round(time.time() - s, 1))
        results.append(r)
        print(f"[{time.time() - T0:6.1f}s] {name} {t.task_id} {mode}: {r['trials']} trials, pass "
              f"{r['pass_rate']:.0%}, best {r['best_utility']}", flush=True)
    isolation.close_pools()
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump({"runs": runs, "searches": results}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
