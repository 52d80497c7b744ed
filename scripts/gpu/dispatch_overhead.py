"""What kernels_runtime's dispatch costs per call on the GPU (issue "Deployment-time acceptance": target < 5 us).

    python scripts/gpu/dispatch_overhead.py --out dispatch.jsonl

Two measurements on decode-sized modules (one token: a kernel launch is a few microseconds, so host time is what a
dispatch adds to a decode step):

1. identity: the module patched with a kernel that returns its input (kernels_runtime.patch.dispatch_overhead_us):
   phase decision, boundary capture, guards, output packing and counters, no GPU work; called back to back and
   compared with a pass-through module (the module call itself): the difference is the dispatch's host time.
   (Until 2026-12 this was timed with a synchronize around every call, which added the synchronize's own latency.)
2. real kernel: the same Triton op called directly vs through the patched module, N calls back to back with one
   synchronize at the end (how a decode step issues them). The difference per call is the dispatch overhead paid
   on the GPU path.

Medians of 5 repeats; writes one JSON line per (module, measurement).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from kernels_runtime.bundle import PatchBundle, PatchSpec  # noqa: E402
from kernels_runtime.patch import apply, dispatch_overhead_us, revert  # noqa: E402

RMSNORM_KERNEL = '''"""RMSNorm through kernels_runtime.ops.rmsnorm (decode)."""
from kernels_runtime.ops.rmsnorm import rmsnorm


def entry(inputs, weights, state, static):
    eps = static.get("variance_epsilon", static.get("eps"))
    return {"out": rmsnorm(inputs["hidden_states"], weights["weight"], float(eps))}
'''


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def back_to_back_us(fn, n: int) -> float:
    for _ in range(min(50, n)):  # never more warm-up than measured calls (a CPU smoke run's --calls is a handful)
        fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    _sync()
    return (time.perf_counter() - t0) * 1e6 / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (Triton interpreter; not a result)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("dispatch_overhead: expected a CUDA device")
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    from transformers.models.llama.configuration_llama import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from kernels_runtime.interp import enable_fast_interpreter
    from kernels_runtime.ops.rmsnorm import rmsnorm

    enable_fast_interpreter()  # the smoke run (a no-op on the GPU)
    dev, dt = args.device, torch.bfloat16
    cfg = LlamaConfig(hidden_size=2560, intermediate_size=9728)
    rows = []
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke run, not a result)"
    with torch.no_grad():
        # 1. identity dispatch on three decode-sized modules
        for name, mod, x in (
            ("Qwen3RMSNorm[2560]", Qwen3RMSNorm(2560).to(dev, dt), torch.randn(1, 1, 2560, device=dev, dtype=dt)),
            ("LlamaRMSNorm[4096]", LlamaRMSNorm(4096).to(dev, dt), torch.randn(1, 1, 4096, device=dev, dtype=dt)),
            ("LlamaMLP(qwen3-4b)", LlamaMLP(cfg).to(dev, dt), torch.randn(1, 1, 2560, device=dev, dtype=dt)),
        ):
            res = [dispatch_overhead_us(mod, (x,), repeats=args.calls, warmup=min(200, args.calls)) for _ in range(5)]
            orig = statistics.median(r.original_us for r in res)
            ident = statistics.median(r.patched_identity_us for r in res)
            bare = statistics.median(r.module_call_us for r in res)
            rows.append({"module": name, "measure": "identity_back_to_back", "original_us": orig,
                         "module_call_us": bare, "patched_us": ident,
                         "overhead_us": statistics.median(r.overhead_us for r in res)})
        # 2. a real Triton kernel, direct vs through the dispatch, back to back
        norm = Qwen3RMSNorm(2560, eps=1e-6).to(dev, dt)
        x = torch.randn(1, 1, 2560, device=dev, dtype=dt)
        bundle = PatchBundle(name="dispatch-overhead")
        cls = f"{type(norm).__module__}.{type(norm).__qualname__}"
        bundle.add_patch(PatchSpec(patch_id="rmsnorm", module_class=cls,
                                   instances=["m"], kernel=""), source=RMSNORM_KERNEL)
        holder = torch.nn.Module()
        holder._modules["m"] = norm
        eager = [back_to_back_us(lambda: norm(x), args.calls) for _ in range(5)]
        direct = [back_to_back_us(lambda: rmsnorm(x, norm.weight, 1e-6), args.calls) for _ in range(5)]
        report = apply(holder, bundle, strict=True)
        try:
            ref = rmsnorm(x, norm.weight, 1e-6)
            out = norm(x)
            same = bool(torch.equal(out, ref))
            patched = [back_to_back_us(lambda: norm(x), args.calls) for _ in range(5)]
            counters = str(getattr(report, "applied", ""))[:200]
        finally:
            revert(holder)
        d, p = statistics.median(direct), statistics.median(patched)
        rows.append({"module": "Qwen3RMSNorm[2560]", "measure": "triton_back_to_back", "original_us":
                     statistics.median(eager), "direct_kernel_us": d, "patched_us": p, "overhead_us": p - d,
                     "patched_equals_direct": same, "report": counters})
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "gpu": gpu, "torch": torch.__version__, "calls": args.calls}) + "\n")
    print(f"{'module':<22}{'measure':<24}{'HF forward us':>14}{'module call us':>15}{'direct us':>11}"
          f"{'patched us':>12}{'overhead us':>13}")
    for r in rows:
        direct, bare = r.get("direct_kernel_us", float("nan")), r.get("module_call_us", float("nan"))
        print(f"{r['module']:<22}{r['measure']:<24}{r['original_us']:>14.2f}{bare:>15.2f}{direct:>11.2f}"
              f"{r['patched_us']:>12.2f}{r['overhead_us']:>13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
