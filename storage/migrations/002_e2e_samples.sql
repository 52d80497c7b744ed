-- Every timed run behind an end-to-end row's medians (ms, in the order measured), so the spread is on record next to
-- the median: on the H200 (2026-11-30-h200-i) eager Mamba-130M totals moved between 1593 and 1949 ms across calls of
-- one session while the patched runs stayed at 48-50 ms.
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS total_samples_ms JSON;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS prefill_samples_ms JSON;
