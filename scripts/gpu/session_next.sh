#!/usr/bin/env bash
# Next device session (issues "State-space and recurrent families" and "Deployment-time acceptance"): SSM/recurrent
# searches on the extracted tasks, then the whole loop with the calibrated acceptance metric. One call each fits the
# 10-minute limit; pick with STEP=ssm|e2e-ssm|e2e-transformers.
set -u
. scripts/gpu/env.sh
export LLM4LLM_TIMING_MIN_MS=60
case "${STEP:-ssm}" in
  ssm)  # extracted-task speedups for the three SSM/recurrent models (prefill + decode), budget 15
    timeout 560 python3 scripts/gpu/search_evidence.py --db "$OUT/ssm_search.duckdb" --summary "$OUT/ssm_summary.json" \
      --budget ${BUDGET:-15} --deadline-s 480 \
      --search mamba-130m:2,mamba2-2.7b:2,recurrentgemma-2b:2 \
      examples/workloads/mamba-130m.toml examples/workloads/mamba2-2.7b.toml examples/workloads/recurrentgemma-2b.toml \
      > "$OUT/logs/ssm_search.log" 2>&1; echo "ssm search rc=$?" ;;
  e2e-ssm)
    for w in mamba-130m mamba2-2.7b recurrentgemma-2b; do
      timeout 180 python3 -m llm4llm.cli optimize examples/workloads/$w.toml --db "$OUT/e2e.duckdb" --budget 6 --top 2 \
        --e2e-variants eager,patched > "$OUT/logs/e2e_$w.log" 2>&1; echo "$w rc=$?"; done ;;
  e2e-transformers)
    for w in qwen3-4b llama-2-7b; do
      timeout 280 python3 -m llm4llm.cli optimize examples/workloads/$w.toml --db "$OUT/e2e.duckdb" --budget 6 --top 4 \
        > "$OUT/logs/e2e_$w.log" 2>&1; echo "$w rc=$?"; done ;;
esac
grep -hv "│\|┃\|━\|─\|^\[transformers\]" "$OUT"/logs/*.log | tail -60
