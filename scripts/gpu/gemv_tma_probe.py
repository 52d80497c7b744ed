"""Probe: would a TMA-fed GEMV stream decode weights closer to the HBM bandwidth than the register-prefetch GEMV?

    python scripts/gpu/gemv_tma_probe.py --out probe.jsonl [--models qwen3-4b,llama-2-7b]

The layer timeline (scripts/gpu/layer_bench.py --timeline, docs/results/2026-12-03-h200-e) shows qwen3-4b's
gate/up pass bound by bytes in flight: about 5 programs an SM, each holding a 4-row tile in registers and taking
4.35 us for its 20 KB. A TMA load puts the tile in shared memory (no registers held while it flies) and Triton's
pipeliner keeps `num_stages` of them in flight a program. This probe times, at batch 1, for the model's gate/up
(two weights, SwiGLU epilogue) and down (one weight) shapes:
- ours: kernels_runtime.ops.gemv at the layer's default config (4 rows x 1024, 4 warps, no norm prologue);
- cublas: F.linear over the same bytes (one stacked weight for gate/up; no epilogue);
- tma_*: the probe kernel below, rows x K-tile x stages x warps.
Each variant is a CUDA graph of n calls over R weight copies (R x bytes >= 8 x the L2), timed with CUDA events,
variants interleaved over 7 rounds; p50 per call; frac = bytes / p50 over the copy bandwidth measured first.
Outputs are checked against ours (bf16 tolerance) before anything is timed. A probe: nothing in the library
calls this kernel.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SHAPES = {"qwen3-4b": dict(H=2560, I=9728), "llama-2-7b": dict(H=4096, I=11008), "llama-3.2-3b": dict(H=3072, I=8192)}
L2_BYTES = 60 * 2**20
ROUNDS = 7


@triton.jit
def _gemv_tma(x_ptr, a_ptr, b_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
              SWIGLU: tl.constexpr):
    # y[n] = sum_k a[n, k] x[k] (SWIGLU: silu(a @ x) * (b @ x), LlamaMLP's roundings), the weight tiles by TMA
    # (descriptors made on the device: a host descriptor's launch did not survive CUDA-graph replay here)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    n0 = tl.program_id(0) * BLOCK_N
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    if SWIGLU:
        acc_b = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = tl.load(x_ptr + k0 + rk, mask=(k0 + rk) < K, other=0.0).to(tl.float32)
        acc += a_desc.load([n0, k0]).to(tl.float32) * x[None, :]
        if SWIGLU:
            acc_b += b_desc.load([n0, k0]).to(tl.float32) * x[None, :]
    out = tl.sum(acc, axis=1)
    rn = n0 + tl.arange(0, BLOCK_N)
    if SWIGLU:
        g = out.to(tl.bfloat16).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(tl.bfloat16).to(tl.float32)
        out = act * tl.sum(acc_b, axis=1).to(tl.bfloat16).to(tl.float32)
    tl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty))


def tma_op(bn, bk, stages, warps):
    def setup(ws):
        return None

    def run(x, ws, descs, y):
        a = ws[0]
        b = ws[1] if len(ws) > 1 else a
        _gemv_tma[(a.shape[0] // bn,)](x, a, b, y, a.shape[0], a.shape[1], BLOCK_N=bn, BLOCK_K=bk, STAGES=stages,
                                       SWIGLU=len(ws) > 1, num_warps=warps)
        return y
    return setup, run


def ours_op(x, ws, descs, y):
    from kernels_runtime.ops import gemv as G

    if len(ws) > 1:
        return G.gate_up_swiglu(x.view(1, -1), ws[0], ws[1], BLOCK_N=4, BLOCK_K=1024, num_warps=4)
    return G.gemv(x.view(1, -1), ws[0], BLOCK_N=4, BLOCK_K=1024, num_warps=4)


def cublas_op(x, ws, descs, y):
    return F.linear(x.view(1, -1), descs[0])  # descs[0]: the stacked weight


def graph(fn, n):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    return g


CONFIGS = [(8, 256, 4, 4), (16, 256, 4, 4), (16, 128, 6, 4), (32, 128, 4, 4), (16, 256, 6, 8), (32, 256, 3, 8),
           (64, 128, 4, 8), (8, 256, 6, 4)]  # TMA rows, K tile, stages, warps


def build(variants, copies, x, y, n):
    """Each variant checked against ours, captured in a graph of calls over the weight copies and replayed once
    (a replay that faults is reported by its name) -> (replay functions, calls a replay, problems)."""
    from kernels_runtime.tolerances import compare

    want = ours_op(x, copies[0], None, y).reshape(-1).clone()
    graphs, problems, calls = {}, {}, 4 * len(copies)
    for name, (setup, run) in variants.items():
        try:
            per = [(ws, setup(ws)) for ws in copies]
            got = run(x, per[0][0], per[0][1], y).reshape(-1)
            c = compare(got[:n], want) if name != "cublas" else None
            if c is not None and not c.ok:
                problems[name] = str(c)[:200]
                continue
            it = iter(range(10**9))

            def fn(per=per, run=run, it=it):
                ws, d = per[next(it) % len(per)]
                return run(x, ws, d, y)
            graphs[name] = graph(fn, calls).replay
            graphs[name]()
            torch.cuda.synchronize()
            print(f"  {name}: replayed", flush=True)
        except Exception as exc:  # noqa: BLE001 - a config that does not build is reported
            problems[name] = f"{type(exc).__name__}: {exc}"[:200]
    return graphs, calls, problems


def bench_op(model, op, n, k, nw, bw, g, only) -> list[dict]:
    wbytes = n * k * 2 * nw
    reps = max(2, -(-8 * L2_BYTES // wbytes))
    copies = [[(torch.randn(n, k, generator=g, device="cuda") / k**0.5).bfloat16() for _ in range(nw)]
              for _ in range(reps)]
    x = torch.randn(k, generator=g, device="cuda").bfloat16()
    y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    variants = {"ours": (lambda ws: None, ours_op), "cublas": (lambda ws: [torch.cat(ws, 0)], cublas_op)}
    variants.update({"tma_%dx%d_s%d_w%d" % c: tma_op(*c) for c in CONFIGS if n % c[0] == 0})
    if only:
        variants = {name: v for name, v in variants.items() if name.startswith(tuple(only.split(",")))}
    graphs, calls, problems = build(variants, copies, x, y, n)
    times = {name: [] for name in graphs}
    for _ in range(ROUNDS):
        for name, replay in graphs.items():
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            replay()
            e1.record()
            torch.cuda.synchronize()
            times[name].append(e0.elapsed_time(e1) * 1e3 / calls)
    print(f"\n{model} {op}: {n} x {k} x {nw} weights, {wbytes / 1e6:.1f} MB, floor {wbytes / bw / 1e3:.2f} us",
          flush=True)
    rows = []
    for name in variants:
        row = dict(model=model, op=op, variant=name, weight_bytes=wbytes, copy_GBps=bw, problem=problems.get(name),
                   gpu=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__)
        if name in times:
            ts = sorted(times[name])
            p50 = statistics.median(ts)
            row.update(p20=ts[1], p50=p50, p80=ts[-2], frac=wbytes / (p50 * 1e-6) / (bw * 1e9), times_us=ts)
            print(f"  {name:<22} {p50:8.2f} us ({ts[1]:.2f}-{ts[-2]:.2f})  {row['frac']:.3f} of copy", flush=True)
        else:
            print(f"  {name:<22} FAILED {problems.get(name)}", flush=True)
        rows.append(row)
    return rows


def main() -> int:
    from llm4llm.evaluate import copy_bandwidth_gbps

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="qwen3-4b,llama-2-7b")
    ap.add_argument("--only", default="", help="comma-separated variant-name prefixes (ours, cublas, tma)")
    args = ap.parse_args()
    bw = copy_bandwidth_gbps()
    # device-side TMA descriptors need global scratch; allocated in the graph's pool when captured
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    print(f"copy bandwidth {bw:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    with open(args.out, "w") as f:
        for model in args.models.split(","):
            s = SHAPES[model]
            for op, (n, k, nw) in (("gate_up_swiglu", (s["I"], s["H"], 2)), ("down", (s["H"], s["I"], 1))):
                for row in bench_op(model, op, n, k, nw, bw, g, args.only):
                    f.write(json.dumps(row) + "\n")
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
