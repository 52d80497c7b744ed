-- The main thread's CPU time of each timed full run, and each variant's ratio to eager taken on it round by round:
-- in a host-bound decode it is the patch's own host cost, where the wall-clock ratio also carries the host's
-- contention (eager's runs spread 45 % within one call on the H200, 2026-12-03-h200-f).
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS cpu_samples_ms JSON;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS vs_eager_cpu DOUBLE;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS vs_eager_cpu_p20 DOUBLE;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS vs_eager_cpu_p80 DOUBLE;
