#!/usr/bin/env bash
# Device call 1: GPU op tests, then the op benchmarks at real model shapes (bf16), rows into DuckDB.
set -u
. scripts/gpu/env.sh
timeout 150 python3 -m pytest -q -m gpu tests/ops -x -p no:cacheprovider > "$OUT/logs/gpu_op_tests.log" 2>&1; echo "gpu op tests rc=$?"
tail -3 "$OUT/logs/gpu_op_tests.log"
timeout 170 python3 scripts/bench_transformer_ops.py --out "$OUT/tops.jsonl" > "$OUT/logs/bench_tops.log" 2>&1; echo "transformer bench rc=$?"
timeout 170 python3 scripts/bench_ssm_ops.py --out "$OUT/ssm.jsonl" > "$OUT/logs/bench_ssm.log" 2>&1; echo "ssm bench rc=$?"
python3 scripts/record_bench.py --db "$OUT/ops.duckdb" --bench-id "$(date -u +%F)-h200-ops" "$OUT/tops.jsonl" "$OUT/ssm.jsonl"
tail -40 "$OUT/logs/bench_tops.log"; tail -30 "$OUT/logs/bench_ssm.log"
