"""Warm torch.compile's caches for KernelBench problems in parallel processes before a timed run (GPU only).

Inductor keeps compiled graphs and kernels on disk; the timed run's own torch.compile of each problem then loads
them instead of compiling (minutes over 50 problems). Nothing here is timed or recorded.
Usage: python scripts/kb_precompile.py DIR [--procs 8] [--problems 12,40-60]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from pathlib import Path


def _one(path: str) -> str:
    import torch

    from llm4llm.kernelbench.problem import SEED, build_model, inputs_for, load_module
    from llm4llm.kernelbench.protocol import strict_fp32

    strict_fp32()
    try:
        mod = load_module(Path(path).read_text())
        model = build_model(mod, "cuda")
        with torch.device("cuda"):
            inputs = inputs_for(mod, SEED, "cuda")
        with torch.no_grad():
            torch.compile(model)(*inputs)
        torch.cuda.synchronize()
        return f"ok {Path(path).name}"
    except Exception as e:  # noqa: BLE001 - the timed run records the failure itself
        return f"fail {Path(path).name}: {type(e).__name__}: {str(e)[:200]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--problems", default=None)
    a = ap.parse_args()
    from llm4llm.kernelbench.problem import select

    files = [str(f) for f in select(Path(a.dir), a.problems)]
    with mp.get_context("spawn").Pool(a.procs) as pool:
        for line in pool.imap_unordered(_one, files):
            print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
