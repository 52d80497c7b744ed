#!/usr/bin/env bash
# Device call: the whole loop through the main command (profile -> extract -> search -> accept -> evaluate).
set -u
. scripts/gpu/env.sh
export LLM4LLM_TIMING_MIN_MS=60
timeout ${T1:-250} python3 -m llm4llm.cli optimize examples/workloads/mamba-130m.toml --db "$OUT/e2e.duckdb" \
  --budget ${BUDGET:-6} --top 2 --e2e-variants eager,patched > "$OUT/logs/e2e_mamba.log" 2>&1; echo "mamba-130m rc=$?"
timeout ${T2:-300} python3 -m llm4llm.cli optimize examples/workloads/llama-2-7b.toml --db "$OUT/e2e.duckdb" \
  --budget ${BUDGET:-6} --top 4 > "$OUT/logs/e2e_llama.log" 2>&1; echo "llama-2-7b rc=$?"
python3 - <<'PY'
import duckdb, os
c = duckdb.connect(os.environ["OUT"] + "/e2e.duckdb", read_only=True)
print(c.execute("select task_id, decision, left(reason, 150) reason, in_model_max_abs_err err, e2e_before_ms, e2e_after_ms, gain from acceptances").df().to_string())
print(c.execute("select run_id, variant, prefill_ms, decode_ms_per_token, total_ms, tokens_per_s, peak_mem_mb, compile_s, left(notes, 120) notes from e2e_results").df().to_string())
PY
grep -v "│\|┃\|━\|─" "$OUT/logs/e2e_mamba.log" | tail -15; grep -v "│\|┃\|━\|─" "$OUT/logs/e2e_llama.log" | tail -15
