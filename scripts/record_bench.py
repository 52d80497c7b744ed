"""Load the op benchmarks' JSON-lines rows into DuckDB's `op_benchmarks` table (long format: one row per provider).

    python scripts/record_bench.py --db results.duckdb --bench-id 2026-11-30-h200 tops.jsonl ssm.jsonl

Also takes scripts/gpu/dispatch_overhead.py's rows (op `dispatch:<measure>`, times in ms) and
the launch-overhead probe's (op `launch`, one provider per launch path). The graph diagnostic's JSON files
(`--graph-diag FILE`, end-to-end generate times) go to `e2e_results` under run id `<bench-id>-<file stem>`. Both
probes are retired (scripts/README.md names the commit that has them); their committed outputs under docs/results
still load.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from storage import repo  # noqa: E402
from storage.db import Database  # noqa: E402


def dispatch_rows(row: dict, bench_id: str) -> list[dict]:
    """scripts/gpu/dispatch_overhead.py rows: per-call microseconds of the HF forward, the direct kernel call and
    the patched module, stored in the *_ms columns (as ms) under op `dispatch:<measure>`."""
    common = {"bench_id": bench_id, "op": f"dispatch:{row['measure']}", "shape": row["module"], "dtype": "bfloat16",
              "gpu_name": row.get("gpu"), "versions_json": {"torch": row.get("torch"), "calls": row.get("calls")},
              "gbps": None, "tflops": None, "max_abs_err": None}
    out = []
    for provider, key in (("hf_forward", "original_us"), ("direct_kernel", "direct_kernel_us"),
                          ("module_call", "module_call_us"), ("patched", "patched_us"), ("overhead", "overhead_us")):
        if row.get(key) is not None:
            v = row[key] / 1e3
            out.append({**common, "provider": provider, "p20_ms": None, "p50_ms": v, "p80_ms": None})
    return out


def launch_rows(row: dict, bench_id: str) -> list[dict]:
    """The launch-overhead probe's rows: microseconds per launch by launch path (op `launch`, provider = path)."""
    us = row.get("us_per_launch")
    return [{"bench_id": bench_id, "op": "launch", "provider": row["path"], "shape": "copy[2560] bf16",
             "dtype": "bfloat16", "p20_ms": None, "p50_ms": None if us is None else us / 1e3, "p80_ms": None,
             "gbps": None, "tflops": None, "max_abs_err": None, "gpu_name": row.get("gpu"),
             "versions_json": {"torch": row.get("torch"), "triton": row.get("triton"), "error": row.get("error")}}]


def long_rows(row: dict, bench_id: str) -> list[dict]:
    if "measure" in row:
        return dispatch_rows(row, bench_id)
    if "path" in row and "us_per_launch" in row:
        return launch_rows(row, bench_id)
    versions = {"torch": row.get("torch"), "triton": row.get("triton")}
    common = {"bench_id": bench_id, "op": f"{row['op']}", "shape": f"{row['model']}:{row.get('phase', '')}:{row['shape']}",
              "dtype": row["dtype"], "gpu_name": row.get("gpu"), "versions_json": versions}
    if "provider" in row:  # one provider per row already
        return [{**common, "provider": row["provider"], "p20_ms": row["p20_ms"], "p50_ms": row["p50_ms"],
                 "p80_ms": row["p80_ms"], "gbps": row.get("gbps"), "tflops": None,
                 "max_abs_err": row.get("max_abs_err")}]
    return [
        {**common, "provider": "reference", "p20_ms": row["ref_ms_p20"], "p50_ms": row["ref_ms_p50"],
         "p80_ms": row["ref_ms_p80"], "gbps": None, "tflops": None, "max_abs_err": None},
        {**common, "provider": "triton", "p20_ms": row["triton_ms_p20"], "p50_ms": row["triton_ms_p50"],
         "p80_ms": row["triton_ms_p80"], "gbps": row.get("gbps"), "tflops": row.get("tflops"),
         "max_abs_err": row.get("max_abs")},
    ]


def graph_diag_rows(doc: dict, run_id: str, gpu: str | None) -> list[dict]:
    """The graph diagnostic's output: one e2e_results row per variant (total, prefill and decode per token as
    llm4llm.evaluate.measure times them; rows written before graph_diag timed through it have the total only)."""
    out = []
    for r in doc["rows"]:
        notes = {k: r[k] for k in ("config", "calls", "graphs", "error") if k in r}
        out.append({"run_id": run_id, "workload_hash": doc["workload"], "variant": r["variant"][:120],
                    "prefill_ms": r.get("prefill_ms"), "decode_ms_per_token": r.get("decode_ms_per_token"),
                    "total_ms": r["ms"], "tokens_per_s": None,
                    "peak_mem_mb": None, "compile_s": None, "repeats": None, "gpu_name": gpu,
                    "versions_json": None, "notes": json.dumps(notes, default=str)[:2000]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", required=True)
    ap.add_argument("--bench-id", required=True)
    ap.add_argument("--graph-diag", action="append", default=[], help="the graph diagnostic's JSON (repeatable)")
    ap.add_argument("--gpu", default=None, help="GPU name for --graph-diag rows")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    if args.graph_diag:
        with Database(args.db) as db:
            for f in args.graph_diag:
                stem = os.path.splitext(os.path.basename(f))[0]
                repo.record_e2e(db, graph_diag_rows(json.load(open(f)), f"{args.bench_id}-{stem}", args.gpu))
                print(f"{f}: e2e_results run {args.bench_id}-{stem}")
    rows = []
    for f in args.files:
        if not os.path.exists(f):
            print(f"skip {f}: missing")
            continue
        for line in open(f):
            if line.strip():
                rows += long_rows(json.loads(line), args.bench_id)
    with Database(args.db) as db:
        print(f"{repo.record_op_benchmarks(db, rows)} rows into {args.db}")


if __name__ == "__main__":
    main()
