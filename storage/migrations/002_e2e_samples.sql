-- Every timed run behind an end-to-end row's medians (ms, in the order measured), so the spread is on record next to
-- the median: eager Mamba-130M totals have moved between 1593 and 1949 ms across the calls of one session while the
-- patched runs stayed at 48-50 ms.
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS total_samples_ms JSON;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS prefill_samples_ms JSON;
