"""KernelBench conv problems on one GPU: eager (cuDNN, strict fp32) against the built-in templates' renderings,
`kb.fused_tail` (cuDNN conv + Triton tail) and `kb.conv_epilogue` (the conv as a Triton implicit GEMM with the tail
on its accumulator) over a few configs, to pick the template's defaults before a search. Every rendering is checked
against eager at KernelBench's 1e-4 on two fresh inputs first; a failing one is reported and not timed.

Variants are interleaved (A B C ... A B C ...), CUDA events around `--reps` calls after a warm-up, the L2 cache not
flushed (a search's timing flushes it; this only ranks configs). Medians and p20-p80 per variant, one JSON line per
(problem, variant), a table last. Usage:
  python3 scripts/gpu/kb_conv_bench.py .gpu/kb/problems --problems 4,100 --out $OUT/conv.jsonl [--max-s 400]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from llm4llm.kernelbench.codegen import Unsupported  # noqa: E402
from llm4llm.kernelbench.problem import build_model, inputs_for, load_module, make_task, select  # noqa: E402
from llm4llm.kernelbench.protocol import strict_fp32  # noqa: E402
from llm4llm.kernelbench.templates import TEMPLATES, render_source  # noqa: E402
from llm4llm.taskspec import load_spec  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = {
    "c128x128k32w8s3": dict(BCO=128, BP=128, CK=32, conv_warps=8, conv_stages=3),
    "c64x128k32w4s3": dict(BCO=64, BP=128, CK=32, conv_warps=4, conv_stages=3),
    "c128x64k32w4s3": dict(BCO=128, BP=64, CK=32, conv_warps=4, conv_stages=3),
    "c128x256k32w8s3": dict(BCO=128, BP=256, CK=32, conv_warps=8, conv_stages=3),
    "c128x128k16w8s4": dict(BCO=128, BP=128, CK=16, conv_warps=8, conv_stages=4),
    "c64x256k32w8s3": dict(BCO=64, BP=256, CK=32, conv_warps=8, conv_stages=3),
    "c128x128k32w8s3_ieee": dict(BCO=128, BP=128, CK=32, conv_warps=8, conv_stages=3, conv_precision="ieee"),
    # channels last: x and w copied to [N, *spatial, C] / [*taps, C_in, C_out], 16-byte loads along channels
    "cl128x128k32w8s3": dict(conv_layout="cl", BCO=128, BP=128, CK=32, conv_warps=8, conv_stages=3),
    "cl128x128k16w8s4": dict(conv_layout="cl", BCO=128, BP=128, CK=16, conv_warps=8, conv_stages=4),
    "cl64x128k32w4s3": dict(conv_layout="cl", BCO=64, BP=128, CK=32, conv_warps=4, conv_stages=3),
    "cl128x256k32w8s3": dict(conv_layout="cl", BCO=128, BP=256, CK=32, conv_warps=8, conv_stages=3),
    "cl64x64k32w4s3": dict(conv_layout="cl", BCO=64, BP=64, CK=32, conv_warps=4, conv_stages=3),
    "cl64x128k32w4s4": dict(conv_layout="cl", BCO=64, BP=128, CK=32, conv_warps=4, conv_stages=4),
    "cl64x256k32w4s3": dict(conv_layout="cl", BCO=64, BP=256, CK=32, conv_warps=4, conv_stages=3),
    "cl64x128k32w4s3_ieee": dict(conv_layout="cl", BCO=64, BP=128, CK=32, conv_warps=4, conv_stages=3,
                                 conv_precision="ieee"),
    # channels last with the K loop flattened over (tap, channel): for 4-12 input channels
    "clk64x128k32w4s3": dict(conv_layout="clk", BCO=64, BP=128, CK=32, conv_warps=4, conv_stages=3),
    "clk64x128k16w4s3": dict(conv_layout="clk", BCO=64, BP=128, CK=16, conv_warps=4, conv_stages=3),
    "clk128x128k32w8s3": dict(conv_layout="clk", BCO=128, BP=128, CK=32, conv_warps=8, conv_stages=3),
    "cl128x128k32w8s3_ieee": dict(conv_layout="cl", BCO=128, BP=128, CK=32, conv_warps=8, conv_stages=3,
                                  conv_precision="ieee"),
}


def _time(fn, x, reps: int) -> float:
    if not torch.cuda.is_available():  # the CPU smoke run (TRITON_INTERPRET=1): wall time, meaningless as speed
        t = time.perf_counter()
        for _ in range(reps):
            fn(*x)
        return (time.perf_counter() - t) * 1e3 / reps
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn(*x)
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def _variants(path: Path, tmp: Path) -> dict[str, str]:
    spec = load_spec(make_task(path, tmp))
    t = {x.name: x for x in TEMPLATES}
    out = {"fused_tail": render_source(spec, t["kb.fused_tail"].default(spec), rewrite=False)}
    if t["kb.conv_epilogue"].why_not(spec) is None:
        base = t["kb.conv_epilogue"].default(spec)
        for name, cfg in CONFIGS.items():
            try:
                out[name] = render_source(spec, {**base, **cfg}, rewrite=False)
            except Unsupported:  # e.g. the flattened channels-last loop on a transposed conv
                continue
    return out


def bench(path: Path, rounds: int, reps: int, out) -> list[dict]:
    src = path.read_text()
    problem = load_module(src)
    with torch.no_grad():
        ref = build_model(problem, DEV)
        fns = {"eager": ref}
        rows = []
        for name, code in _variants(path, Path(tempfile.mkdtemp())).items():
            row = {"problem": path.name, "variant": name}
            try:
                new = load_module(src + "\n" + code.split('"""', 2)[2])
                cand = build_model(new, DEV, "ModelNew")
                worst = 0.0
                for seed in (11, 12):
                    x = inputs_for(problem, seed, DEV)
                    a, b = cand(*x), ref(*x)
                    worst = max(worst, (a - b).abs().max().item())
                    ok = torch.allclose(a, b, atol=1e-4, rtol=1e-4)
                    del a, b
                    if not ok:
                        break
                row.update(max_abs=worst, correct=bool(ok))
                if ok:
                    fns[name] = cand
            except Exception as e:  # noqa: BLE001 - a failing rendering is a row, not the end of the run
                row.update(correct=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(row)
        x = inputs_for(problem, 13, DEV)
        for f in fns.values():
            f(*x)
        if DEV == "cuda":
            torch.cuda.synchronize()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(rounds):
            for k, f in fns.items():
                times[k].append(_time(f, x, reps))
    res = [{"problem": path.name, "variant": "eager", "correct": True}] + rows
    for r in res:
        ts = times.get(r["variant"])
        if ts:
            q = sorted(ts)
            r.update(ms=statistics.median(ts), p20=q[int(0.2 * (len(q) - 1))], p80=q[int(0.8 * (len(q) - 1))],
                     rounds=len(ts))
        out.write(json.dumps(r) + "\n")
        out.flush()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--problems", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-s", type=float, default=400)
    ap.add_argument("--configs", default=None, help="comma-separated names of CONFIGS (default: all)")
    a = ap.parse_args()
    if a.configs:
        for k in set(CONFIGS) - set(a.configs.split(",")):
            del CONFIGS[k]
    strict_fp32()
    t0 = time.time()
    allrows = []
    with open(a.out, "a") as out:
        for p in select(Path(a.dir), a.problems):
            if time.time() - t0 > a.max_s:
                print(f"time limit: stopped before {p.name}", flush=True)
                break
            if "conv" not in p.name.lower():
                continue
            try:
                allrows += bench(p, a.rounds, a.reps, out)
            except Exception as e:  # noqa: BLE001
                print(f"{p.name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            torch.cuda.empty_cache()
            print(f"{p.name} done at {time.time() - t0:.0f}s", flush=True)
    print(f"{'problem':<48} {'variant':<22} {'ms':>8} {'p20-p80':>16} {'x eager':>8} ok")
    eager = {r["problem"]: r.get("ms") for r in allrows if r["variant"] == "eager"}
    for r in allrows:
        ms = r.get("ms")
        sp = f"{eager[r['problem']] / ms:8.3f}" if ms and eager.get(r["problem"]) else "       -"
        rng = f"{r['p20']:.3f}-{r['p80']:.3f}" if ms else r.get("error", "")[:16]
        print(f"{r['problem'][:48]:<48} {r['variant']:<22} {ms or 0:8.3f} {rng:>16} {sp} {r['correct']}")


if __name__ == "__main__":
    main()
