-- Every flow run is a run of its own: `runs.kind` says what started it (nightly | manual | on-change | cli; rows
-- written before this migration say `profile`), `profile_of` (003) names the run whose cached profile it reused, and
-- `flow_run_id` the Prefect flow run (the top-level one) it belongs to. `finished_at` and `status` are set when the
-- run ends (ok | failed | running while it goes).
ALTER TABLE runs ADD COLUMN IF NOT EXISTS flow_run_id VARCHAR;
