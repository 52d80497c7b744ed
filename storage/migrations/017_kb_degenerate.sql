-- KernelBench's degenerate problems: a problem whose reference output is the same for every trial's inputs (the
-- output ignores them) is flagged on its judged candidates and on its result row, and reported apart: its speedup
-- measures how fast a constant is written, not the kernel the problem describes.
ALTER TABLE candidates ADD COLUMN IF NOT EXISTS kb_degenerate BOOLEAN;
ALTER TABLE kernelbench_results ADD COLUMN IF NOT EXISTS degenerate BOOLEAN;
