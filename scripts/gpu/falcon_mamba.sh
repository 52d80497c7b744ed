#!/usr/bin/env bash
# One device call (carry [".whl", ".gpu/generality"]): a Falcon-Mamba-7B-shaped model (hidden 4096, LAYERS layers,
# the published config otherwise) through optimize's profile -> extract -> search -> accept, its mixer blocks only
# (--family ssm_block, both phases), decode graphs on: acceptance's baseline is the graphs-only model, so an accepted
# kernel is one that beats it. The evaluate stage is left out to fit the call; the DuckDB file comes back whatever
# finished (every trial and decision is written as it happens).
#   LAYERS=8 DECODE=32 LIMIT=125 bash scripts/gpu/falcon_mamba.sh
set -u
. scripts/gpu/env.sh
export LLM4LLM_TIMING_MIN_MS=${LLM4LLM_TIMING_MIN_MS:-60}
L=${LAYERS:-8}
W=examples/workloads/falcon-mamba-7b-L$L.toml
sed "s/num_hidden_layers = 64/num_hidden_layers = $L/; s/decode_len = 64/decode_len = ${DECODE:-32}/; \
s/name = \"falcon-mamba-7b\"/name = \"falcon-mamba-7b-L$L\"/" examples/workloads/falcon-mamba-7b.toml > "$W"
s=$(date +%s)
timeout -k 10 "${LIMIT:-125}" python3 scripts/gpu/falcon_mamba_optimize.py "$W" "$OUT/fm.duckdb" "${BUDGET:-1}" \
  > "$OUT/logs/optimize.log" 2>&1
echo "optimize rc=$? in $(( $(date +%s) - s ))s" | tee "$OUT/logs/steps.txt"
python3 - "$OUT/fm.duckdb" <<'PY' 2>&1 | tee "$OUT/logs/summary.txt"
import sys, duckdb
c = duckdb.connect(sys.argv[1], read_only=True)
q = lambda s: print(c.execute(s).df().to_string(max_colwidth=120))
q("select task_id, template, applicable, stage, pinned_json, left(reason, 80) reason from template_checks")
q("select task_id, template, passed, failure_class, 1000 * ctx_p50_ms cand_us, 1000 * ref_ctx_p50_ms ref_us, "
  "ref_ctx_p50_ms / ctx_p50_ms x, left(message, 80) msg from candidates")
q("select task_id, decision, left(reason, 160) reason, e2e_before_ms before, e2e_after_ms after, gain from acceptances")
PY
grep -a "decode graphs\|accept\|applicab\|left out\|Error\|error" "$OUT/logs/optimize.log" | tail -20
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
