"""Benchmark the transformer ops at real model shapes: correctness against each op's `_ref`, then timing.

    python scripts/bench_transformer_ops.py --out bench.jsonl              # CUDA, bf16, qwen3-4b + llama-2-7b
    python scripts/bench_transformer_ops.py --dry-run                      # list the cases (shapes on 'meta')
    python scripts/bench_transformer_ops.py --tiny --out /tmp/tiny.jsonl   # CPU interpreter, tiny shapes, fp32

Each case draws fresh random inputs for the correctness check (outputs land in memory poisoned with NaN first:
poison tensors of the reference outputs' sizes are freed right before the launch, so the caching allocator hands
the same blocks to the launcher) and fresh inputs again for timing. Timing is `triton.testing.do_bench` (L2
flushed between runs) with quantiles 0.2/0.5/0.8, for the kernel and the reference alike. One JSON line per case.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {
    "qwen3-4b": dict(hidden=2560, heads=32, kv_heads=8, head_dim=128, intermediate=9728, eps=1e-6, qk_norm=True),
    "llama-2-7b": dict(hidden=4096, heads=32, kv_heads=32, head_dim=128, intermediate=11008, eps=1e-5, qk_norm=False),
}
PROMPT_LEN, DECODE_LEN = 512, 64
TINY_MODELS = {
    "tiny-qwen3": dict(hidden=80, heads=4, kv_heads=2, head_dim=16, intermediate=96, eps=1e-6, qk_norm=True),
    "tiny-llama": dict(hidden=64, heads=2, kv_heads=2, head_dim=32, intermediate=72, eps=1e-5, qk_norm=False),
}
TINY_PROMPT_LEN, TINY_DECODE_LEN = 19, 5
QUANTILES = (0.2, 0.5, 0.8)


@dataclass
class Case:
    op: str
    model: str
    phase: str
    shape: str
    make: Callable[[], dict]  # fresh random inputs (keyword arguments of both callables)
    kernel: Callable[..., object]
    ref: Callable[..., object]  # reference used for correctness
    bytes: int  # minimum HBM traffic of one call
    flops: int
    timed_ref: Callable[..., object] | None = None  # reference used for timing, when it differs
    inplace: tuple[str, ...] = ()  # inputs the kernel mutates; compared with the ref's extra outputs


@dataclass
class Row:
    op: str
    model: str
    phase: str
    shape: str
    dtype: str
    correct: bool
    max_abs: float
    reason: str
    ref_ms_p20: float
    ref_ms_p50: float
    ref_ms_p80: float
    triton_ms_p20: float
    triton_ms_p50: float
    triton_ms_p80: float
    speedup: float
    gbps: float
    tflops: float
    gpu: str
    torch: str
    triton: str


class _Inputs:
    """Random inputs of one dtype on one device, laid out as HF builds them."""

    def __init__(self, dtype, device):
        self.dtype, self.device = dtype, device

    def randn(self, *shape, scale=1.0):
        import torch

        return torch.randn(*shape, dtype=self.dtype, device=self.device) * scale

    def heads(self, S, H, D):  # [B, H, S, D] as HF builds it: a transposed view of the [B, S, H, D] projection
        return self.randn(1, S, H, D).transpose(1, 2)

    def cos_sin(self, S, D, start):
        import torch

        device = self.device
        pos = torch.arange(start, start + S, device=device, dtype=torch.float32)[None, :, None]
        inv_freq = 1e6 ** (-torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)
        emb = torch.cat([pos * inv_freq, pos * inv_freq], dim=-1)  # [1, S, D]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)


def _static_update_ref(q, k_new, v_new, k_cache, v_cache, cache_len):
    # What a static cache does per step (index_copy_, then attention over the prefix), without the clones the
    # correctness reference makes to stay side-effect free.
    import torch

    from kernels_runtime.ops import attention_decode as AD

    pos = torch.tensor([cache_len], device=q.device)
    k_cache.index_copy_(2, pos, k_new)
    v_cache.index_copy_(2, pos, v_new)
    return AD.attention_decode_ref(q, k_cache, v_cache, kv_len=cache_len + 1)


def _phase_cases(name: str, m: dict, phase: str, S: int, start: int, inp: _Inputs, es: int) -> list[Case]:
    """The norm, rotary and MLP ops of one model at one phase (S tokens, positions from `start`)."""
    from kernels_runtime.ops import rmsnorm as RN
    from kernels_runtime.ops import rotary as RO
    from kernels_runtime.ops import swiglu as SW

    H, I, Hq, Hkv, D, eps = m["hidden"], m["intermediate"], m["heads"], m["kv_heads"], m["head_dim"], m["eps"]
    randn, heads, cos_sin = inp.randn, inp.heads, inp.cos_sin
    out: list[Case] = []
    w = randn(H, scale=0.1) + 1
    out.append(Case(
        "rmsnorm", name, phase, f"x[1,{S},{H}]",
        lambda: dict(x=randn(1, S, H), weight=w, eps=eps),
        RN.rmsnorm, RN.rmsnorm_ref, (2 * S * H + H) * es, 4 * S * H,
    ))
    out.append(Case(
        "rmsnorm_residual", name, phase, f"x,residual[1,{S},{H}]",
        lambda: dict(x=randn(1, S, H), residual=randn(1, S, H), weight=w, eps=eps),
        RN.rmsnorm_residual, RN.rmsnorm_residual_ref, (4 * S * H + H) * es, 5 * S * H,
    ))
    qk_bytes = (2 * S * (Hq + Hkv) * D + 2 * S * D) * es
    out.append(Case(
        "rotary", name, phase, f"q[1,{Hq},{S},{D}] k[1,{Hkv},{S},{D}]",
        lambda: dict(q=heads(S, Hq, D), k=heads(S, Hkv, D), **dict(zip(("cos", "sin"), cos_sin(S, D, start)))),
        RO.rotary, RO.rotary_ref, qk_bytes, 3 * S * (Hq + Hkv) * D,
    ))
    if m["qk_norm"]:
        out.append(Case(
            "qk_norm_rotary", name, phase, f"q[1,{Hq},{S},{D}] k[1,{Hkv},{S},{D}]",
            lambda: dict(
                q=heads(S, Hq, D), k=heads(S, Hkv, D), **dict(zip(("cos", "sin"), cos_sin(S, D, start))),
                q_weight=randn(D, scale=0.1) + 1, k_weight=randn(D, scale=0.1) + 1, eps=eps),
            RO.qk_norm_rotary, RO.qk_norm_rotary_ref, qk_bytes + 2 * D * es, 7 * S * (Hq + Hkv) * D,
        ))
    out.append(Case(
        "silu_and_mul", name, phase, f"gate,up[1,{S},{I}]",
        lambda: dict(gate=randn(1, S, I, scale=2), up=randn(1, S, I)),
        SW.silu_and_mul, SW.silu_and_mul_ref, 3 * S * I * es, 6 * S * I,
    ))
    wg, wu = randn(I, H, scale=H**-0.5), randn(I, H, scale=H**-0.5)
    out.append(Case(
        "swiglu_fused", name, phase, f"x[1,{S},{H}] w[{I},{H}]x2",
        lambda: dict(x=randn(1, S, H), w_gate=wg, w_up=wu),
        SW.swiglu_fused, SW.swiglu_fused_ref, (S * H + 2 * I * H + S * I) * es, 4 * S * H * I,
    ))
    return out


def _attention_cases(name: str, m: dict, prompt_len: int, decode_len: int, inp: _Inputs, es: int) -> list[Case]:
    """Prefill attention over the prompt; decode attention over a cache, plain and with the static-cache update."""
    from kernels_runtime.ops import attention_decode as AD
    from kernels_runtime.ops import attention_prefill as AP

    Hq, Hkv, D = m["heads"], m["kv_heads"], m["head_dim"]
    randn, heads = inp.randn, inp.heads
    S = prompt_len
    out = [Case(
        "attention_prefill", name, "prefill", f"q[1,{Hq},{S},{D}] kv[1,{Hkv},{S},{D}]",
        lambda: dict(q=heads(S, Hq, D), k=heads(S, Hkv, D), v=heads(S, Hkv, D), scale=D**-0.5),
        AP.attention_prefill, AP.attention_prefill_ref,
        (2 * Hq + 2 * Hkv) * S * D * es, 2 * Hq * S * S * D,  # causal: half of 4 * S^2 * D per head
    )]
    for kv_len in (prompt_len + 1, prompt_len + decode_len):
        out.append(Case(
            "attention_decode", name, "decode", f"q[1,{Hq},1,{D}] cache[1,{Hkv},{kv_len},{D}]",
            lambda kv_len=kv_len: dict(
                q=randn(1, Hq, 1, D), k_cache=randn(1, Hkv, kv_len, D), v_cache=randn(1, Hkv, kv_len, D)),
            AD.attention_decode, AD.attention_decode_ref,
            (2 * Hkv * kv_len * D + 2 * Hq * D) * es, 4 * Hq * kv_len * D,
        ))
    s_max = prompt_len + decode_len
    for cache_len in (prompt_len, s_max - 1):
        out.append(Case(
            "attention_decode_update", name, "decode",
            f"q[1,{Hq},1,{D}] cache[1,{Hkv},{s_max},{D}] len {cache_len}",
            lambda cache_len=cache_len: dict(
                q=randn(1, Hq, 1, D), k_new=randn(1, Hkv, 1, D), v_new=randn(1, Hkv, 1, D),
                k_cache=randn(1, Hkv, s_max, D), v_cache=randn(1, Hkv, s_max, D), cache_len=cache_len),
            AD.attention_decode_update, AD.attention_decode_update_ref,
            (2 * Hkv * (cache_len + 2) * D + 2 * Hq * D) * es, 4 * Hq * (cache_len + 1) * D,
            timed_ref=_static_update_ref, inplace=("k_cache", "v_cache"),
        ))
    return out


def _cases(models: dict, prompt_len: int, decode_len: int, dtype, device) -> list[Case]:
    import torch

    inp, es = _Inputs(dtype, device), torch.empty((), dtype=dtype).element_size()
    out: list[Case] = []
    for name, m in models.items():
        for phase, S in (("prefill", prompt_len), ("decode", 1)):
            out += _phase_cases(name, m, phase, S, 0 if phase == "prefill" else prompt_len, inp, es)
        out += _attention_cases(name, m, prompt_len, decode_len, inp, es)
    return out


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _check(case: Case) -> tuple[bool, float, str]:
    """Fresh inputs; poisoned output memory; kernel vs ref; inputs other than `inplace` left untouched."""
    import torch

    from kernels_runtime.tolerances import compare

    args = case.make()
    ref_args = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor) and k not in case.inplace}
    refs = _as_tuple(case.ref(**ref_args))
    poison = [torch.full_like(r, float("nan")) for r in refs]
    del poison
    outs = _as_tuple(case.kernel(**args)) + tuple(args[k] for k in case.inplace)
    if len(outs) != len(refs):
        return False, float("inf"), f"expected {len(refs)} outputs, got {len(outs)}"
    worst, reasons = 0.0, []
    for i, (o, r) in enumerate(zip(outs, refs)):
        rep = compare(o, r)
        worst = max(worst, rep.max_abs)
        if not rep.ok:
            reasons.append(f"out{i}: {rep.reason}")
    for k, v in before.items():
        if not torch.equal(args[k], v):
            reasons.append(f"input {k} was modified")
    return not reasons, worst, "; ".join(reasons)


def _timer(device: str):
    if device.startswith("cuda"):
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, quantiles=list(QUANTILES))

    def cpu_time(fn, n=3):  # the --tiny path: wall clock, a handful of calls
        fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        ts.sort()
        return [ts[0], ts[len(ts) // 2], ts[-1]]

    return cpu_time


def _run(case: Case, bench, dtype, env) -> Row:
    ok, max_abs, reason = _check(case)
    args = case.make()
    ref_fn = case.timed_ref or case.ref
    r20, r50, r80 = bench(lambda: ref_fn(**args))
    t20, t50, t80 = bench(lambda: case.kernel(**args))
    return Row(
        case.op, case.model, case.phase, case.shape, str(dtype).removeprefix("torch."), ok, max_abs, reason,
        r20, r50, r80, t20, t50, t80, r50 / t50 if t50 > 0 else 0.0,
        case.bytes / (t50 * 1e-3) / 1e9 if t50 > 0 else 0.0, case.flops / (t50 * 1e-3) / 1e12 if t50 > 0 else 0.0,
        **env,
    )


def _print_row(row: Row) -> None:
    compute_bound = row.phase == "prefill" and row.op in ("swiglu_fused", "attention_prefill")
    unit = f"{row.tflops:8.1f} TFLOP/s" if compute_bound else f"{row.gbps:8.0f} GB/s   "
    flag = "ok " if row.correct else "BAD"
    print(
        f"{flag} {row.op:24s} {row.model:11s} {row.phase:7s} {row.shape:46s} "
        f"{row.ref_ms_p50:9.4f} {row.triton_ms_p50:9.4f} {row.speedup:6.2f}x {unit}"
        + ("" if row.correct else f"  [{row.reason}]"),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="JSON-lines file to write (one row per case)")
    p.add_argument("--models", nargs="+", help="subset of model names")
    p.add_argument("--ops", nargs="+", help="subset of op names")
    p.add_argument("--dry-run", action="store_true", help="list the cases (inputs built on 'meta'), run nothing")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, fp32, Triton interpreter on the CPU")
    args = p.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

    import torch
    import triton

    from kernels_runtime.interp import enable_fast_interpreter

    enable_fast_interpreter()  # --tiny (a no-op on the GPU)
    models, prompt_len, decode_len = (
        (TINY_MODELS, TINY_PROMPT_LEN, TINY_DECODE_LEN) if args.tiny else (MODELS, PROMPT_LEN, DECODE_LEN)
    )
    models = {k: v for k, v in models.items() if not args.models or k in args.models}
    dtype = torch.float32 if args.tiny else torch.bfloat16
    device = "meta" if args.dry_run else ("cpu" if args.tiny else "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_transformer_ops: expected a CUDA GPU, got none (use --tiny or --dry-run)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    cases = [c for c in _cases(models, prompt_len, decode_len, dtype, device) if not args.ops or c.op in args.ops]
    if args.dry_run:
        for c in cases:
            shapes = {k: tuple(v.shape) for k, v in c.make().items() if isinstance(v, torch.Tensor)}
            print(f"{c.op:24s} {c.model:11s} {c.phase:7s} {c.shape:46s} {c.bytes / 1e6:9.2f} MB {c.flops / 1e9:9.3f} GFLOP {shapes}")
        print(f"{len(cases)} cases")
        return 0

    env = dict(
        gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        torch=torch.__version__, triton=triton.__version__,
    )
    bench = _timer(device)
    print(f"{env}\n    {'op':24s} {'model':11s} {'phase':7s} {'shape':46s} {'ref ms':>9s} {'triton ms':>9s} {'speedup':>7s}")
    t0, rows = time.perf_counter(), []
    for case in cases:
        rows.append(_run(case, bench, dtype, env))
        _print_row(rows[-1])
        if args.out:
            with args.out.open("a" if len(rows) > 1 else "w") as f:
                f.write(json.dumps(asdict(rows[-1])) + "\n")
    bad = [r for r in rows if not r.correct]
    print(f"{len(rows)} cases, {len(bad)} incorrect, {time.perf_counter() - t0:.1f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
