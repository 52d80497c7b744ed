-- TileMix's accuracy/efficiency frontier (scripts/gpu/tilemix_bench.py frontier): one row per prompt length x
-- routing (SDPA flash, all 16-bit = our 0 %, all INT8 = 100 %, each template at each coverage) of one bench run.
-- run_id / workload_name tie a bench to what `llm4llm report` shows (NULL: not tied to either); the report shows the
-- latest bench of the run, else of its workload.
CREATE TABLE IF NOT EXISTS tilemix_frontier (
    bench_id        VARCHAR NOT NULL,
    run_id          VARCHAR,
    workload_name   VARCHAR,
    seq_len         INTEGER NOT NULL,
    batch           INTEGER NOT NULL,
    variant         VARCHAR NOT NULL,           -- sdpa_flash | <template>@<coverage>
    template        VARCHAR NOT NULL,           -- sdpa_flash | all_16bit | all_int8 | sink_local | bigbird | row_random
    coverage        DOUBLE,                     -- requested INT8 coverage (NULL for SDPA)
    realised_coverage DOUBLE,                   -- INT8 share of the visible tile groups at seq_len
    heads_q         INTEGER,
    heads_kv        INTEGER,
    head_dim        INTEGER,
    p20_ms DOUBLE, p50_ms DOUBLE, p80_ms DOUBLE,
    samples         INTEGER,
    tokens_per_s    DOUBLE,
    tflops          DOUBLE,
    vs_sdpa         DOUBLE,                     -- SDPA flash p50 / this p50
    vs_0pct         DOUBLE,
    vs_100pct       DOUBLE,
    rel_err_fp32    DOUBLE,                     -- output rel-L2 against fp32 attention of the same inputs
    gpu_name        VARCHAR,
    versions_json   JSON,
    created_at      TIMESTAMP NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (bench_id, seq_len, batch, variant)
);
