"""Host cost of one kernel launch on the GPU machine, by launch path: the number that decides decode (a decode step
is host-bound). Whole-op timings (a Triton RMSNorm call, HF's multi-op RMSNorm: docs/results/2026-11-30-h200-b) mix
several costs; this script measures a lone launch per path.

    python3 scripts/gpu/launch_overhead.py --out launch.jsonl

Per path, N launches back to back with one synchronize at the end (microseconds per launch, median of 5):
- torch: `y.copy_(x)` (one ATen kernel);
- triton_jit: a trivial Triton copy kernel through `kernel[grid](...)` (binder, specialisation key, cache lookup);
- triton_compiled: the same compiled kernel through `CompiledKernel[grid](...)` (no binder, no key);
- triton_compiled_run: its raw `run(...)` with the launch metadata precomputed once (what a cached launcher would do);
- cuda_graph: N triton_jit launches captured once in a CUDA graph, replayed (per launch inside the graph).
Each path is measured on its own; one that fails on this Triton version is a row with its error.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton
import triton.language as tl
from dispatch_overhead import back_to_back_us as per_launch_us  # same directory: N calls, one synchronize


@triton.jit
def _copy_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("launch_overhead: expected a CUDA device")
    x = torch.randn(2560, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    n, block = x.numel(), 1024
    grid = (triton.cdiv(n, block),)
    paths = {}
    paths["torch"] = lambda: y.copy_(x)
    paths["triton_jit"] = lambda: _copy_kernel[grid](x, y, n, BLOCK=block)
    try:
        compiled = _copy_kernel[grid](x, y, n, BLOCK=block)  # a launch returns its CompiledKernel
        runner = compiled[grid]
        paths["triton_compiled"] = lambda: runner(x, y, n)
        from triton.runtime import driver

        stream = driver.active.get_current_stream(driver.active.get_current_device())
        meta = compiled.launch_metadata(grid, stream, x, y, n)
        paths["triton_compiled_run"] = lambda: compiled.run(grid[0], 1, 1, stream, compiled.function,
                                                            compiled.packed_metadata, meta, None, None, x, y, n)
    except Exception as e:  # noqa: BLE001 - the API differs between Triton versions: a row, not a crash
        paths["triton_compiled"] = e
    rows = []
    for name, fn in paths.items():
        if isinstance(fn, Exception):
            rows.append({"path": name, "us_per_launch": None, "error": f"{type(fn).__name__}: {fn}"})
            continue
        try:
            us = statistics.median(per_launch_us(fn, args.calls) for _ in range(5))
            ok = torch.equal(y, x)
            rows.append({"path": name, "us_per_launch": us, "correct": ok})
        except Exception as e:  # noqa: BLE001
            rows.append({"path": name, "us_per_launch": None, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    try:  # CUDA graph of `k` JIT launches, replayed
        k = 100
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                _copy_kernel[grid](x, y, n, BLOCK=block)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(k):
                _copy_kernel[grid](x, y, n, BLOCK=block)
        us = statistics.median(per_launch_us(g.replay, max(args.calls // k, 20)) for _ in range(5)) / k
        rows.append({"path": "cuda_graph", "us_per_launch": us, "correct": bool(torch.equal(y, x))})
    except Exception as e:  # noqa: BLE001
        rows.append({"path": "cuda_graph", "us_per_launch": None, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    gpu = torch.cuda.get_device_name()
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
                                "calls": args.calls}) + "\n")
    print(f"{'path':<22}{'us/launch':>10}")
    for r in rows:
        v = f"{r['us_per_launch']:.2f}" if r["us_per_launch"] is not None else r.get("error", "")[:80]
        print(f"{r['path']:<22}{v:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
