"""Where a decode step's time goes, unpatched vs patched: torch.profiler over the workload's own script.

    python3 scripts/gpu/trace_decode.py examples/workloads/recurrentgemma-2b.toml --bundle BUNDLE_DIR --out $OUT/trace

For each variant (eager; patched when --bundle is given) it runs the script once to warm up, then once under
torch.profiler (CPU + CUDA activities, record_shapes off) and writes `<variant>.json.gz` (a gzipped Chrome trace,
open in Perfetto) and `<variant>.txt` (the top ops by self CPU time and by CUDA time), plus `summary.json`: per
variant the wall time of the profiled run, the number of kernel launches and of device syncs (`cudaStreamSynchronize` /
`cudaDeviceSynchronize` / `cudaMemcpy*` device-to-host) seen in the trace. Questions it answers: does a patch add
launches or syncs to decode, and how much host time sits between kernels. On the CPU it runs too (a smoke run: no
CUDA activity).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
               "cudaMemcpy")
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def _count(prof, names: tuple[str, ...]) -> int:
    return sum(e.count for e in prof.key_averages() if e.key in names)


def trace(run, out_dir: str, variant: str, cuda: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    run()  # warm-up: allocator, Triton compilation, HF's lazy state
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=False) as prof:
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    raw = os.path.join(out_dir, f"{variant}.json")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:  # $OUT returns files of 16 MiB at most
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    if cuda:
        table += "\n\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    with open(os.path.join(out_dir, f"{variant}.txt"), "w") as f:
        f.write(table)
    return {"variant": variant, "wall_ms": wall_ms, "launches": _count(prof, LAUNCH_EVENTS),
            "graph_launches": _count(prof, ("cudaGraphLaunch",)),
            "syncs_and_copies": _count(prof, SYNC_EVENTS)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload")
    ap.add_argument("--bundle", default=None, help="patch bundle directory (adds the patched variant)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--decode-len", type=int, default=8, help="decode steps in the traced run (traces get large)")
    ap.add_argument("--skip-eager", action="store_true",
                    help="trace only the bundle's variants (an eager trace of a slow model fills the time limit)")
    ap.add_argument("--decode-graphs", action="store_true",
                    help="also eager_graphs (and patched_graphs with --bundle): decode steps replayed from CUDA graphs")
    args = ap.parse_args()
    if args.skip_eager and not args.bundle:  # before the model is built: a usage error costs no model load
        ap.error("--skip-eager: expected --bundle (nothing else to trace)")
    import kernels_runtime
    from kernels_runtime.interp import enable_fast_interpreter
    from llm4llm.workload import call_script, load_script, load_workload

    enable_fast_interpreter()  # a CPU smoke run (a no-op on the GPU)
    os.makedirs(args.out, exist_ok=True)
    wl = load_workload(args.workload).model_copy(update={"decode_len": args.decode_len})
    script = load_script(wl)
    model = call_script(script.build, wl)
    batch = call_script(script.inputs, wl)
    cuda = wl.device.startswith("cuda")

    def run():
        return call_script(script.run, model, wl, batch)

    rows = [] if args.skip_eager else [trace(run, args.out, "eager", cuda)]
    if args.decode_graphs and not args.skip_eager:
        g = kernels_runtime.enable_decode_graphs(model)
        try:
            rows.append(trace(run, args.out, "eager_graphs", cuda) | {"graphs": g.stats()})
        finally:
            kernels_runtime.disable_decode_graphs(model)
    if args.bundle:
        bundle = kernels_runtime.load_bundle(args.bundle)
        for graphs in (False, True) if args.decode_graphs else (False,):
            report = kernels_runtime.apply(model, bundle, decode_graphs=graphs)
            try:
                g = kernels_runtime.decode_graphs_of(model)
                rows.append(trace(run, args.out, "patched_graphs" if graphs else "patched", cuda)
                            | {"report": str(report)} | ({"graphs": g.stats()} if g is not None else {}))
            finally:
                kernels_runtime.revert(model)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"workload": wl.name, "decode_len": wl.decode_len, "device": wl.device, "rows": rows}, f, indent=1)
    print(f"{'variant':<16}{'wall ms':>10}{'launches':>10}{'graphs':>8}{'syncs/copies':>14}")
    for r in rows:
        print(f"{r['variant']:<16}{r['wall_ms']:>10.1f}{r['launches']:>10}{r['graph_launches']:>8}"
              f"{r['syncs_and_copies']:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
