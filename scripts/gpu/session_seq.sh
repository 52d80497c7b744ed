#!/usr/bin/env bash
# The GPU run script: one device call (device tool, carry [".whl"]) whose steps run one after another, never side by
# side (decode is host-bound: a second lane on the same host skews every timing). Each optimize has its own time
# limit (TERM, then KILL 15 s later, the whole process group: the acceptance and verifier workers are children).
# Logs come back as one tarball ($OUT returns at most 8 files).
# LIMIT counts from this script's start and the script sources env.sh itself: do not source it before (a second
# unpacking of the wheels took the 25 s a killed run needs to write its summary, and the call hit its 600 s).
#   STEPS="dispatch optimize:mamba-130m:4:2:220 optimize:qwen3-4b:4:3" LIMIT=575 bash scripts/gpu/session_seq.sh
#   (optimize:WORKLOAD:BUDGET:TOP[:MAX_S[:VARIANTS]], VARIANTS comma-separated, default eager,patched,torch_compile;
#    dispatch: scripts/gpu/dispatch_overhead.py;
#    trace:WORKLOAD[:MAX_S]: scripts/gpu/trace_decode.py, eager vs the bundle an earlier optimize step made; traces go
#    into the logs tarball;
#    readme:WORKLOAD[:MAX_S]: the README's command as a user types it (`llm4llm optimize W.toml`, no flags; OPT_ARGS
#    are not added), its rows into $OUT/e2e.duckdb;
#    evaluate:WORKLOAD[:MAX_S[:VARIANTS[:BATCHES]]]: llm4llm evaluate, e.g. eager,eager_graphs, at BATCHES ('+'
#    between sizes: 1+8+32 is --batch-sizes 1,8,32; a step per point set, so a slow one costs only itself); EVAL_ARGS:
#    extra options, e.g.
#    "--bundle docs/results/.../bundle_W --repeats 7" (a bundle an earlier call brought back in its logs);
#    gputest[:MAX_S]: the GPU-marked tests of the graph wrapper, the timing reference and the ops (pytest -m gpu;
#    GPUTEST_ARGS replaces the test paths, e.g. "tests/ops/test_linear.py");
#    TRACE_ARGS: extra trace_decode.py options, e.g. --decode-graphs;
#    E2E_MAX_S: the evaluate stage's time budget for its rounds (optimize --e2e-max-s), e.g. 150 on a slow host;
#    OPT_ARGS: extra optimize options, e.g. "--decode-graphs --accept-min-task-speedup 0"; OPT_ARGS_<workload> (its
#    '-' and '.' as '_', e.g. OPT_ARGS_llama_2_7b) replaces OPT_ARGS for that workload's optimize steps)
set -u
. scripts/gpu/env.sh
export LLM4LLM_TIMING_MIN_MS=60
LIMIT=${LIMIT:-570}
T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) - ${1:-0} )); }
# host and GPU memory every 10 s beside a run (a serving regime's extraction once went past the host's memory), and
# the sandboxed children's own lines (the extraction's step times, the verifier's and acceptance's notes; their last
# 2 MB), copied as it goes: a call stopped at its limit still brings them back. Run in the background: $! to kill.
watch_run() {
  ( while sleep 10; do echo "$(date +%T) host $(free -g | awk 'NR==2{print $3}') GB gpu" \
      "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"
      tail -c 2000000 "$LLM4LLM_HOME/logs/children.log" > "$OUT/logs/children_$1.log" 2>/dev/null
    done ) > "$OUT/logs/${2}_${1}_mem.log" 2>&1 &
}
for step in ${STEPS:-dispatch}; do
  IFS=: read -r kind w budget top max variants <<< "$step"
  # WORKLOAD: a name under examples/workloads, or a path to a TOML elsewhere (a config no example names, e.g. in a
  # results folder); logs are named by its file name
  wt=examples/workloads/$w.toml; case "$w" in */*) wt=$w; w=$(basename "$w" .toml) ;; esac
  s=$(date +%s)
  case "$kind" in
    gputest)
      timeout -k 5 "${w:-150}" python3 -m pytest -q -m gpu ${GPUTEST_ARGS:-tests/test_graphs.py tests/test_timing_reference.py tests/ops} \
        -p no:cacheprovider > "$OUT/logs/gputest.log" 2>&1
      echo "gpu tests rc=$? in $(( $(date +%s) - s ))s"; tail -4 "$OUT/logs/gputest.log" ;;
    dispatch)
      timeout -k 5 60 python3 scripts/gpu/dispatch_overhead.py --out "$OUT/dispatch.jsonl" > "$OUT/logs/dispatch.log" 2>&1
      echo "dispatch overhead rc=$? in $(( $(date +%s) - s ))s" ;;
    trace)  # trace:WORKLOAD: eager vs the newest bundle an optimize step of this call made for it (if any)
      b=$(ls -td /tmp/l4l/bundles/$w-* 2>/dev/null | head -1)
      timeout -k 5 "${budget:-180}" python3 scripts/gpu/trace_decode.py "$wt" --out "$OUT/logs/trace_$w" \
        ${b:+--bundle "$b"} ${TRACE_ARGS:-} > "$OUT/logs/trace_$w.log" 2>&1
      echo "trace $w (bundle ${b:-none}) rc=$? in $(( $(date +%s) - s ))s"; tail -6 "$OUT/logs/trace_$w.log" ;;
    evaluate)  # evaluate:WORKLOAD[:MAX_S[:VARIANTS[:BATCHES]]], BATCHES '+'-separated (1+8): one step a point set
      # without --bundle in EVAL_ARGS: the newest bundle an optimize step made for it on this machine, if any
      log="$OUT/logs/evaluate_$w${max:+_b$max}.log"; b=""
      case "${EVAL_ARGS:-}" in *--bundle*) ;; *) b=$(ls -td /tmp/l4l/bundles/$w-* 2>/dev/null | head -1) ;; esac
      t=$(left 25); [ "$t" -gt "${budget:-150}" ] && t=${budget:-150}
      if [ "$t" -lt 60 ]; then echo "evaluate $w skipped (${t}s left)"; continue; fi
      timeout -k 15 "$t" python3 -m llm4llm.cli evaluate "$wt" --db "$OUT/e2e.duckdb" \
        --variants "${top:-eager,eager_graphs}" ${max:+--batch-sizes ${max//+/,}} ${b:+--bundle "$b"} ${EVAL_ARGS:-} \
        > "$log" 2>&1
      echo "evaluate $w ${max:+batches ${max//+/,} }(bundle ${b:-as given}) rc=$? in $(( $(date +%s) - s ))s"
      tail -12 "$log" ;;
    readme)
      t=$(left 25); [ -n "${budget:-}" ] && [ "$t" -gt "$budget" ] && t=$budget
      if [ "$t" -lt 90 ]; then echo "$w skipped (${t}s left)"; continue; fi
      watch_run "$w" readme; mem=$!
      LLM4LLM_DB="$OUT/e2e.duckdb" timeout -k 15 "$t" python3 -m llm4llm.cli optimize "$wt" \
        > "$OUT/logs/readme_$w.log" 2>&1
      rc=$?; kill $mem 2>/dev/null
      tail -c 2000000 "$LLM4LLM_HOME/logs/children.log" > "$OUT/logs/children_$w.log" 2>/dev/null
      # the bundles it accepted (under $LLM4LLM_HOME), for `llm4llm evaluate --bundle` in a later call
      find "$LLM4LLM_HOME" -maxdepth 4 -type f -name manifest.json -path '*bundle*' 2>/dev/null \
        | xargs -r -n1 dirname | tar czf "$OUT/bundles_$w.tgz" -T - 2>/dev/null
      echo "readme $w rc=$rc in $(( $(date +%s) - s ))s (limit ${t}s), peak host $(sort -k3 -n \
        "$OUT/logs/readme_${w}_mem.log" | tail -1 | awk '{print $3}') GB"; tail -8 "$OUT/logs/readme_$w.log" ;;
    optimize)
      t=$(left 25); [ -n "${max:-}" ] && [ "$t" -gt "$max" ] && t=$max
      if [ "$t" -lt 90 ]; then echo "$w skipped (${t}s left)"; continue; fi
      key="OPT_ARGS_$(echo "$w" | tr '.-' '__')"; extra="${!key-${OPT_ARGS:-}}"
      watch_run "$w" optimize; mem=$!
      timeout -k 15 "$t" python3 -m llm4llm.cli optimize "$wt" --db "$OUT/e2e.duckdb" \
        --budget "${budget:-4}" --top "${top:-2}" --e2e-variants "${variants:-eager,patched,torch_compile}" ${E2E_MAX_S:+--e2e-max-s $E2E_MAX_S} $extra > "$OUT/logs/optimize_$w.log" 2>&1
      rc=$?; kill $mem 2>/dev/null
      tail -c 2000000 "$LLM4LLM_HOME/logs/children.log" > "$OUT/logs/children_$w.log" 2>/dev/null
      echo "optimize $w rc=$rc in $(( $(date +%s) - s ))s (limit ${t}s)"; grep -a "decode graphs\|accept: baseline" "$OUT/logs/optimize_$w.log" | tail -4 ;;
    *) echo "unknown step $step: expected dispatch, trace, evaluate, gputest, readme or optimize" ;;
  esac
done | tee "$OUT/logs/steps.txt"
python3 - "$OUT/e2e.duckdb" <<'PY' 2>&1 | tee "$OUT/logs/summary.txt"
import sys, duckdb
c = duckdb.connect(sys.argv[1], read_only=True)
q = lambda s: print(c.execute(s).df().to_string(max_colwidth=90))
q("select task_id, count(*) n, avg(passed::int) pass_rate, 1000 * min(ctx_p50_ms) filter (passed) best_us, "
  "1000 * median(ref_ctx_p50_ms) ref_us, median(ref_ctx_p50_ms) / min(ctx_p50_ms) filter (passed) best_x, "
  "any_value(failure_class) fail from candidates group by 1 order by 1")
q("select task_id, decision, left(reason, 110) reason, e2e_before_ms before, e2e_after_ms after, gain from acceptances")
q("select run_id, variant, prefill_ms pre, decode_ms_per_token dec, total_ms, compile_s, "
  "printf('%.3f (%.3f-%.3f)', vs_eager, vs_eager_p20, vs_eager_p80) vs_eager, "
  "printf('%.3f (%.3f-%.3f)', vs_eager_cpu, vs_eager_cpu_p20, vs_eager_cpu_p80) vs_eager_cpu, "
  "printf('%.3f (%.3f-%.3f)', vs_compile, vs_compile_p20, vs_compile_p80) vs_compile, gpu_step_ms step, "
  "hbm_floor_ms floor, gpu_step_ms / hbm_floor_ms step_x from e2e_results")
for r in c.execute("select variant, notes from e2e_results where variant like '%graphs'").fetchall():
    print(r[0], r[1][-300:])
PY
cat "$OUT/logs/dispatch.log" 2>/dev/null
[ -d /tmp/l4l/bundles ] && cp -r /tmp/l4l/bundles "$OUT/logs/bundles"  # the accepted bundles: evaluate --bundle later
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
