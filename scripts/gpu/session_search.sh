#!/usr/bin/env bash
# Device call 3: profile+extract qwen3-4b, llama-2-7b, mamba-130m (median of 3 runs), search + mode ablation.
set -u
. scripts/gpu/env.sh
timeout ${LIMIT:-560} python3 scripts/gpu/search_evidence.py --db "$OUT/search.duckdb" --summary "$OUT/search_summary.json" \
  --budget ${BUDGET:-15} --deadline-s ${DEADLINE:-470} --ablate ${ABLATE:-qwen3-4b:6} --search ${SEARCH:-llama-2-7b:4} \
  ${WORKLOADS:-examples/workloads/qwen3-4b.toml examples/workloads/llama-2-7b.toml examples/workloads/mamba-130m.toml} \
  > "$OUT/logs/search.log" 2>&1; echo "search evidence rc=$?"
grep -v "^\s*$" "$OUT/logs/search.log" | grep -v "│\|┃\|━\|─" | tail -80
