-- Where each verification's wall time went, seconds by phase (references, load, checks, timing, timed_outputs,
-- total: the verdict's `seconds`): a serving regime's decode-layer trial took 142 s and nothing said where.
ALTER TABLE candidates ADD COLUMN IF NOT EXISTS seconds_json JSON;
