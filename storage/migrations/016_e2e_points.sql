-- One end-to-end row per variant and (batch size, prompt length) point: `llm4llm evaluate --batch-sizes
-- --prompt-lens` measures a workload at several points in one run. The key grows by the point, so the table is
-- rebuilt (DuckDB cannot alter a primary key). Earlier rows measured their workload's own point and take it from
-- the workload's config; 0 marks a row whose point is not recorded (a bench script's rows). Also new: the decode
-- step's p20-p80 over the rounds and the decode throughput (batch x decoded tokens / decode time).
CREATE TABLE e2e_results_rebuilt (
    run_id          VARCHAR NOT NULL,
    workload_hash   VARCHAR NOT NULL,
    variant         VARCHAR NOT NULL,
    batch_size      INTEGER NOT NULL DEFAULT 0,
    prompt_len      INTEGER NOT NULL DEFAULT 0,
    prefill_ms      DOUBLE,
    decode_ms_per_token DOUBLE,
    total_ms        DOUBLE,
    tokens_per_s    DOUBLE,
    peak_mem_mb     DOUBLE,
    compile_s       DOUBLE,
    repeats         INTEGER,
    gpu_name        VARCHAR,
    versions_json   JSON,
    notes           VARCHAR,
    created_at      TIMESTAMP NOT NULL DEFAULT current_timestamp,
    total_samples_ms JSON,
    prefill_samples_ms JSON,
    vs_eager DOUBLE, vs_eager_p20 DOUBLE, vs_eager_p80 DOUBLE,
    vs_compile DOUBLE, vs_compile_p20 DOUBLE, vs_compile_p80 DOUBLE,
    gpu_step_ms DOUBLE,
    host_overhead_ms DOUBLE,
    hbm_floor_ms DOUBLE,
    copy_gbps DOUBLE,
    cpu_samples_ms JSON,
    vs_eager_cpu DOUBLE, vs_eager_cpu_p20 DOUBLE, vs_eager_cpu_p80 DOUBLE,
    decode_ms_p20 DOUBLE,
    decode_ms_p80 DOUBLE,
    decode_tokens_per_s DOUBLE,
    PRIMARY KEY (run_id, variant, batch_size, prompt_len)
);
INSERT INTO e2e_results_rebuilt (run_id, workload_hash, variant, batch_size, prompt_len, prefill_ms, decode_ms_per_token,
    total_ms, tokens_per_s, peak_mem_mb, compile_s, repeats, gpu_name, versions_json, notes, created_at,
    total_samples_ms, prefill_samples_ms, vs_eager, vs_eager_p20, vs_eager_p80, vs_compile, vs_compile_p20,
    vs_compile_p80, gpu_step_ms, host_overhead_ms, hbm_floor_ms, copy_gbps, cpu_samples_ms, vs_eager_cpu,
    vs_eager_cpu_p20, vs_eager_cpu_p80)
SELECT e.run_id, e.workload_hash, e.variant,
    coalesce(TRY_CAST(w.config_json ->> 'batch_size' AS INTEGER), CASE WHEN w.workload_hash IS NULL THEN 0 ELSE 1 END),
    coalesce(TRY_CAST(w.config_json ->> 'prompt_len' AS INTEGER), 0),
    e.prefill_ms, e.decode_ms_per_token, e.total_ms, e.tokens_per_s, e.peak_mem_mb, e.compile_s, e.repeats,
    e.gpu_name, e.versions_json, e.notes, e.created_at, e.total_samples_ms, e.prefill_samples_ms, e.vs_eager,
    e.vs_eager_p20, e.vs_eager_p80, e.vs_compile, e.vs_compile_p20, e.vs_compile_p80, e.gpu_step_ms,
    e.host_overhead_ms, e.hbm_floor_ms, e.copy_gbps, e.cpu_samples_ms, e.vs_eager_cpu, e.vs_eager_cpu_p20,
    e.vs_eager_cpu_p80
FROM e2e_results e LEFT JOIN workloads w USING (workload_hash);
DROP TABLE e2e_results;
ALTER TABLE e2e_results_rebuilt RENAME TO e2e_results;
