"""One decode candidate and its module timed every way the project times them, side by side in one process: why a
task-level GPU time disagrees with what the kernel does in the model.

    python scripts/gpu/task_timing_check.py examples/workloads/mamba2-2.7b.toml \
        --template ssm_mixer.mamba2_decode_fused --out $OUT/task_timing.json

Profiles and extracts the workload, takes the hottest decode task the template applies to, renders the template
(its default config, or --config JSON) and times, for the candidate (installed in a copy of the module through
kernels_runtime's dispatch, as the verifier times it) and for the module's own forward:
- cold and in_context back to back (llm4llm.verify.timing.time_call: CUDA events around each call, host gaps
  included, so an upper bound on the GPU time);
- under CUDA-graph replay (timing.time_call_graph, one copy of the module; `optimize` times decode tasks with
  timing.time_graphs, which also cycles weight copies and alternates with the reference), three times in a row;
- the device time of the kernels themselves (torch.profiler, CUPTI) over --calls eager calls: no gaps, no replay.
Where replay and back-to-back timings disagree, the kernels' device time says which one is right. Without CUDA
(a smoke run) each callable runs once and nothing is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402


def kernel_time_us(fn, call, calls: int) -> tuple[float, float]:
    """(device µs per call summed over its kernels, kernels per call) from torch.profiler over `calls` calls."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(call)
        torch.cuda.synchronize()
    total, n = 0.0, 0
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            t = getattr(e, "device_time", None)
            total += t if t is not None else getattr(e, "cuda_time", 0.0)
            n += 1
    return total / calls, n / calls


def main() -> int:
    args, t, override = _parse_args()
    from llm4llm.stages.extract import extract_to_temp
    from llm4llm.taskspec import load_task
    from llm4llm.verify import timing
    from llm4llm.verify.gates import make_draws
    from llm4llm.workload import load_workload

    tasks = extract_to_temp(args.workload, "task_timing-")
    fits = [k for k in tasks if k.spec.phase == "decode" and k.spec.deployable and t.why_not(k.spec) is None]
    if not fits:
        print(f"no decode task of {args.workload} fits {t.name}", file=sys.stderr)
        return 1
    task = load_task(max(fits, key=lambda k: k.spec.hotspot_score).path)
    config = {**t.default(task.spec), **override}
    source = t.render(task.spec, config)
    dev = torch.device(load_workload(args.workload).device)
    cuda = dev.type == "cuda"
    weights = [float(max(c.calls, 1)) for c in task.spec.cases]
    k = max(range(len(task.cases)), key=lambda i: weights[i])  # the most frequent captured shape
    call_args = [(d.inputs, d.weights, d.state, task.spec.static) for d in make_draws(task, dev, 3, 0)
                 if d.key[0] == k]
    cand_fn, cand_prep, kernel_calls = timing.patched_call(task, source, dev)
    ref_fn, ref_prep = timing.module_call(task, dev)
    rows = [_time_side(who, fn, prep, call_args, dev, args.calls)
            for who, fn, prep in (("candidate", cand_fn, cand_prep), ("reference", ref_fn, ref_prep))]
    rows[0]["kernel_calls"] = kernel_calls()  # 0: every patched call fell back (the numbers are the module's)
    out = {"workload": args.workload, "task": task.spec.task_id, "template": t.name, "config": config,
           "case": k, "device": str(dev), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    _print_rows(rows, cuda)
    return 0


def _parse_args():
    """(arguments, the decode template, its config override); a usage error before anything runs."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload")
    ap.add_argument("--template", required=True, help="decode template name")
    ap.add_argument("--config", default=None, help="JSON object over the template's default config")
    ap.add_argument("--calls", type=int, default=50, help="eager calls under the profiler")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from llm4llm.search.templates import TEMPLATES

    t = next((t for t in TEMPLATES if t.name == args.template), None)
    if t is None or "decode" not in t.phases:
        ap.error(f"template: expected a decode template of {sorted(t.name for t in TEMPLATES if 'decode' in t.phases)}"
                 f", got {args.template!r}")
    try:
        override = json.loads(args.config) if args.config else {}
        if not isinstance(override, dict):
            raise ValueError("not an object")
    except ValueError as e:
        ap.error(f"--config: expected a JSON object, got {args.config!r} ({e})")
    return args, t, override


def _time_side(who: str, fn, prep, call_args, dev: torch.device, calls: int) -> dict:
    """One side's row: on CUDA its cold, in-context and graph p50s and its kernels' device time per call; else one
    call, to show it runs."""
    from llm4llm.verify import timing

    row = {"who": who}
    if dev.type == "cuda":
        row["cold_p50_ms"] = timing.time_call(fn, call_args, "cold", dev, prepare=prep).p50
        row["in_context_p50_ms"] = timing.time_call(fn, call_args, "in_context", dev, prepare=prep).p50
        row["graph_p50_ms"] = [timing.time_call_graph(fn, call_args, dev, prepare=prep).p50 for _ in range(3)]
        call, cleanup = prep(*timing._clone_args(call_args[0]))
        try:
            for _ in range(5):
                fn(call)
            us, kernels = kernel_time_us(fn, call, calls)
        finally:
            cleanup()
        row["kernel_device_ms"], row["kernels_per_call"] = us / 1e3, kernels
    else:
        call, cleanup = prep(*timing._clone_args(call_args[0]))
        try:
            fn(call)
        finally:
            cleanup()
        row["timing"] = "skipped: no CUDA device"
    return row


def _print_rows(rows: list[dict], cuda: bool) -> None:
    for r in rows:
        if cuda:
            print(f"{r['who']:9s} cold {r['cold_p50_ms']:.4f}  in_context {r['in_context_p50_ms']:.4f}  graph "
                  f"{' / '.join(f'{x:.4f}' for x in r['graph_p50_ms'])}  kernels {r['kernel_device_ms']:.4f} ms "
                  f"({r['kernels_per_call']:.1f} per call)")
        else:
            print(r)
    if cuda:
        c, ref = rows
        by_graph = statistics.median(ref["graph_p50_ms"]) / statistics.median(c["graph_p50_ms"])
        print(f"speedup by graph replay {by_graph:.3f}x, "
              f"by kernel device time {ref['kernel_device_ms'] / c['kernel_device_ms']:.3f}x")


if __name__ == "__main__":
    sys.exit(main())
