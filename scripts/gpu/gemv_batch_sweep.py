"""The decode layer's GEMVs at a decode batch (M rows), kernels_runtime.ops.gemv's tl.dot path over its tiles against
cuBLAS (F.linear, what torch.compile calls) at the same shapes: how far from the weight-streaming rate each point is.

    python scripts/gpu/gemv_batch_sweep.py --out sweep.jsonl [--models qwen3-4b] [--rows 8,32] [--jobs 8]

Per op (q/k/v as one [Hq*D + 2*Hkv*D, H] GEMV, o_proj, gate/up + SwiGLU paired, down_proj) and M: the tile points
(BLOCK_N x BLOCK_K, pipeline stages, K split; no PDL or register prefetch, so Triton's pipeliner streams the
tiles) and cuBLAS, interleaved over --rounds rounds; a point's calls are one CUDA graph of --copies calls, each on
its own weight copy (more bytes than the L2 holds, so every call streams from HBM; no host launch time between
them), timed per replay and divided by the calls. Compiles run first in --jobs processes (Triton's cache),
then one process times. Checks: every point against cuBLAS's output within the bf16 tolerance. Prints, per op and
M, cuBLAS and the five best points with GB/s (weight bytes over the median time) and the ratio to cuBLAS.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from layer_bench import graph_of  # noqa: E402  (warm-up on a side stream, then capture: the layer bench's)

SHAPES = {"qwen3-4b": dict(H=2560, hq=32, hkv=8, D=128, I=9728), "llama-2-7b": dict(H=4096, hq=32, hkv=32, D=128,
                                                                                     I=11008)}
POINTS = [dict(BLOCK_N=bn, BLOCK_K=bk, num_stages=st, SPLIT_K=sk, num_warps=4)
          for bn, bk, st, sk in itertools.product((16, 32, 64, 128), (64, 128, 256), (1, 3, 4), (1, 2))]


def ops_of(s: dict) -> dict[str, tuple[int, int]]:
    """op -> (N, K) of the weight it streams (gate/up: N is both weights' rows)."""
    H, D = s["H"], s["D"]
    return {"qkv": ((s["hq"] + 2 * s["hkv"]) * D, H), "o": (H, s["hq"] * D), "gate_up": (2 * s["I"], H),
            "down": (H, s["I"])}


def weights(N: int, K: int, copies: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return [(torch.randn(N, K, generator=g, device="cuda") / K**0.5).to(torch.bfloat16) for _ in range(copies)]


def ours(op: str, x, w, p: dict):
    from kernels_runtime.ops import gemv as G

    kw = dict(DOT=True, FMA_MAX_M=1, **p)
    if op == "gate_up":
        half = w.shape[0] // 2
        return G.gate_up_swiglu(x, w[:half], w[half:], **kw)
    return G.gemv(x, w, **kw)


def cublas(op: str, x, w):
    y = F.linear(x, w)
    if op == "gate_up":
        g, u = y.chunk(2, dim=-1)
        return F.silu(g) * u
    return y


def run_points(model: str, M: int, names, rounds: int, copies: int, time_it: bool) -> list[dict]:
    from kernels_runtime.tolerances import compare

    rows = []
    for op, (N, K) in ops_of(SHAPES[model]).items():
        if names and op not in names:
            continue
        ws = weights(N, K, copies)
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        ref = cublas(op, x, ws[0])
        ok, bad = [], {}
        for i, p in enumerate(POINTS):
            try:
                out = ours(op, x, ws[0], p)
                torch.cuda.synchronize()
                c = compare(out, ref)
                if not c.ok:
                    bad[i] = str(c)[:200]
                ok.append(i)
            except Exception as exc:  # noqa: BLE001 - a point that does not compile or fit is reported, not fatal
                bad[i] = f"{type(exc).__name__}: {exc}"[:200]
        if not time_it:
            continue
        variants = {"cublas": lambda j: cublas(op, x, ws[j])}
        variants.update({i: (lambda j, p=POINTS[i]: ours(op, x, ws[j], p)) for i in ok})
        graphs = {}
        for k, fn in variants.items():
            try:
                graphs[k] = graph_of(lambda fn=fn: [fn(j) for j in range(copies)], lambda: None)[0]
            except Exception as exc:  # noqa: BLE001 - a point that does not capture is reported, not fatal
                bad[k] = f"capture: {type(exc).__name__}: {exc}"[:200]
        times = {k: [] for k in graphs}
        for _ in range(rounds):
            for k, g in graphs.items():
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                g.replay()
                e1.record()
                torch.cuda.synchronize()
                times[k].append(e0.elapsed_time(e1) * 1e3 / copies)
        wbytes = N * K * 2
        base = statistics.median(times["cublas"])
        for k, ts in times.items():
            med = statistics.median(ts)
            rows.append(dict(model=model, op=op, M=M, N=N, K=K, point="cublas" if k == "cublas" else POINTS[k],
                             us=med, us_p20=sorted(ts)[int(0.2 * (len(ts) - 1))],
                             us_p80=sorted(ts)[int(0.8 * (len(ts) - 1) + 0.5)], GBps=wbytes / med / 1e3,
                             vs_cublas=base / med, problem=None if k == "cublas" else bad.get(k)))
        for i, why in bad.items():
            if i not in ok or i not in graphs:
                rows.append(dict(model=model, op=op, M=M, N=N, K=K, point=POINTS[i], problem=why))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="qwen3-4b")
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--ops", default="", help="comma-separated: qkv, o, gate_up, down (default: all)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--copies", type=int, default=4, help="weight copies read in turn (more bytes than the L2)")
    ap.add_argument("--jobs", type=int, default=8, help="processes that compile the points first")
    ap.add_argument("--shard", default="", help="i/n: compile (no timing) the points i, i+n, ... (internal)")
    args = ap.parse_args()
    names = [n for n in args.ops.split(",") if n]
    if args.shard:
        i, n = (int(v) for v in args.shard.split("/"))
        POINTS[:] = POINTS[i::n]
        for model in args.models.split(","):
            for M in (int(m) for m in args.rows.split(",")):
                run_points(model, M, names, 0, 1, time_it=False)
        return 0
    if args.jobs > 1:
        argv = [sys.executable, __file__, "--out", os.devnull, "--models", args.models, "--rows", args.rows,
                "--ops", args.ops]
        procs = [subprocess.Popen([*argv, "--shard", f"{i}/{args.jobs}"]) for i in range(args.jobs)]
        for p in procs:
            p.wait()
    rows = []
    with torch.no_grad(), open(args.out, "w") as f:
        for model in args.models.split(","):
            for M in (int(m) for m in args.rows.split(",")):
                got = run_points(model, M, names, args.rounds, args.copies, time_it=True)
                for r in got:
                    f.write(json.dumps(r) + "\n")
                rows += got
    print(f"{'model':<10} {'op':<8} {'M':>3} {'point':<34} {'us':>8} {'GB/s':>7} {'x cuBLAS':>8}")
    for key, grp in itertools.groupby(rows, key=lambda r: (r["model"], r["op"], r["M"])):
        timed = [r for r in grp if "us" in r]
        best = sorted((r for r in timed if r["point"] != "cublas" and not r["problem"]), key=lambda r: r["us"])[:5]
        for r in [r for r in timed if r["point"] == "cublas"] + best:
            p = r["point"] if r["point"] == "cublas" else "n{BLOCK_N} k{BLOCK_K} st{num_stages} sk{SPLIT_K}".format(
                **r["point"])
            print(f"{key[0]:<10} {key[1]:<8} {key[2]:>3} {p:<34} {r['us']:8.1f} {r['GBps']:7.0f} "
                  f"{r['vs_cublas']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
