#!/usr/bin/env bash
# Kept as the exact command of call 1 in docs/results/2026-11-30-h200-b. Do not use it for timings: two lanes on one
# host skewed every host-bound number (decode); use scripts/gpu/session_seq.sh.
# Device call on `nvidia-h200-x2` (device tool, carry [".whl", ".mamba_ssm"]): two lanes side by side, one per GPU,
# each with its own DuckDB file, Prefect home and artifact dir (DuckDB has one writer; the ephemeral Prefect API
# keeps its state under PREFECT_HOME). Each lane's timings are taken on its own GPU; the lanes share the host's 32
# cores. Pick the lanes' work with STEP:
#   STEP=1: lane 0 = SSM op bench with mamba_ssm's Triton kernels + GPU dispatch overhead + `optimize` mamba-130m and
#           mamba2-2.7b; lane 1 = `optimize` qwen3-4b and llama-2-7b (eager / torch.compile / patched).
#   STEP=2: lane 0 = `optimize` recurrentgemma-2b; lane 1 = extracted-task searches (budget 15) on the three SSM /
#           recurrent models, for pass rates and speedups beyond the optimize runs' budget.
set -u
. scripts/gpu/env.sh
export LLM4LLM_TIMING_MIN_MS=60
LIMIT=${LIMIT:-570}
T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) - ${1:-0} )); }

lane_env() {  # lane index -> its GPU, its stores
  export CUDA_VISIBLE_DEVICES=$1 PREFECT_HOME=/tmp/prefect$1 LLM4LLM_HOME=/tmp/l4l$1
}

optimize() {  # lane workload budget top variants max_s
  local lane=$1 w=$2 budget=$3 top=$4 variants=$5 max=$6
  local t=$(left 15); [ "$t" -gt "$max" ] && t=$max
  if [ "$t" -lt 60 ]; then echo "lane $lane: $w skipped (${t}s left)"; return; fi
  local s=$(date +%s)
  timeout "$t" python3 -m llm4llm.cli optimize examples/workloads/$w.toml --db "$OUT/lane$lane.duckdb" \
    --budget "$budget" --top "$top" --e2e-variants "$variants" > "$OUT/logs/optimize_$w.log" 2>&1
  echo "lane $lane: optimize $w rc=$? in $(( $(date +%s) - s ))s (limit ${t}s)"
}

case "${STEP:-1}" in
  1)
    ( lane_env 0
      timeout 150 python3 scripts/bench_ssm_ops.py --mamba-ssm .mamba_ssm --out "$OUT/ssm_ops.jsonl" \
        > "$OUT/logs/bench_ssm_ops.log" 2>&1; echo "lane 0: ssm op bench rc=$?"
      timeout 60 python3 scripts/gpu/dispatch_overhead.py --out "$OUT/dispatch.jsonl" \
        > "$OUT/logs/dispatch.log" 2>&1; echo "lane 0: dispatch overhead rc=$?"
      optimize 0 mamba-130m 6 2 eager,torch_compile,patched 170
      optimize 0 mamba2-2.7b 6 2 eager,torch_compile,patched 400
    ) > "$OUT/logs/lane0.txt" 2>&1 &
    ( lane_env 1
      optimize 1 qwen3-4b 6 4 eager,torch_compile,patched 280
      optimize 1 llama-2-7b 6 4 eager,torch_compile,patched 400
    ) > "$OUT/logs/lane1.txt" 2>&1 &
    wait ;;
  2)
    ( lane_env 0
      optimize 0 recurrentgemma-2b 6 2 eager,torch_compile,patched 400
    ) > "$OUT/logs/lane0.txt" 2>&1 &
    ( lane_env 1
      timeout $(left 20) python3 scripts/gpu/search_evidence.py --db "$OUT/lane1.duckdb" \
        --summary "$OUT/ssm_search_summary.json" --budget ${BUDGET:-15} --deadline-s $(left 120) \
        --search mamba-130m:2,mamba2-2.7b:2,recurrentgemma-2b:2 \
        examples/workloads/mamba-130m.toml examples/workloads/mamba2-2.7b.toml examples/workloads/recurrentgemma-2b.toml \
        > "$OUT/logs/ssm_search.log" 2>&1; echo "lane 1: ssm search rc=$?"
    ) > "$OUT/logs/lane1.txt" 2>&1 &
    wait ;;
esac
cat "$OUT"/logs/lane*.txt
for f in "$OUT"/lane*.duckdb; do
  [ -f "$f" ] || continue
  python3 - "$f" <<'PY'
import sys, duckdb
c = duckdb.connect(sys.argv[1], read_only=True)
q = lambda s: print(c.execute(s).df().to_string(max_colwidth=70))
print("==", sys.argv[1])
q("select task_id, count(*) n, avg(passed::int) pass_rate, max(speedup_in_context) best_ctx, max(utility) best_u, any_value(failure_class) fail from candidates group by 1 order by 1")
q("select task_id, decision, left(reason, 90) reason, e2e_before_ms before, e2e_after_ms after, gain from acceptances")
q("select run_id, variant, prefill_ms pre, decode_ms_per_token dec, total_ms, compile_s, left(notes, 60) notes from e2e_results")
PY
done
grep -h "^\S" "$OUT"/logs/bench_ssm_ops.log "$OUT"/logs/dispatch.log 2>/dev/null | tail -40
