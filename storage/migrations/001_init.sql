-- llm4llm schema v1. Every table keyed by text ids; JSON columns hold small structured values.
CREATE TABLE IF NOT EXISTS workloads (
    workload_hash   VARCHAR PRIMARY KEY,
    name            VARCHAR NOT NULL,
    path            VARCHAR NOT NULL,
    config_json     JSON NOT NULL,
    first_seen      TIMESTAMP NOT NULL DEFAULT current_timestamp
);

CREATE TABLE IF NOT EXISTS runs (
    run_id          VARCHAR PRIMARY KEY,
    workload_hash   VARCHAR NOT NULL,
    workload_name   VARCHAR NOT NULL,
    kind            VARCHAR NOT NULL,           -- profile | optimize | search | evaluate
    status          VARCHAR NOT NULL,           -- ok | failed
    started_at      TIMESTAMP NOT NULL,
    finished_at     TIMESTAMP,
    device          VARCHAR,
    gpu_name        VARCHAR,
    capability      VARCHAR,
    torch_version   VARCHAR,
    triton_version  VARCHAR,
    transformers_version VARCHAR,
    timer           VARCHAR,
    prefill_ms      DOUBLE,
    decode_ms       DOUBLE,
    prefill_forwards INTEGER,
    decode_forwards INTEGER,
    artifact_dir    VARCHAR,
    error           VARCHAR
);

CREATE TABLE IF NOT EXISTS profiles (
    run_id          VARCHAR NOT NULL,
    phase           VARCHAR NOT NULL,
    module_path     VARCHAR NOT NULL,
    class_name      VARCHAR NOT NULL,
    family          VARCHAR NOT NULL,
    depth           INTEGER NOT NULL,
    calls           INTEGER NOT NULL,
    time_ms         DOUBLE NOT NULL,
    share           DOUBLE NOT NULL,
    hotspot_score   DOUBLE NOT NULL,
    in_shapes       JSON,
    out_shapes      JSON,
    PRIMARY KEY (run_id, phase, module_path)
);

CREATE TABLE IF NOT EXISTS tasks (
    task_id         VARCHAR NOT NULL,
    run_id          VARCHAR NOT NULL,
    family          VARCHAR NOT NULL,
    module_class    VARCHAR NOT NULL,
    phase           VARCHAR NOT NULL,
    instances       INTEGER NOT NULL,
    shapes          JSON NOT NULL,
    dtype           VARCHAR NOT NULL,
    artifact_path   VARCHAR,
    score           DOUBLE NOT NULL,
    time_ms         DOUBLE,
    deployable      BOOLEAN NOT NULL,
    reason          VARCHAR,
    PRIMARY KEY (task_id, run_id)
);

CREATE TABLE IF NOT EXISTS candidates (
    candidate_id    VARCHAR NOT NULL,           -- sha256 of the source (first 16 hex)
    task_id         VARCHAR NOT NULL,
    search_id       VARCHAR NOT NULL,
    episode         INTEGER NOT NULL,
    iteration       INTEGER NOT NULL,
    proposer        VARCHAR NOT NULL,
    template        VARCHAR,
    parent_id       VARCHAR,
    config_json     JSON,
    source_path     VARCHAR,
    passed          BOOLEAN NOT NULL,
    failure_class   VARCHAR,
    message         VARCHAR,
    max_abs_err     DOUBLE,
    max_rel_err     DOUBLE,
    cold_p20_ms DOUBLE, cold_p50_ms DOUBLE, cold_p80_ms DOUBLE,
    ctx_p20_ms DOUBLE, ctx_p50_ms DOUBLE, ctx_p80_ms DOUBLE,
    ref_cold_p50_ms DOUBLE, ref_ctx_p50_ms DOUBLE,
    speedup_cold    DOUBLE,
    speedup_in_context DOUBLE,
    utility         DOUBLE NOT NULL,
    gates_json      JSON,
    worker          VARCHAR,
    gpu_name        VARCHAR,
    created_at      TIMESTAMP NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (search_id, episode, iteration, candidate_id)
);

