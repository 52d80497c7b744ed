"""TileMix on the GPU: correctness, the int8 dot's instructions, and the accuracy/throughput frontier.

python scripts/gpu/tilemix_bench.py check --out DIR      # correctness vs the references, PTX/SASS, a config sweep
python scripts/gpu/tilemix_bench.py frontier --out DIR   # prompts x templates x coverages, vs SDPA flash; a model
python scripts/gpu/tilemix_bench.py plot --rows DIR/frontier.jsonl --out DIR   # the frontier PNG (no GPU)
python scripts/gpu/tilemix_bench.py record --rows DIR/frontier.jsonl --db FILE --bench-id ID   # into DuckDB (no GPU)
python scripts/gpu/tilemix_bench.py layer --out DIR      # one qwen3-4b attention layer at 16k: HF SDPA vs TileMix
python scripts/gpu/tilemix_bench.py tma --lengths 16384,32768 --out DIR   # K/V by TMA vs by pointers, vs SDPA

Rows go to DIR/*.jsonl (one JSON object a line); a short table is printed last. `frontier --db FILE` (or `record`
afterwards) also writes the frontier rows into DuckDB's `tilemix_frontier` through storage/, tied to `--run-id` /
`--workload` where given, which is what `llm4llm report` draws. Timing: triton.testing.do_bench
(L2 flushed before every call), the variants of one shape interleaved over rounds, every sample pooled; p20/p50/p80.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton

from kernels_runtime.ops import tilemix_attention as tm
from kernels_runtime.ops.attention_prefill import attention_prefill
from kernels_runtime.ops.tilemix_masks import TEMPLATES, build_tile_mask, uniform_mask

HQ, HKV, D = 32, 8, 128  # qwen3-4b attention
COVERAGES = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)


def versions() -> dict:
    import transformers

    return {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(), "python": platform.python_version()}


class Rows:
    def __init__(self, path: Path):
        self.f = path.open("a")

    def add(self, **row) -> dict:
        self.f.write(json.dumps(row, default=str) + "\n")
        self.f.flush()
        return row


def qkv(B, S, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(B, h, S, D, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    return mk(HQ), mk(HKV), mk(HKV)


def sdpa_flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def ref32(q, k, v, b=0, heads=8):
    """fp32 causal attention of batch row b, the first `heads` q heads (memory-efficient SDPA, exact softmax)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = HQ // HKV
    qf, kf, vf = (t[b:b + 1].float() for t in (q[:, :heads], k[:, :heads // g], v[:, :heads // g]))
    kf, vf = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True)


def rel_err(out, ref, b=0, heads=8) -> float:
    o = out[b:b + 1, :heads].float()
    return float((o - ref).norm() / ref.norm())


def bench(fns: dict, rounds: int, device: str = "cuda") -> dict:
    """name -> (p20, p50, p80 ms, samples): `rounds` rounds, each calling every variant once in turn (A B C A B C),
    L2 flushed before each call, timed by CUDA events around the call (on the CPU, a smoke run: wall time)."""
    if device != "cuda":
        return _bench_cpu(fns, rounds)
    flush = torch.empty(512 * 2**20, dtype=torch.int8, device="cuda")  # > the H200's 60 MiB L2
    samples = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples[n].append(start.elapsed_time(end))
    return _quantiles(samples)


def _bench_cpu(fns: dict, rounds: int) -> dict:
    samples = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            t = time.perf_counter()
            fn()
            samples[n].append((time.perf_counter() - t) * 1e3)
    return _quantiles(samples)


def _quantiles(samples: dict) -> dict:
    out = {}
    for n, s in samples.items():
        s = sorted(s)
        q = lambda p: s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
        out[n] = (q(0.2), q(0.5), q(0.8), len(s))
    return out


def compiled(fn) -> list:
    """The CompiledKernel objects a JITFunction holds (Triton 3.x device_caches)."""
    found = []
    for entry in getattr(fn, "device_caches", {}).values():
        for part in entry if isinstance(entry, tuple) else (entry,):
            if isinstance(part, dict):
                found += [v for v in part.values() if hasattr(v, "asm")]
    return found


def isa_report(out: Path, dump: bool = True) -> list[dict]:
    """Grep each compiled TileMix kernel's PTX and SASS for the tensor-core instructions of its dots and how its
    tiles are loaded (TMA bulk-tensor copies, cp.async); dump: the first INT8 kernel's PTX/SASS to DIR."""
    rows = []
    for i, k in enumerate(compiled(tm._tilemix_attention_kernel)):
        ptx = k.asm.get("ptx", "")
        sass = ""
        try:
            sass = k.asm["sass"]
        except Exception as e:  # noqa: BLE001 - fall back to nvdisasm on the cubin
            cubin = out / f"k{i}.cubin"
            cubin.write_bytes(k.asm["cubin"])
            for tool in ("nvdisasm", "cuobjdump"):
                exe = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
                try:
                    args = [str(exe), "-c", str(cubin)] if tool == "nvdisasm" else [str(exe), "-sass", str(cubin)]
                    sass = subprocess.run(args, capture_output=True, text=True, timeout=60).stdout
                    if sass:
                        break
                except Exception:  # noqa: BLE001
                    sass = f"(no sass: {e})"
            cubin.unlink(missing_ok=True)
        lines = ptx.splitlines()
        grep = lambda pat: sorted({l.strip().split()[0] for l in lines if all(p in l for p in pat)})  # noqa: E731
        sass_ops = sorted({w for l in sass.splitlines() for w in l.replace(";", " ").split()
                           if any(w.startswith(p) for p in ("IGMMA", "HGMMA", "IMMA", "HMMA", "QGMMA"))})
        meta = getattr(k, "metadata", None)
        md = {a: getattr(meta, a, None) for a in ("num_warps", "num_stages", "shared")} if meta else {}
        consts = str(getattr(meta, "constants", ""))[:300] if meta else ""
        rows.append({"kernel": i, "wgmma_s8": grep(("wgmma", ".s8")), "wgmma_bf16": grep(("wgmma", ".bf16")),
                     "mma_sync_s8": grep(("mma.sync", ".s8")), "sass_tensor_ops": sass_ops,
                     "n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
                     "has_int8_path": ".s8" in ptx, "tma_copies": ptx.count("cp.async.bulk.tensor"),
                     "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"), **md, "constants": consts})
        if dump and ".s8" in ptx and not (out / "tilemix_int8.ptx").exists():
            (out / "tilemix_int8.ptx").write_text(ptx)
            if sass:
                (out / "tilemix_int8.sass").write_text(sass)
    return rows


def check(out: Path) -> None:
    rows = Rows(out / "check.jsonl")
    print("versions", versions())
    torch.manual_seed(0)
    # 1. correctness on ragged packed sequences (GQA 32/8, d128) against the fp32 emulation of the routing
    lens = [1000, 517, 129]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    T = int(cu[-1])
    q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(T, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for ci, cfg in enumerate(tm.CONFIGS):  # every routing at the default config, every config at one routing
        for tpl, cov in ([(t, c) for t in TEMPLATES for c in (0.0, 0.5, 1.0)] if ci == 0 else [("sink_local", 0.5)]):
            if True:
                m = build_tile_mask(tpl, cov, max(lens), device="cuda")
                o = tm.tilemix_attention(q, k, v, m, cu_seqlens=cu, **cfg)
                r = tm.tilemix_attention_ref(q, k, v, m, cu_seqlens=cu)
                err = float((o.float() - r.float()).norm() / r.float().norm())
                rows.add(kind="correct_varlen", cfg=cfg, template=tpl, coverage=cov, rel_l2_vs_ref=err,
                         max_abs=float((o.float() - r.float()).abs().max()), finite=bool(torch.isfinite(o).all()))
    # 2. 0 % against the plain kernel, bit for bit, padded batch at the plain kernel's default config
    qb, kb, vb = qkv(2, 1500, seed=1)
    plain = attention_prefill(qb, kb, vb)
    for cfg in (tm.POINTER_DEFAULT, tm.CONFIGS[0]):
        for m in [uniform_mask(False, 1500, device="cuda")] + [build_tile_mask(t, 0.0, 1500, device="cuda")
                                                                 for t in TEMPLATES]:
            o = tm.tilemix_attention(qb, kb, vb, m, **cfg)
            rows.add(kind="bitwise_0pct", cfg=cfg, template=m.template, equal=bool(torch.equal(o, plain)),
                     max_abs=float((o.float() - plain.float()).abs().max()))
    # 3. INT8 KV cache input
    k8, ks = tm.quantize_int8(kb, torch.zeros(2, dtype=torch.int32, device="cuda"),
                              torch.full((2,), 1500, dtype=torch.int32, device="cuda"), 1500)
    v8, vs = tm.quantize_int8(vb, torch.zeros(2, dtype=torch.int32, device="cuda"),
                              torch.full((2,), 1500, dtype=torch.int32, device="cuda"), 1500)
    for cov in (0.0, 0.5, 1.0):
        m = build_tile_mask("sink_local", cov, 1500, device="cuda")
        o = tm.tilemix_attention(qb, k8, v8, m, k_scale=ks, v_scale=vs)
        r = tm.tilemix_attention_ref(qb, k8, v8, m, k_scale=ks, v_scale=vs)
        rows.add(kind="kv_int8", coverage=cov, rel_l2_vs_ref=float((o.float() - r.float()).norm() / r.float().norm()))
    # 4. which instructions the dots became
    for r in isa_report(out):
        rows.add(kind="isa", **r)
    # 5. a config sweep at 16k, batch 8
    S = 16384
    q, k, v = qkv(8, S, seed=2)
    fns = {"sdpa_flash": lambda: sdpa_flash(q, k, v), "plain_attention_prefill": lambda: attention_prefill(q, k, v)}
    masks = {"tm0": uniform_mask(False, S, device="cuda"), "tm100": uniform_mask(True, S, device="cuda"),
             "tm75_sink": build_tile_mask("sink_local", 0.75, S, device="cuda")}
    for name, m in masks.items():
        for ci, cfg in enumerate(tm.CONFIGS):
            fns[f"{name}/c{ci}"] = lambda m=m, cfg=cfg: tm.tilemix_attention(q, k, v, m, **cfg)
    for fn in fns.values():
        fn()
    t0 = time.time()
    times = bench(fns, rounds=3)
    flops = 2 * 8 * HQ * S * S * D  # causal: half of 4 B H S^2 D
    for n, (p20, p50, p80, ns) in times.items():
        rows.add(kind="sweep", S=S, B=8, variant=n, p20_ms=p20, p50_ms=p50, p80_ms=p80, samples=ns,
                 tflops=flops / p50 / 1e9, speedup_vs_sdpa=times["sdpa_flash"][1] / p50)
    print(f"sweep {time.time() - t0:.1f} s")
    summarize(out / "check.jsonl")


# The TMA sweep's tile configs: the pointer path's default, then the TMA path at the points that fit sm_90's shared
# memory with two loops' buffers (a config that does not compile is reported and left out)
TMA_SWEEP = [dict(tm.POINTER_DEFAULT)] + [
    {"BLOCK_M": 128, "BLOCK_N": bn, "num_warps": 8, "num_stages": st, "TMA": True}
    for bn, st in ((64, 2), (64, 3), (64, 4), (128, 2), (128, 3))]


def sdpa_cudnn(q, k, v):
    """cuDNN's SDPA on K/V already repeated to Hq heads: the backend and the call the model's SDPA makes (HF repeats
    K/V before SDPA; 2026-12-02-h200-d's layer bench saw cuDNN chosen at 16k)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def tma_sweep(out: Path, lengths, batch: int, rounds: int) -> None:
    """The TMA path against the pointer path, SDPA flash and cuDNN, at 0 %, 75 % (sink_local) and 100 % coverage:
    every variant of a length interleaved over `rounds`; each TMA output compared with the pointer path's at the
    same tiles (max |diff|), the default's error against fp32; rows to DIR/tma.jsonl."""
    rows = Rows(out / "tma.jsonl")
    print("versions", versions())
    for S in lengths:
        q, k, v = qkv(batch, S, seed=S)
        g = HQ // HKV
        kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        ref = ref32(q, k, v)
        masks = {"0": uniform_mask(False, S, device="cuda"), "75": build_tile_mask("sink_local", 0.75, S, device="cuda"),
                 "100": uniform_mask(True, S, device="cuda")}
        fns = {"sdpa_flash": lambda: sdpa_flash(q, k, v), "sdpa_cudnn": lambda: sdpa_cudnn(q, kr, vr)}
        outs = {}
        for cov, m in masks.items():
            for ci, cfg in enumerate(TMA_SWEEP):
                name = f"{cov}%/c{ci}"
                fn = lambda m=m, cfg=cfg: tm.tilemix_attention(q, k, v, m, **cfg)  # noqa: E731
                try:
                    outs[name] = fn()  # compiles; the warm-up call
                except Exception as e:  # noqa: BLE001 - a config that does not fit is reported, the rest go on
                    rows.add(kind="tma_skip", S=S, variant=name, cfg=cfg, error=f"{type(e).__name__}: {str(e)[:300]}")
                    continue
                fns[name] = fn
        for n in ("sdpa_flash", "sdpa_cudnn"):
            try:
                outs[n] = fns[n]()
            except Exception as e:  # noqa: BLE001 - a backend this build lacks is left out, said why
                rows.add(kind="tma_skip", S=S, variant=n, error=f"{type(e).__name__}: {str(e)[:300]}")
                del fns[n]
        for name, o in outs.items():
            cov, ci = (name.split("/c") + [None])[:2] if "/c" in name else (None, None)
            same = f"{cov}/c0" if cov else None
            diff = float((o.float() - outs[same].float()).abs().max()) if same in outs and name != same else None
            rows.add(kind="tma_check", S=S, variant=name, rel_err_fp32=rel_err(o, ref),
                     max_abs_vs_pointer=diff, finite=bool(torch.isfinite(o).all()))
        times = bench(fns, rounds)
        flops = 2 * batch * HQ * S * S * D
        base = {n: times[n][1] for n in ("sdpa_flash", "sdpa_cudnn") if n in times}
        for n, (p20, p50, p80, ns) in times.items():
            ci = int(n.split("/c")[1]) if "/c" in n else None
            rows.add(kind="tma", S=S, B=batch, variant=n, cfg=None if ci is None else TMA_SWEEP[ci], p20_ms=p20,
                     p50_ms=p50, p80_ms=p80, samples=ns, tflops=flops / p50 / 1e9,
                     **{f"vs_{b}": t / p50 for b, t in base.items()})
            print(f"S={S:6d} {n:12s} p50 {p50:8.3f} ms ({p20:.3f}-{p80:.3f}) {flops / p50 / 1e9:6.1f} TFLOP/s "
                  + " ".join(f"vs {b} {t / p50:.3f}" for b, t in base.items()), flush=True)
        del q, k, v, kr, vr, ref, outs
        torch.cuda.empty_cache()
    for r in isa_report(out, dump=False):
        rows.add(kind="isa", **r)
        print({x: r[x] for x in ("kernel", "tma_copies", "cp_async", "n_regs", "n_spills", "shared")}, r["constants"][:160])


def dequant_check(rows: Rows) -> None:
    """The int32 -> fp32 conversion: the magic-number path against the conversion instruction, bit for bit on a
    ragged batch, then timed at 16k x 8 (uniform INT8 and sink_local 75 %); falls back to "cvt" if it differs."""
    lens = [1000, 517, 129]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    q = torch.randn(int(cu[-1]), HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(int(cu[-1]), HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ok = True
    for cfg in (tm.CONFIGS[0], tm.POINTER_DEFAULT, tm.CONFIGS[6], tm.CONFIGS[9]):
        m = build_tile_mask("bigbird", 0.5, max(lens), device="cuda")
        outs = {}
        for mode in ("magic", "cvt"):
            tm.INT8_DEQUANT = mode
            outs[mode] = tm.tilemix_attention(q, k, v, m, cu_seqlens=cu, **cfg)
        r = tm.tilemix_attention_ref(q, k, v, m, cu_seqlens=cu)
        err = float((outs["magic"].float() - r.float()).norm() / r.float().norm())
        same = bool(torch.equal(outs["magic"], outs["cvt"]))
        ok = ok and same and err < 5e-3
        rows.add(kind="dequant_check", cfg=cfg, magic_equals_cvt=same, rel_l2_vs_ref=err)
    S = 16384
    q, k, v = qkv(8, S, seed=3)
    masks = {"all_int8": uniform_mask(True, S, device="cuda"),
             "sink_local@0.75": build_tile_mask("sink_local", 0.75, S, device="cuda")}
    fns = {}
    for name, m in masks.items():
        for mode in ("magic", "cvt"):
            for ci in (0, 4, 9):
                def fn(m=m, mode=mode, cfg=tm.CONFIGS[ci]):
                    tm.INT8_DEQUANT = mode
                    return tm.tilemix_attention(q, k, v, m, **cfg)
                fns[f"{name}/{mode}/c{ci}"] = fn
    fns["all_16bit/c0"] = lambda: tm.tilemix_attention(q, k, v, uniform_mask(False, S, device="cuda"), **tm.CONFIGS[0])
    for fn in fns.values():
        fn()
    for n, (p20, p50, p80, ns) in bench(fns, rounds=3).items():
        rows.add(kind="dequant_time", S=S, B=8, variant=n, p20_ms=p20, p50_ms=p50, p80_ms=p80, samples=ns)
        print(f"{n:32s} p50 {p50:8.3f} ms")
    tm.INT8_DEQUANT = "magic" if ok else "cvt"
    print("dequant:", tm.INT8_DEQUANT, "(magic path checked)" if ok else "(MAGIC PATH FAILED its check)")


def record_frontier(rows_path: Path, db_path: str, bench_id: str, run_id: str | None = None,
                    workload: str | None = None, gpu: str | None = None, versions_: dict | None = None) -> int:
    """The `frontier` rows of a frontier.jsonl into DuckDB's `tilemix_frontier` (a bench id recorded again is
    replaced); storage is imported here so that the GPU modes run without DuckDB."""
    from storage import repo
    from storage.db import Database
    from storage.rows import tilemix_frontier_rows

    records = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    rows = tilemix_frontier_rows(records, bench_id, run_id=run_id, workload_name=workload, gpu_name=gpu,
                                 versions=versions_, heads=(HQ, HKV, D))
    with Database(db_path) as db:
        n = repo.record_tilemix_frontier(db, rows)
    print(f"{n} tilemix_frontier rows into {db_path} (bench {bench_id})")
    return n


def frontier(out: Path, lengths, batch: int, model_len: int, db: dict | None = None) -> None:
    rows = Rows(out / "frontier.jsonl")
    print("versions", versions())
    t0 = time.time()
    dequant_check(rows)
    print(f"dequant check {time.time() - t0:.1f} s")
    for S in lengths:
        B = batch
        q, k, v = qkv(B, S, seed=S)
        ref = ref32(q, k, v)
        masks = {("all_16bit", 0.0): uniform_mask(False, S, device="cuda"),
                 ("all_int8", 1.0): uniform_mask(True, S, device="cuda")}
        for tpl in TEMPLATES:
            for cov in COVERAGES[1:-1]:
                masks[(tpl, cov)] = build_tile_mask(tpl, cov, S, device="cuda")
        fns = {"sdpa_flash": lambda: sdpa_flash(q, k, v)}
        for (tpl, cov), m in masks.items():
            fns[f"{tpl}@{cov}"] = lambda m=m: tm.tilemix_attention(q, k, v, m, tune=True)
        errs = {n: rel_err(fn(), ref) for n, fn in fns.items()}  # the warm-up call: tunes, compiles, and is checked
        times = bench(fns, rounds={4096: 10, 8192: 8, 16384: 5}.get(S, 3))
        flops = 2 * B * HQ * S * S * D
        base = {n: times[n][1] for n in ("sdpa_flash", "all_16bit@0.0", "all_int8@1.0")}
        for n, (p20, p50, p80, ns) in times.items():
            tpl, cov = n.split("@") if "@" in n else (n, None)
            m = masks.get((tpl, float(cov))) if cov is not None else None
            rows.add(kind="frontier", S=S, B=B, template=tpl, coverage=None if cov is None else float(cov),
                     realised=None if m is None else m.realised_coverage(S), p20_ms=p20, p50_ms=p50, p80_ms=p80,
                     samples=ns, tokens_per_s=B * S / (p50 / 1e3), tflops=flops / p50 / 1e9,
                     vs_sdpa=base["sdpa_flash"] / p50, vs_0pct=base["all_16bit@0.0"] / p50,
                     vs_100pct=base["all_int8@1.0"] / p50, rel_err_fp32=errs[n])
        del q, k, v, ref
        torch.cuda.empty_cache()
    for kk, cfg in tm._TUNED.items():
        rows.add(kind="tuned", key=str(kk), config=cfg)
    print(f"frontier done at {time.time() - t0:.1f} s")
    summarize(out / "frontier.jsonl")
    if db:
        v = versions()
        record_frontier(out / "frontier.jsonl", gpu=v["gpu"], versions_=v, **db)
    if model_len:
        try:
            model_check(rows, model_len)
        except Exception:  # noqa: BLE001 - the frontier rows are written already
            import traceback

            traceback.print_exc()


QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1_000_000.0, tie_word_embeddings=True)


def _register_tilemix(state: dict, device: str):
    """HF attention "tilemix": TileMix with state["mask"] for a prefill, SDPA otherwise (no mask, or decode)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def tilemix_fwd(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        if state["mask"] is None or query.shape[2] != key.shape[2] or query.shape[2] == 1:
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kw)
        o = tm.tilemix_attention(query, key, value, state["mask"], scaling, tune=device == "cuda")
        return o.transpose(1, 2), None

    AttentionInterface.register("tilemix", tilemix_fwd)
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionMaskInterface.register("tilemix", sdpa_mask)
    except ImportError:
        pass
    return tilemix_fwd


def _reference_tokens(model, batch, n):  # as llm4llm.accept (which needs pydantic, absent on the GPU image)
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, batch["input_ids"].shape[1]:], [x.float() for x in out.logits]


def _teacher_forced_logits(model, batch, tokens, n):
    from transformers import LogitsProcessorList

    plen = batch["input_ids"].shape[1]

    def force(input_ids, scores):
        out = torch.full_like(scores, -math.inf)
        return out.scatter_(1, tokens[:, input_ids.shape[1] - plen][:, None], 0.0)

    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([force]), output_logits=True,
                             return_dict_in_generate=True)
    return [x.float() for x in out.logits]


def _model_prefill_timing(rows: Rows, model, batch, state: dict, S: int, device: str) -> None:
    """The model's prefill, eager SDPA vs TileMix (sink_local at 75 %), one forward of the prompt."""
    for tpl, cov in (("sdpa", None), ("sink_local", 0.75), ("sdpa", None), ("sink_local", 0.75)):
        model.config._attn_implementation = "sdpa" if cov is None else "tilemix"
        state["mask"] = None if cov is None else build_tile_mask(tpl, cov, S, device=device)
        with torch.inference_mode():
            ts = []
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                model(**batch, use_cache=True, logits_to_keep=1)
                torch.cuda.synchronize()
                ts.append((time.perf_counter() - t) * 1e3)
        rows.add(kind="model_prefill", S=S, template=tpl, coverage=cov, ms=sorted(ts)[1], samples=ts)
        print(f"prefill {tpl}@{cov}: {sorted(ts)[1]:.1f} ms")


def model_check(rows: Rows, S: int, decode: int = 8, arch: dict = QWEN3_4B, device: str = "cuda",
                variants=None, prefill_timing: bool = True) -> None:
    """qwen3-4b architecture (random weights) with TileMix as its prefill attention vs its own bf16 SDPA run:
    teacher-forced logits rel-L2 (max over steps) and free-running greedy agreement."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(**arch)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    state = {"mask": None}
    _register_tilemix(state, device)
    ids = torch.randint(0, cfg.vocab_size, (1, S), device=device, generator=torch.Generator(device).manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    model.config._attn_implementation = "sdpa"
    tokens, base_logits = _reference_tokens(model, batch, decode)
    model.config._attn_implementation = "tilemix"
    variants = variants or [("all_16bit", 0.0)] + [("sink_local", c) for c in COVERAGES[1:]] + [
        ("bigbird", 0.75), ("row_random", 0.75)]
    for tpl, cov in variants:
        state["mask"] = uniform_mask(False, S, device=device) if cov == 0 else build_tile_mask(tpl, cov, S,
                                                                                             device=device)
        logits = _teacher_forced_logits(model, batch, tokens, decode)
        dev = max(float((a - b).norm() / b.norm()) for a, b in zip(logits, base_logits))
        free, _ = _reference_tokens(model, batch, decode)
        agree = float((free == tokens).float().mean())
        top1 = float(torch.stack([(a.argmax(-1) == b.argmax(-1)).float().mean() for a, b in
                                  zip(logits, base_logits)]).mean())
        rows.add(kind="model", S=S, template=tpl, coverage=cov, max_logits_rel_l2=dev, greedy_agreement=agree,
                 teacher_forced_top1_agreement=top1, decode=decode)
        print(f"model {tpl}@{cov}: logits rel-L2 {dev:.4f}, greedy agreement {agree:.3f}")
    if prefill_timing:
        _model_prefill_timing(rows, model, batch, state, S, device)
    for kk, cfg in tm._TUNED.items():
        if kk[0] == 1:  # the model's batch of one
            rows.add(kind="tuned_model", key=str(kk), config=cfg)


TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=128, rope_theta=1_000_000.0)


def _attention_layer(arch: dict, S: int, device: str):
    """One Qwen3Attention (random weights, bf16) as the model builds it, its input [1, S, hidden] and rotary."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    cfg = Qwen3Config(**arch)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attn = Qwen3Attention(cfg, 0).to(device=device, dtype=torch.bfloat16).eval()
    x = torch.randn(1, S, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    pe = Qwen3RotaryEmbedding(cfg).to(device)(x, torch.arange(S, device=device)[None])
    return cfg, attn, x, pe


def _template_call(attn, x, pe, template: str, coverage: float):
    """The optimize flow's patch for this layer: attention.prefill_tilemix's rendered entry at its default config
    (the routing from the arguments) on the layer's own weights, as the dispatch calls it for a prompt."""
    from types import SimpleNamespace

    from llm4llm.search.templates.tilemix import TEMPLATES as TM_TEMPLATES

    tpl = TM_TEMPLATES[0]
    spec = SimpleNamespace(family="attention", phase="prefill", dtype="bfloat16", static={}, hardware={})
    cfg = {**tpl.default_fn(spec), "tm_template": template, "tm_coverage": coverage}
    ns: dict = {"__name__": "tilemix_bench_candidate"}
    exec(compile(tpl.render_fn(spec, cfg), "<attention.prefill_tilemix>", "exec"), ns)  # noqa: S102
    weights = {f"{n}.weight": getattr(attn, n).weight for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    weights |= {"q_norm.weight": attn.q_norm.weight, "k_norm.weight": attn.k_norm.weight}
    static = {"head_dim": attn.head_dim, "scaling": attn.scaling, "q_norm.variance_epsilon": attn.q_norm.variance_epsilon}
    inputs = {"hidden_states": x, "position_embeddings.0": pe[0], "position_embeddings.1": pe[1]}
    return lambda: ns["entry"](inputs, weights, {}, static)["out"]


def _layer_call(cfg, attn, x, pe, impl: str):
    """The layer's prefill as the model makes it: a fresh DynamicCache, no mask (HF's causal skip)."""
    from transformers import DynamicCache

    cfg._attn_implementation = impl
    with torch.inference_mode():
        return attn(x, pe, None, past_key_values=DynamicCache(config=cfg))[0]


def _captured_qkv(cfg, attn, x, pe):
    """q, k, v exactly as they reach the attention function in the model (q a transposed view of [1, S, Hq, D];
    k, v the DynamicCache's contiguous copies)."""
    from transformers import AttentionInterface

    seen = {}

    def grab(module, q, k, v, mask, **kw):
        seen.update(q=q, k=k, v=v, mask=mask)
        return torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype, device=q.device), None

    AttentionInterface.register("tilemix_grab", grab)
    _layer_call(cfg, attn, x, pe, "tilemix_grab")
    return seen["q"], seen["k"], seen["v"], seen["mask"]


def _sdpa_forced(attn, q, k, v, backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with sdpa_kernel(getattr(SDPBackend, backend)):
        return sdpa_attention_forward(attn, q, k, v, None, scaling=attn.scaling)[0]


def _sdpa_ops(attn, q, k, v) -> list[str]:
    """The op and kernel names of one default-backend SDPA call (which backend the model's SDPA takes)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if q.is_cuda else [])
    with profile(activities=acts) as prof:
        sdpa_attention_forward(attn, q, k, v, None, scaling=attn.scaling)
    keys = ("scaled_dot_product", "flash", "fmha", "cudnn", "efficient", "attention")
    return sorted({e.key for e in prof.key_averages() if any(w in e.key.lower() for w in keys)})[:20]


def _layer_variants(cfg, attn, x, pe, mask, state: dict, device: str) -> tuple[dict, dict]:
    """name -> a call, and the outputs compared bit for bit (kernel on the model's layouts vs on contiguous ones)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    fwd = _register_tilemix(state, device)
    q, k, v, hf_mask = _captured_qkv(cfg, attn, x, pe)
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    z32 = lambda n: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
    full = lambda n: torch.full((n,), q.shape[2], dtype=torch.int32, device=device)  # noqa: E731
    tune = device == "cuda"
    fns = {"hf_layer_sdpa": lambda: _layer_call(cfg, attn, x, pe, "sdpa"),
           "hf_layer_tilemix": lambda: _layer_call(cfg, attn, x, pe, "tilemix"),
           "template_entry": _template_call(attn, x, pe, mask.template, mask.coverage),
           "sdpa_default": lambda: sdpa_attention_forward(attn, q, k, v, None, scaling=attn.scaling)[0],
           "tilemix_fwd": lambda: fwd(attn, q, k, v, None, scaling=attn.scaling)[0],
           "kernel_model_layout": lambda: tm.tilemix_attention(q, k, v, mask, attn.scaling, tune=tune),
           "kernel_contiguous": lambda: tm.tilemix_attention(qc, kc, vc, mask, attn.scaling, tune=tune),
           "quantize_q": lambda: tm.quantize_int8(q, z32(1), full(1), q.shape[2]),
           "quantize_k": lambda: tm.quantize_int8(k, z32(1), full(1), k.shape[2])}
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        try:
            _sdpa_forced(attn, q, k, v, backend)
        except Exception as e:  # noqa: BLE001 - a backend this build or device lacks is left out, said why
            state.setdefault("skipped", {})[backend] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        fns[f"sdpa_{backend.split('_')[0].lower()}"] = lambda b=backend: _sdpa_forced(attn, q, k, v, b)
    outs = {n: fns[n]() for n in ("kernel_model_layout", "kernel_contiguous", "tilemix_fwd", "hf_layer_sdpa",
                                  "hf_layer_tilemix")}  # also the warm-up: tunes and compiles
    checks = {"hf_mask_is_none": hf_mask is None,
              "kernel_layouts_equal": bool(torch.equal(outs["kernel_model_layout"], outs["kernel_contiguous"])),
              "fwd_equals_kernel": bool(torch.equal(outs["tilemix_fwd"], outs["kernel_model_layout"].transpose(1, 2))),
              "layer_rel_l2_vs_sdpa": _rel(outs["hf_layer_tilemix"], outs["hf_layer_sdpa"]),
              "template_rel_l2_vs_sdpa": _rel(fns["template_entry"](), outs["hf_layer_sdpa"]),
              "strides": {n: list(t.stride()) for n, t in (("q", q), ("k", k), ("v", v))},
              "sdpa_ops": _sdpa_ops(attn, q, k, v)}
    return fns, checks


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def layer(out: Path, S: int, rounds: int, device: str, arch: dict, template: str, coverage: float) -> None:
    """One qwen3-4b attention layer's prefill at S tokens (batch 1, as the model ran it), interleaved over
    `rounds`: HF's layer with SDPA and with TileMix (the model measurement's patch), the optimize flow's template
    entry for the layer, the SDPA call alone (default backend and each forced one), TileMix's attention function,
    the bare kernel on the model's layouts and on contiguous copies, and the two quantisation kernels; rows to
    DIR/layer.jsonl."""
    rows = Rows(out / "layer.jsonl")
    print("versions", versions() if device == "cuda" else {"torch": torch.__version__})
    cfg, attn, x, pe = _attention_layer(arch, S, device)
    mask = build_tile_mask(template, coverage, S, device=device)
    state = {"mask": mask}
    fns, checks = _layer_variants(cfg, attn, x, pe, mask, state, device)
    rows.add(kind="layer_check", S=S, template=template, coverage=coverage, skipped=state.get("skipped", {}),
             **checks)
    times = bench(fns, rounds, device)
    base, sdpa = times["hf_layer_sdpa"][1], times["sdpa_default"][1]
    for n, (p20, p50, p80, ns) in times.items():
        rows.add(kind="layer", S=S, variant=n, p20_ms=p20, p50_ms=p50, p80_ms=p80, samples=ns,
                 vs_hf_layer_sdpa=base / p50, vs_sdpa_default=sdpa / p50)
        print(f"{n:22s} p50 {p50:9.3f} ms ({p20:.3f}-{p80:.3f})  layer/this x{base / p50:.3f}")
    for kk, cfg_ in tm._TUNED.items():
        rows.add(kind="tuned", key=str(kk), config=cfg_)
    print(checks)


def summarize(path: Path) -> None:
    rows = [json.loads(l) for l in path.read_text().splitlines()]
    for r in rows:
        if r["kind"] in ("correct_varlen",) and r["rel_l2_vs_ref"] > 5e-3:
            print("BAD", r)
        if r["kind"] in ("bitwise_0pct", "kv_int8", "isa"):
            print(r)
        if r["kind"] == "sweep":
            print(f"{r['variant']:28s} p50 {r['p50_ms']:8.3f} ms  {r['tflops']:6.1f} TFLOP/s  "
                  f"x{r['speedup_vs_sdpa']:.3f} vs sdpa")
        if r["kind"] in ("dequant_check", "model", "model_prefill"):
            print(r)
        if r["kind"] == "frontier":
            print(f"S={r['S']:6d} {r['template']:11s} {str(r['coverage']):5s} p50 {r['p50_ms']:8.3f} ms "
                  f"{r['tflops']:6.1f} TF/s sdpa x{r['vs_sdpa']:.3f} 0% x{r['vs_0pct']:.3f} "
                  f"err {r['rel_err_fp32']:.2e}")
    bad = [r for r in rows if r["kind"] == "correct_varlen" and (r["rel_l2_vs_ref"] > 5e-3 or not r["finite"])]
    print(f"{len([r for r in rows if r['kind'] == 'correct_varlen'])} varlen checks, {len(bad)} bad")


def plot(rows_path: Path, png: Path) -> None:
    """The frontier: speed over SDPA flash against the output's error vs fp32, one panel per prompt length, one line
    per routing template through its coverages (0 % and 100 % shared), SDPA flash as a point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(l) for l in rows_path.read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "frontier"]
    lengths = sorted({r["S"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 4.0), sharey=True)
    for ax, S in zip(axes if len(lengths) > 1 else [axes], lengths):
        at = {(r["template"], r["coverage"]): r for r in rows if r["S"] == S}
        ends = at[("all_16bit", 0.0)], at[("all_int8", 1.0)]
        for tpl, marker in zip(TEMPLATES, "osD"):
            pts = [ends[0]] + [at[(tpl, c)] for c in COVERAGES[1:-1]] + [ends[1]]
            ax.plot([p["rel_err_fp32"] for p in pts], [p["vs_sdpa"] for p in pts], marker=marker, label=tpl)
            for p, c in zip(pts, COVERAGES):
                ax.annotate(f"{c:.0%}", (p["rel_err_fp32"], p["vs_sdpa"]), fontsize=6, xytext=(2, 2),
                            textcoords="offset points")
        sd = at[("sdpa_flash", None)]
        ax.plot([sd["rel_err_fp32"]], [1.0], "k*", markersize=10, label="SDPA flash (bf16)")
        ax.axhline(1.4, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"prompt {S // 1024}k, batch {sd['B']}")
        ax.set_xlabel("output rel-L2 error vs fp32")
        ax.grid(alpha=0.3)
    (axes[0] if len(lengths) > 1 else axes).set_ylabel("throughput / SDPA flash")
    (axes[0] if len(lengths) > 1 else axes).legend(fontsize=7, loc="lower right")
    fig.suptitle("TileMix on the H200: qwen3-4b attention (32 q / 8 kv heads, d128), causal prefill; "
                 "dotted: the 1.4x target", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=130)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["check", "frontier", "plot", "record", "layer", "tma"])
    ap.add_argument("--rows", help="plot, record: the frontier.jsonl to read")
    ap.add_argument("--db", help="frontier, record: the DuckDB file the frontier rows go to")
    ap.add_argument("--bench-id", help="frontier, record: the bench's id in DuckDB (default: tilemix-<UTC time>)")
    ap.add_argument("--run-id", help="frontier, record: the run the bench belongs to (its report shows it)")
    ap.add_argument("--workload", help="frontier, record: the workload the bench belongs to (its reports show it)")
    ap.add_argument("--gpu", help="record: the GPU name (frontier mode records its own)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--model-len", type=int, default=0)
    ap.add_argument("--seq", type=int, default=16384, help="layer: prompt length")
    ap.add_argument("--rounds", type=int, default=7, help="layer: interleaved rounds")
    ap.add_argument("--device", default="cuda", help="layer: cpu for a smoke run (TRITON_INTERPRET=1)")
    ap.add_argument("--arch", choices=["qwen3-4b", "tiny"], default="qwen3-4b", help="layer: the attention's shape")
    ap.add_argument("--template", default="sink_local", help="layer: TileMix routing template")
    ap.add_argument("--coverage", type=float, default=0.75, help="layer: INT8 coverage")
    a = ap.parse_args()
    from kernels_runtime.interp import enable_fast_interpreter

    enable_fast_interpreter()  # layer --device cpu under TRITON_INTERPRET=1 (a no-op on the GPU)
    db = None
    if a.db:
        db = {"db_path": a.db, "bench_id": a.bench_id or time.strftime("tilemix-%Y%m%dT%H%M%SZ", time.gmtime()),
              "run_id": a.run_id, "workload": a.workload}
    if a.mode == "record":
        if not (a.rows and db):
            ap.error("record: expected --rows FILE and --db FILE")
        record_frontier(Path(a.rows), gpu=a.gpu, **db)
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.mode == "plot":
        plot(Path(a.rows), out / "frontier.png")
        return
    if a.mode == "layer":
        (out / "command.txt").write_text(" ".join(sys.argv) + "\n")
        layer(out, a.seq, a.rounds, a.device, QWEN3_4B if a.arch == "qwen3-4b" else TINY, a.template, a.coverage)
        return
    (out / "command.txt").write_text(" ".join(sys.argv) + "\n" + json.dumps(versions()) + "\n")
    if a.mode == "check":
        check(out)
    elif a.mode == "tma":
        tma_sweep(out, [int(x) for x in a.lengths.split(",")], a.batch, a.rounds)
    else:
        frontier(out, [int(x) for x in a.lengths.split(",")], a.batch, a.model_len, db)


if __name__ == "__main__":
    main()
