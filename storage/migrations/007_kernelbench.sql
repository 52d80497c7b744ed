-- KernelBench mode (issue 22): each candidate's origin (template | rewrite | llm), KernelBench's torch.compile
-- baseline beside the eager one, and the means behind the speedups (KernelBench's runtime is a mean); one row per
-- problem and kernelbench run with the best passing candidate, so the table, pass rate, fast_1/fast_compile and
-- the search-mode curves all come from SQL.
ALTER TABLE candidates ADD COLUMN IF NOT EXISTS origin VARCHAR;
ALTER TABLE candidates ADD COLUMN IF NOT EXISTS speedup_compile DOUBLE;
ALTER TABLE candidates ADD COLUMN IF NOT EXISTS kb_means_json JSON;

CREATE TABLE IF NOT EXISTS kernelbench_results (
    kb_run_id        VARCHAR NOT NULL,
    problem          VARCHAR NOT NULL,           -- file name, e.g. 12_Gemm_Multiply_LeakyReLU.py
    problem_id       INTEGER NOT NULL,
    task_id          VARCHAR NOT NULL,
    search_id        VARCHAR,
    mode             VARCHAR NOT NULL,           -- episodic | sample | iter
    proposer         VARCHAR NOT NULL,
    budget           INTEGER NOT NULL,
    trials           INTEGER NOT NULL,
    passed           BOOLEAN NOT NULL,           -- a candidate passed every gate
    best_candidate_id VARCHAR,
    origin           VARCHAR,
    eager_ms         DOUBLE,                     -- means over KernelBench's cuda_event trials
    compile_ms       DOUBLE,
    candidate_ms     DOUBLE,
    speedup_eager    DOUBLE,
    speedup_compile  DOUBLE,
    gpu_name         VARCHAR,
    skipped_reason   VARCHAR,                    -- why no trial ran (no template covers the graph)
    created_at       TIMESTAMP NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (kb_run_id, problem, mode)
);