CREATE TABLE IF NOT EXISTS searches (
    search_id       VARCHAR PRIMARY KEY,
    task_id         VARCHAR NOT NULL,
    run_id          VARCHAR,
    mode            VARCHAR NOT NULL,
    proposer        VARCHAR NOT NULL,
    budget          INTEGER NOT NULL,
    trials          INTEGER NOT NULL,
    passed          INTEGER NOT NULL,
    best_candidate_id VARCHAR,
    best_utility    DOUBLE,
    started_at      TIMESTAMP NOT NULL,
    finished_at     TIMESTAMP
);

CREATE TABLE IF NOT EXISTS episodes (
    search_id       VARCHAR NOT NULL,
    episode         INTEGER NOT NULL,
    trials          INTEGER NOT NULL,
    passed          INTEGER NOT NULL,
    best_utility    DOUBLE,
    transcript_path VARCHAR,
    PRIMARY KEY (search_id, episode)
);

CREATE TABLE IF NOT EXISTS experience (
    task_id         VARCHAR NOT NULL,
    search_id       VARCHAR NOT NULL,
    episode         INTEGER NOT NULL,
    record_json     JSON NOT NULL,
    created_at      TIMESTAMP NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (search_id, episode)
);

CREATE TABLE IF NOT EXISTS llm_calls (
    call_id         VARCHAR PRIMARY KEY,
    search_id       VARCHAR,
    task_id         VARCHAR,
    model           VARCHAR NOT NULL,
    prompt_tokens   INTEGER,
    completion_tokens INTEGER,
    cost_usd        DOUBLE,
    latency_ms      DOUBLE,
    status          VARCHAR NOT NULL,
    error           VARCHAR,
    attempt         INTEGER,
    created_at      TIMESTAMP NOT NULL DEFAULT current_timestamp
);

CREATE TABLE IF NOT EXISTS acceptances (
    acceptance_id   VARCHAR PRIMARY KEY,
    run_id          VARCHAR NOT NULL,
    task_id         VARCHAR NOT NULL,
    candidate_id    VARCHAR NOT NULL,
    decision        VARCHAR NOT NULL,           -- accepted | rejected
    reason          VARCHAR,
    metric          VARCHAR,
    in_model_max_abs_err DOUBLE,
    e2e_before_ms   DOUBLE,
    e2e_after_ms    DOUBLE,
    gain            DOUBLE,
    created_at      TIMESTAMP NOT NULL DEFAULT current_timestamp
);

CREATE TABLE IF NOT EXISTS patches (
    bundle_id       VARCHAR PRIMARY KEY,
    run_id          VARCHAR NOT NULL,
    workload_hash   VARCHAR NOT NULL,
    bundle_path     VARCHAR NOT NULL,
    manifest_json   JSON NOT NULL,
    created_at      TIMESTAMP NOT NULL DEFAULT current_timestamp
);

CREATE TABLE IF NOT EXISTS e2e_results (
    run_id          VARCHAR NOT NULL,
    workload_hash   VARCHAR NOT NULL,
    variant         VARCHAR NOT NULL,           -- eager | torch_compile | patched
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
    PRIMARY KEY (run_id, variant)
);

CREATE TABLE IF NOT EXISTS op_benchmarks (
    bench_id        VARCHAR NOT NULL,
    op              VARCHAR NOT NULL,
    provider        VARCHAR NOT NULL,           -- triton | reference | ...
    shape           VARCHAR NOT NULL,
    dtype           VARCHAR NOT NULL,
    p20_ms DOUBLE, p50_ms DOUBLE, p80_ms DOUBLE,
    gbps            DOUBLE,
    tflops          DOUBLE,
    max_abs_err     DOUBLE,
    gpu_name        VARCHAR,
    versions_json   JSON,
    created_at      TIMESTAMP NOT NULL DEFAULT current_timestamp
);
