-- The planner's decision per task (llm4llm/planner.py: which tasks a run searches, why, with how many trials, the
-- saving it expected) and the time each stage of a run took (what the next run of the workload plans with).
CREATE TABLE IF NOT EXISTS plans (
    run_id          VARCHAR NOT NULL,
    step            INTEGER NOT NULL,           -- 0: the plan made after extraction; k: made again after step k
    rank            INTEGER NOT NULL,
    task_id         VARCHAR NOT NULL,
    family          VARCHAR NOT NULL,
    phase           VARCHAR NOT NULL,
    score           DOUBLE NOT NULL,
    speedup         DOUBLE NOT NULL,            -- the speedup expected of the task's best candidate
    saving          DOUBLE NOT NULL,            -- expected end-to-end saving, a fraction of the workload's time
    action          VARCHAR NOT NULL,           -- search | searched | fallback | skip
    reason          VARCHAR NOT NULL,
    trials          INTEGER NOT NULL,           -- planned trials (search)
    parent          VARCHAR,                    -- fallback: the task searched whole that it sits in
    budget_s        DOUBLE,                     -- the run's time budget (NULL: none)
    search_s        DOUBLE,                     -- seconds the plan gave the search
    created_at      TIMESTAMP NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (run_id, step, task_id)
);

CREATE TABLE IF NOT EXISTS stage_times (
    run_id          VARCHAR NOT NULL,
    workload_name   VARCHAR NOT NULL,
    device          VARCHAR NOT NULL,
    seq             INTEGER NOT NULL,           -- order within the run
    stage           VARCHAR NOT NULL,           -- profile | extract | plan | search | accept | evaluate
    note            VARCHAR,
    start_s         DOUBLE NOT NULL,            -- seconds since the run started
    seconds         DOUBLE NOT NULL,
    trials          INTEGER,                    -- search: trials verified in this span
    started_at      TIMESTAMP,
    PRIMARY KEY (run_id, seq)
);
