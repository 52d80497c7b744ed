#!/usr/bin/env bash
# Device call 2: SSM op bench (after the compile fix), then profile + extract (+ a short search) of the real workloads.
set -u
. scripts/gpu/env.sh
timeout 120 python3 scripts/bench_ssm_ops.py --out "$OUT/ssm.jsonl" > "$OUT/logs/bench_ssm.log" 2>&1; echo "ssm bench rc=$?"
python3 scripts/record_bench.py --db "$OUT/gpu.duckdb" --bench-id "$(date -u +%F)-h200-ssm" "$OUT/ssm.jsonl"
timeout ${PROFILE_TIMEOUT:-400} python3 scripts/gpu/profile_extract.py --db "$OUT/gpu.duckdb" --summary "$OUT/summary.json" \
   --search-budget ${SEARCH_BUDGET:-0} --search-top ${SEARCH_TOP:-3} ${WORKLOADS:-examples/workloads/qwen3-4b.toml examples/workloads/mamba-130m.toml} \
   > "$OUT/logs/profile_extract.log" 2>&1; echo "profile/extract rc=$?"
tail -25 "$OUT/logs/bench_ssm.log"; grep -v "^\s*$" "$OUT/logs/profile_extract.log" | tail -120
