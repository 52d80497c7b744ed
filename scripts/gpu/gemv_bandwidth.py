"""Decode GEMV bandwidth on the GPU: kernels_runtime.ops.gemv vs cuBLAS F.linear vs torch.compile of the same op.

    python scripts/gpu/gemv_bandwidth.py --out gemv.jsonl [--models qwen3-4b,llama-2-7b] [--max-s 150]

Per model shape (batch 1; qwen3-4b also batch 4 for the MLP ops) and fused op (q/k/v + q/k norms + rotary;
o_proj + residual + post_attention_layernorm; gate/up + SwiGLU; down_proj + residual; lm_head):
- ours: the op, the best of a few configs (BLOCK_N, BLOCK_K, SPLIT_K, warps) timed here; every config's time is kept;
- cublas: the same projections as bare F.linear calls (the GEMV part alone, no epilogue work);
- eager: the op as the HF module computes it (F.linear + torch elementwise);
- compile: torch.compile (default mode) of that eager function.
Each variant runs as a CUDA graph of n calls over R copies of the weights (R x bytes >= 8 x the 60 MB L2, so
weights stream from HBM as in a model's decode step), timed with CUDA events; variants interleave (A B C D A B ...)
over 7 rounds; p20/p50/p80 per call. bytes = weights + activations read + outputs written (the minimum the op
must move); GB/s = bytes / p50; frac = that over the device-to-device copy bandwidth measured first in this
process (bytes read + written / time of a 1 GiB copy).
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
import torch.nn.functional as F  # noqa: E402

from kernels_runtime.ops import gemv as G  # noqa: E402
from llm4llm.evaluate import copy_bandwidth_gbps  # noqa: E402

SHAPES = {  # hidden, q heads, kv heads, head_dim, intermediate, vocab, q/k norms
    "qwen3-4b": dict(H=2560, hq=32, hkv=8, D=128, I=9728, V=151936, qk_norm=True),
    "llama-2-7b": dict(H=4096, hq=32, hkv=32, D=128, I=11008, V=32000, qk_norm=False),
}
L2_BYTES = 60 * 2**20
ROUNDS = 7


DIRECT = ("qkv_plain", "o_res", "gate_up_swiglu", "down_res", "lm_head")  # batch 1: written by the pass itself


def q(vals, p):
    s = sorted(vals)
    return s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))]


def rmsnorm_eager(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def rot(t):
    d = t.shape[-1] // 2
    return torch.cat((-t[..., d:], t[..., :d]), dim=-1)


def make_ops(s, M, dt):
    """name -> (weights maker, ours(x, ws, cfg), cublas(x, ws), eager(x, ws), bytes, extra inputs maker)."""
    H, D, hq, hkv, I, V = s["H"], s["D"], s["hq"], s["hkv"], s["I"], s["V"]
    dev = "cuda"
    r = lambda *sh: torch.randn(*sh, device=dev, dtype=dt) / sh[-1] ** 0.5  # noqa: E731
    e = dt.itemsize
    ops = {}

    def qkv_w():
        ws = [r(hq * D, H), r(hkv * D, H), r(hkv * D, H)]
        if s["qk_norm"]:
            ws += [1 + 0.1 * torch.randn(D, device=dev, dtype=dt), 1 + 0.1 * torch.randn(D, device=dev, dtype=dt)]
        return ws

    def qkv_extra():
        f = torch.randn(M, D, device=dev)
        return dict(x=torch.randn(M, H, device=dev, dtype=dt), cos=f.cos().to(dt), sin=f.sin().to(dt))

    def qkv_ours(a, ws, cfg):
        qn, kn = (ws[3], ws[4]) if s["qk_norm"] else (None, None)
        return G.qkv_norm_rope(a["x"], ws[0], ws[1], ws[2], a["cos"], a["sin"], D, q_norm_w=qn, k_norm_w=kn, **cfg)

    def qkv_eager(a, ws):
        x = a["x"]
        qq = F.linear(x, ws[0]).view(M, hq, D)
        kk = F.linear(x, ws[1]).view(M, hkv, D)
        vv = F.linear(x, ws[2]).view(M, hkv, D)
        if s["qk_norm"]:
            qq, kk = rmsnorm_eager(qq, ws[3], 1e-6), rmsnorm_eager(kk, ws[4], 1e-6)
        c, sn = a["cos"][:, None], a["sin"][:, None]
        return qq * c + rot(qq) * sn, kk * c + rot(kk) * sn, vv

    nqkv = (hq + 2 * hkv) * D
    ops["qkv_norm_rope"] = (qkv_w, qkv_ours, lambda a, ws: [F.linear(a["x"], w) for w in ws[:3]], qkv_eager,
                            nqkv * H * e + M * (H + nqkv + 2 * D) * e, qkv_extra)

    def o_w():
        return [r(H, hq * D), 1 + 0.1 * torch.randn(H, device=dev, dtype=dt)]

    def o_extra():
        return dict(x=torch.randn(M, hq * D, device=dev, dtype=dt), res=torch.randn(M, H, device=dev, dtype=dt))

    def o_eager(a, ws):
        h = a["res"] + F.linear(a["x"], ws[0])
        return h, rmsnorm_eager(h, ws[1], 1e-6)

    ops["o_proj_res_norm"] = (o_w, lambda a, ws, cfg: G.gemv_residual_rmsnorm(a["x"], ws[0], a["res"], ws[1], **cfg),
                              lambda a, ws: F.linear(a["x"], ws[0]), o_eager,
                              H * hq * D * e + M * (hq * D + 3 * H) * e, o_extra)

    def gu_w():
        return [r(I, H), r(I, H)]

    def gu_extra():
        return dict(x=torch.randn(M, H, device=dev, dtype=dt))

    ops["gate_up_swiglu"] = (gu_w, lambda a, ws, cfg: G.gate_up_swiglu(a["x"], ws[0], ws[1], **cfg),
                             lambda a, ws: (F.linear(a["x"], ws[0]), F.linear(a["x"], ws[1])),
                             lambda a, ws: F.silu(F.linear(a["x"], ws[0])) * F.linear(a["x"], ws[1]),
                             2 * I * H * e + M * (H + I) * e, gu_extra)

    _layer_ops(ops, s, M, e, D, qkv_w, qkv_extra, o_w, o_extra)

    def dn_extra():
        return dict(x=torch.randn(M, I, device=dev, dtype=dt), res=torch.randn(M, H, device=dev, dtype=dt))

    ops["down_res"] = (lambda: [r(H, I)], lambda a, ws, cfg: G.gemv(a["x"], ws[0], residual=a["res"], **cfg),
                       lambda a, ws: F.linear(a["x"], ws[0]), lambda a, ws: a["res"] + F.linear(a["x"], ws[0]),
                       H * I * e + M * (I + 2 * H) * e, dn_extra)
    if M == 1:
        ops["lm_head"] = (lambda: [r(V, H)], lambda a, ws, cfg: G.gemv(a["x"], ws[0], **cfg),
                          lambda a, ws: F.linear(a["x"], ws[0]), lambda a, ws: F.linear(a["x"], ws[0]),
                          V * H * e + M * (H + V) * e, lambda: dict(x=torch.randn(M, H, device=dev, dtype=dt)))
    return ops


def _layer_ops(ops, s, M, e, D, qkv_w, qkv_extra, o_w, o_extra):
    """The decode layer's own passes (decoder_layer.decode_static): q/k/v written directly (its q/k norms and rotary
    run in the attention kernel), o_proj + residual (the post norm in gate/up's prologue)."""
    H, hq, hkv = s["H"], s["hq"], s["hkv"]
    nqkv = (hq + 2 * hkv) * D
    ops["qkv_plain"] = (lambda: qkv_w()[:3], lambda a, ws, cfg: G.qkv_norm_rope(a["x"], *ws, None, None, D, **cfg),
                        lambda a, ws: tuple(F.linear(a["x"], w) for w in ws),
                        lambda a, ws: tuple(F.linear(a["x"], w) for w in ws),
                        nqkv * H * e + M * (H + nqkv) * e, qkv_extra)
    ops["o_res"] = (lambda: o_w()[:1], lambda a, ws, cfg: G.gemv(a["x"], ws[0], residual=a["res"], **cfg),
                    lambda a, ws: F.linear(a["x"], ws[0]), lambda a, ws: a["res"] + F.linear(a["x"], ws[0]),
                    H * hq * D * e + M * (hq * D + 2 * H) * e, o_extra)


def configs(n_out, K, sms, M=1, direct=False):
    # a few points: 16-byte K tiles, 4-32 rows a program (fewer K columns per row block with M rows: the fp32
    # accumulator is M x BLOCK_N x BLOCK_K), split-K until there are >= 2 programs an SM
    out = []
    m = 1 if M == 1 else 1 << (M - 1).bit_length()
    for bn, bk, w in ((16, 512, 4), (8, 512, 4), (32, 256, 4), (4, 1024, 4), (16, 512, 8)):
        bk = max(32, bk // m)
        blocks = -(-n_out // bn)
        split = next((sp for sp in (1, 2, 4, 8) if blocks * sp >= 2 * sms and K // sp >= bk), 1)
        for sp in sorted({1, split}):
            out.append(dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sp, num_warps=w, num_stages=1))
    # the tl.dot path (x padded to 16 rows, pipelined weight tiles): the candidate for small batch
    for bn, bk, w, st in ((16, 256, 4, 3), (32, 128, 4, 4), (16, 256, 8, 3)) if M > 1 else ((16, 256, 4, 3),):
        out.append(dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, num_warps=w, num_stages=st, DOT=True))
    if M == 1 and direct:  # the decode layer's passes: launched with PDL (its own output written directly)
        for bn, bk in ((4, 1024), (4, 512), (8, 512)):
            out.append(dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, num_warps=4, num_stages=1, PDL=True))
    return out


def graph_of(fn, sets, n):
    """A CUDA graph of n calls of fn over the weight copies in turn; returns (graph, calls)."""
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(*sets[i % len(sets)])
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    return g


def time_graph(g, n):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / n  # us per call


def _args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="qwen3-4b,llama-2-7b")
    ap.add_argument("--max-s", type=float, default=150.0, help="stop starting new rows after this many seconds")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--ops", default="", help="only these ops (comma-separated names), default all")
    ap.add_argument("--no-batch4", action="store_true", help="skip qwen3-4b's batch-4 rows")
    return ap.parse_args()


def main() -> int:
    args = _args()
    t_start = time.time()
    torch.manual_seed(0)
    dt = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_bw = copy_bandwidth_gbps() * 1e9  # bytes/s
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_GBps=copy_bw / 1e9)
    import triton
    meta["triton"] = triton.__version__
    rows = []
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s on {meta['gpu']}, {sms} SMs", flush=True)
    work = [(m, 1) for m in args.models.split(",")] + ([] if args.no_batch4 else [("qwen3-4b", 4)])
    only = set(filter(None, args.ops.split(",")))
    with torch.no_grad():
        for model, M in work:
            for name, (mk_w, ours, cublas, eager, nbytes, mk_in) in make_ops(SHAPES[model], M, dt).items():
                if only and name not in only:
                    continue
                if time.time() - t_start > args.max_s:
                    print(f"time limit: skipped {model} M={M} {name}", flush=True)
                    continue
                w0 = mk_w()
                wbytes = sum(w.numel() * w.element_size() for w in w0)
                R = max(1, min(48, -(-8 * L2_BYTES // wbytes)))
                sets = [(mk_in(), w0 if i == 0 else [w.clone() for w in w0]) for i in range(R)]
                n = max(R, 24)
                a0, ws0 = sets[0]
                # correctness of ours against eager at the default config (tolerance table)
                from kernels_runtime.tolerances import compare
                n_out = sum(w.shape[0] for w in ws0[:3]) if name.startswith("qkv") else ws0[0].shape[0]
                cfgs = configs(n_out if name != "gate_up_swiglu" else 2 * ws0[0].shape[0], ws0[0].shape[1], sms, M,
                               direct=name in DIRECT)
                ok = []
                for cfg in cfgs[:2]:
                    o, ref = ours(a0, ws0, cfg), eager(a0, ws0)
                    o, ref = (o if isinstance(o, tuple) else (o,)), (ref if isinstance(ref, tuple) else (ref,))
                    ok.append(all(compare(x.reshape(r.shape), r).ok for x, r in zip(o, ref)))
                variants = {f"ours{j}": (lambda a, ws, c=c: ours(a, ws, c)) for j, c in enumerate(cfgs)}
                variants["cublas"] = cublas
                variants["eager"] = eager
                if not args.no_compile:
                    try:
                        comp = torch.compile(eager, dynamic=False)
                        comp(a0, ws0)
                        variants["compile"] = comp
                    except Exception as exc:  # noqa: BLE001 - recorded, the row goes on without it
                        print(f"compile failed for {name}: {exc!r}"[:300], flush=True)
                graphs = {k: graph_of(fn, sets, n) for k, fn in variants.items()}
                times = {k: [] for k in graphs}
                for _ in range(ROUNDS):
                    for k, g in graphs.items():
                        times[k].append(time_graph(g, n))
                best = min((k for k in times if k.startswith("ours")), key=lambda k: statistics.median(times[k]))
                row = dict(model=model, M=M, op=name, bytes=nbytes, weight_copies=R, calls_per_graph=n,
                           correct=all(ok), best_config=cfgs[int(best[4:])], **meta)
                for k, ts in times.items():
                    p50 = statistics.median(ts)
                    row[k] = dict(p20=q(ts, 0.2), p50=p50, p80=q(ts, 0.8), GBps=nbytes / p50 / 1e3,
                                  frac=nbytes / p50 / 1e3 / (copy_bw / 1e9),
                                  **({"config": cfgs[int(k[4:])]} if k.startswith("ours") else {}))
                row["ours"] = row[best]
                rows.append(row)
                c = row.get("compile", {}).get("p50", float("nan"))
                print(f"{model:<11} M={M} {name:<16} {nbytes / 1e6:8.1f} MB  ours {row['ours']['p50']:7.2f} us "
                      f"({row['ours']['frac']:.0%})  cublas {row['cublas']['p50']:7.2f} ({row['cublas']['frac']:.0%})"
                      f"  eager {row['eager']['p50']:7.2f}  compile {c:7.2f}  correct={row['correct']} "
                      f"best={row['best_config']}", flush=True)
                del graphs, sets, variants
                torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
