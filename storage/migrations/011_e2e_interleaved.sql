-- Interleaved end-to-end evaluation: each variant's ratio to eager and to torch.compile, taken round by round
-- (median and p20/p80 over the rounds), and the decode step's GPU time, host share and weight-streaming floor.
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS vs_eager DOUBLE;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS vs_eager_p20 DOUBLE;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS vs_eager_p80 DOUBLE;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS vs_compile DOUBLE;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS vs_compile_p20 DOUBLE;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS vs_compile_p80 DOUBLE;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS gpu_step_ms DOUBLE;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS host_overhead_ms DOUBLE;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS hbm_floor_ms DOUBLE;
ALTER TABLE e2e_results ADD COLUMN IF NOT EXISTS copy_gbps DOUBLE;
