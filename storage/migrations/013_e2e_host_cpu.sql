-- The main thread's CPU time of each timed full run, and each variant's ratio to eager taken on it round by round:
-- where a host deschedules or preempts the thread it leaves that time out, which the wall-clock ratio carries.
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS cpu_samples_ms JSON;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS vs_eager_cpu DOUBLE;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS vs_eager_cpu_p20 DOUBLE;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS vs_eager_cpu_p80 DOUBLE;
