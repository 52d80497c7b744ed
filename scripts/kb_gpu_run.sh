#!/usr/bin/env bash
# KernelBench on one GPU in parallel shards (CPU-bound work overlaps; timed and judged GPU work is serialised by
# LLM4LLM_KB_GPU_LOCK), after warming torch.compile's caches. Usage:
#   scripts/kb_gpu_run.sh PROBLEM_DIR OUT_DIR [SHARDS] [BUDGET] [SHARD_TIMEOUT_S] [PRECOMPILE_TIMEOUT_S]
set -u
DIR=$1; OUT=$2; SHARDS=${3:-8}; BUDGET=${4:-2}; TSHARD=${5:-120}; TPRE=${6:-60}
MODES=${MODES:-episodic}  # e.g. MODES="episodic sample iter": the ablation at equal budget
RUN_ID=${RUN_ID:-kb-$(date +%Y%m%d-%H%M%S)}
export LLM4LLM_KB_GPU_LOCK=/tmp/kb-gpu.lock TORCHINDUCTOR_CACHE_DIR=/tmp/kb-inductor TRITON_CACHE_DIR=/tmp/kb-triton
ids=$(ls "$DIR" | grep -E '^[0-9]+_.*\.py$' | cut -d_ -f1 | sort -n)
timeout "$TPRE" python3 scripts/kb_precompile.py "$DIR" --procs 14 > "$OUT/precompile.log" 2>&1
export TORCHINDUCTOR_COMPILE_THREADS=2
i=0; declare -a lists
for id in $ids; do s=$((i % SHARDS)); lists[$s]="${lists[$s]:-}${lists[$s]:+,}$id"; i=$((i+1)); done
for s in $(seq 0 $((SHARDS-1))); do
  modeargs=""; for m in $MODES; do modeargs="$modeargs --mode $m"; done
  timeout "$TSHARD" python3 -m llm4llm.cli kernelbench "$DIR" --problems "${lists[$s]}" --budget "$BUDGET" $modeargs \
    --run-id "$RUN_ID" --device cuda --db "/tmp/kb-shard-$s.duckdb" --data-dir "/tmp/kb-data-$s" > "/tmp/kb-shard-$s.log" 2>&1 &
done
wait
cat /tmp/kb-shard-*.log | grep -v -i "warning\|return cls" > "$OUT/shards.log"
python3 scripts/kb_merge.py "$OUT/kb.duckdb" /tmp/kb-shard-*.duckdb > "$OUT/merge.log" 2>&1
