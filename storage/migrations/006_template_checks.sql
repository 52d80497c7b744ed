-- Applicability of each built-in template to a task, decided before any trial by running the template's default
-- config (and its option variants) on the task's captured cases against the module's own outputs
-- (llm4llm/search/applicability.py). stage: scope (ruled out before running: family, phase, ops, call structure)
-- | computation. pinned_json: the option values that matched (e.g. Falcon-Mamba's dt/B/C norms).
CREATE TABLE IF NOT EXISTS template_checks (
    task_id         VARCHAR NOT NULL,
    template        VARCHAR NOT NULL,
    run_id          VARCHAR,
    applicable      BOOLEAN NOT NULL,
    stage           VARCHAR NOT NULL,
    failure_class   VARCHAR,
    reason          VARCHAR,
    pinned_json     JSON,
    code_version    VARCHAR,
    checked_at      TIMESTAMP NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (task_id, template)
);
