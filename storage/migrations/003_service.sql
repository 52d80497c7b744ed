-- The service: every night its own run (a profile served from the cache is recorded again; profile_of names the run
-- that measured it), bundles versioned per workload and never overwritten, one `current` pointer per workload, and
-- each night's re-validation of the bundle in service and its keep / replace / rollback decision with the reason.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS profile_of VARCHAR;

CREATE TABLE IF NOT EXISTS bundle_versions (
    workload_name   VARCHAR NOT NULL,
    version         INTEGER NOT NULL,           -- 1, 2, ... per workload
    run_id          VARCHAR NOT NULL,           -- the run whose acceptance produced it
    workload_hash   VARCHAR NOT NULL,
    bundle_path     VARCHAR NOT NULL,           -- an immutable copy: <data>/bundles/<workload>/v<NNNN>
    digest          VARCHAR NOT NULL,
    created_at      TIMESTAMP NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (workload_name, version)
);

CREATE TABLE IF NOT EXISTS bundle_current (
    workload_name   VARCHAR PRIMARY KEY,
    version         INTEGER,                    -- NULL: no bundle in service
    run_id          VARCHAR NOT NULL,           -- the run that set it
    updated_at      TIMESTAMP NOT NULL
);

CREATE TABLE IF NOT EXISTS bundle_validations (
    run_id          VARCHAR NOT NULL,
    workload_name   VARCHAR NOT NULL,
    subject         VARCHAR NOT NULL,           -- current | candidate | fallback
    version         INTEGER,                    -- NULL for tonight's candidate (not yet versioned)
    bundle_path     VARCHAR NOT NULL,
    ok              BOOLEAN NOT NULL,
    correctness     VARCHAR NOT NULL,           -- ok | failed: ... | runtime: ... | unreadable: ...
    latency         VARCHAR NOT NULL,           -- ok | regressed | skipped: cpu | not measured
    unpatched_ms    DOUBLE,
    patched_ms      DOUBLE,
    gain            DOUBLE,
    reason          VARCHAR NOT NULL,
    versions_json   JSON,                       -- torch, triton, driver, GPU tonight vs the bundle's own
    created_at      TIMESTAMP NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (run_id, subject, bundle_path)
);

CREATE TABLE IF NOT EXISTS service_decisions (
    run_id          VARCHAR PRIMARY KEY,
    workload_name   VARCHAR NOT NULL,
    decision        VARCHAR NOT NULL,           -- keep | replace | rollback
    from_version    INTEGER,
    to_version      INTEGER,
    reason          VARCHAR NOT NULL,
    created_at      TIMESTAMP NOT NULL DEFAULT current_timestamp
);
