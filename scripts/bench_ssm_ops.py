"""Benchmark the state-space / recurrent ops against their `_ref` (HF torch-path equivalent) at real model shapes.

    python scripts/bench_ssm_ops.py --out ssm_ops.jsonl            # CUDA: mamba-130m, mamba2-2.7b, recurrentgemma-2b
    python scripts/bench_ssm_ops.py --dry-run --out /tmp/dry.jsonl # CPU, Triton interpreter, tiny shapes
    python scripts/bench_ssm_ops.py --mamba-ssm .mamba_ssm --out x.jsonl  # + mamba_ssm's Triton kernels as a provider

`--mamba-ssm DIR` puts DIR on sys.path and adds mamba_ssm's own Triton kernels, called directly, as a third provider
where one exists: `selective_state_update` (Mamba decode, and Mamba2 decode through its multi-head form) and
`mamba_chunk_scan_combined` (Mamba2 prefill). mamba_ssm has no Triton selective scan or causal conv1d (those are CUDA
extensions, which cannot be built on the GPU image), so those rows have no third provider. DIR holds the package's
`ops/triton` and `utils` with empty package `__init__`s (the released `mamba_ssm/__init__.py` imports the CUDA
extensions).

Per case: correctness of the kernel vs `_ref` (outputs allocated by the launcher are poisoned with NaN, so an
unwritten element fails; in-place state is compared too), then timing of both with triton.testing.do_bench
(quantiles 0.2/0.5/0.8). Prints a table; writes one JSON line per (case, provider) to --out.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from kernels_runtime.ops import causal_conv1d as cc  # noqa: E402
from kernels_runtime.ops import rglru as rg  # noqa: E402
from kernels_runtime.ops import selective_scan as ss  # noqa: E402
from kernels_runtime.ops import ssd  # noqa: E402
from kernels_runtime.tolerances import compare  # noqa: E402


@dataclasses.dataclass
class Row:
    op: str
    model: str
    provider: str  # "triton" | "ref"
    shape: str
    dtype: str
    p20_ms: float
    p50_ms: float
    p80_ms: float
    gbps: float
    correct: bool
    max_abs_err: float
    note: str
    gpu: str
    torch: str
    triton: str


@dataclasses.dataclass
class Case:
    op: str
    model: str
    shape: str
    dtype: torch.dtype
    inputs: dict  # name -> tensor; "state" (if present) is updated in place by both providers
    kernel: object  # fn(**inputs) -> tuple of tensors
    ref: object
    alts: dict = dataclasses.field(default_factory=dict)  # other provider name -> fn(**inputs), e.g. "mamba_ssm"


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty returns NaN-filled float tensors, so elements a kernel fails to write show up as NaN."""
    orig = torch.empty

    def empty(*a, **k):
        t = orig(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = orig


def _clone(inputs):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def check(case: Case, kernel=None) -> tuple[bool, float, str]:
    a, b = _clone(case.inputs), _clone(case.inputs)
    with poisoned_empty():
        outs = (kernel or case.kernel)(**a)
    refs = case.ref(**b)
    if "state" in a:
        outs, refs = (*outs, a["state"]), (*refs, b["state"])
    ok, err, note = True, 0.0, ""
    for i, (o, r) in enumerate(zip(outs, refs)):
        rep = compare(o, r.to(o.dtype), case.dtype)
        ok, err = ok and rep.ok, max(err, rep.max_abs)
        if not rep.ok:
            note += f"out{i}: {rep.reason}; "
    return ok, err, note


def timeit(fn, inputs, dry):
    if dry:
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn(**inputs)
            ts.append((time.perf_counter() - t0) * 1e3)
        ts.sort()
        return ts[0], ts[1], ts[2]
    return tuple(triton.testing.do_bench(lambda: fn(**inputs), warmup=10, rep=60, quantiles=[0.2, 0.5, 0.8]))


def nbytes(inputs, outs):
    return sum(t.numel() * t.element_size() for t in list(inputs.values()) + list(outs) if isinstance(t, torch.Tensor))


MSSM: dict = {}  # filled by load_mamba_ssm: "ssu" -> selective_state_update, "chunk" -> mamba_chunk_scan_combined


def load_mamba_ssm(path: str) -> str:
    sys.path.insert(0, os.path.abspath(path))
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as e:  # noqa: BLE001 - reported, the bench runs without the provider
        return f"mamba_ssm not loaded from {path}: {type(e).__name__}: {e}"
    MSSM.update(ssu=selective_state_update, chunk=mamba_chunk_scan_combined)
    try:
        from importlib.metadata import version
        v = version("mamba_ssm")
    except Exception:  # noqa: BLE001
        v = open(os.path.join(path, "SOURCE.txt")).read().split(" (")[0] if os.path.exists(
            os.path.join(path, "SOURCE.txt")) else "unknown version"
    return f"mamba_ssm Triton kernels loaded: {v}"


def mamba_cases(dev, dtype, Bsz, D, N, K, L, model):
    r = lambda *s, dt=dtype: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
    A = -torch.exp(torch.randn(D, N, device=dev) * 0.5)
    Dv, dbias = r(D, dt=torch.float32), r(D, dt=torch.float32) * 0.5
    w, b = r(D, K) / K**0.5, r(D)
    sh = f"B={Bsz} D={D} N={N} K={K} L={L}"
    conv_in = {"x": r(Bsz, D, L), "weight": w, "bias": b}
    conv_up = {"x": r(Bsz, D), "state": r(Bsz, D, K), "weight": w, "bias": b}
    scan_in = {"u": r(Bsz, D, L), "delta": r(Bsz, D, L) * 0.5 - 1, "A": A, "B": r(Bsz, N, L), "C": r(Bsz, N, L),
               "D": Dv, "z": r(Bsz, D, L), "delta_bias": dbias}
    upd_in = {"state": torch.randn(Bsz, D, N, device=dev), "x": r(Bsz, D), "dt": r(Bsz, D) * 0.5 - 1, "A": A,
              "B": r(Bsz, N), "C": r(Bsz, N), "D": Dv, "z": r(Bsz, D), "dt_bias": dbias}

    def conv_k(x, weight, bias):
        return cc.causal_conv1d(x, weight, bias, silu=True)

    def conv_r(x, weight, bias):
        return cc.causal_conv1d_ref(x, weight, bias, silu=True)

    def up_k(x, state, weight, bias):
        return (cc.causal_conv1d_update(x, state, weight, bias, silu=True),)

    def up_r(x, state, weight, bias):
        return (cc.causal_conv1d_update_ref(x, state, weight, bias, silu=True),)

    def su_k(state, **kw):
        return (ss.selective_state_update(state, **kw),)

    def su_r(state, **kw):
        return (ss.selective_state_update_ref(state, **kw),)

    def su_m(state, x, dt, A, B, C, D, z, dt_bias):  # mamba_ssm: same layout, its own Triton kernel
        return (MSSM["ssu"](state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True),)

    return [
        Case("causal_conv1d", model, f"B={Bsz} C={D} K={K} L={L}", dtype, conv_in, conv_k, conv_r),
        Case("causal_conv1d_update", model, f"B={Bsz} C={D} K={K}", dtype, conv_up, up_k, up_r),
        Case("selective_scan", model, sh, dtype, scan_in, ss.selective_scan, ss.selective_scan_ref),
        Case("selective_state_update", model, sh.replace(f" L={L}", ""), dtype, upd_in, su_k, su_r,
             {"mamba_ssm": su_m} if MSSM else {}),
    ]


def mamba2_cases(dev, dtype, Bsz, H, P, G, N, K, L, chunk, model):
    r = lambda *s, dt=dtype: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
    conv_dim = H * P + 2 * G * N
    A = -torch.exp(torch.randn(H, device=dev) * 0.5)
    Dv, dbias = r(H), r(H) * 0.5
    w, b = r(conv_dim, K) / K**0.5, r(conv_dim)
    sc = N**-0.25
    pre = {"x": r(Bsz, L, H, P), "dt": r(Bsz, L, H) * 0.5 - 1, "A": A, "B": r(Bsz, L, G, N) * sc,
           "C": r(Bsz, L, G, N) * sc, "D": Dv, "dt_bias": dbias}
    upd = {"state": torch.randn(Bsz, H, P, N, device=dev), "x": r(Bsz, H, P), "dt": r(Bsz, H) * 0.5 - 1, "A": A,
           "B": r(Bsz, G, N) * sc, "C": r(Bsz, G, N) * sc, "D": Dv, "dt_bias": dbias}
    conv_in = {"x": r(Bsz, conv_dim, L), "weight": w, "bias": b}

    def conv_k(x, weight, bias):
        return cc.causal_conv1d(x, weight, bias, silu=True)

    def conv_r(x, weight, bias):
        return cc.causal_conv1d_ref(x, weight, bias, silu=True)

    def ssd_k(**kw):
        return ssd.ssd(**kw, out_dtype=torch.float32)

    def ssd_r(**kw):
        return ssd.ssd_ref(**kw, chunk_size=chunk, out_dtype=torch.float32)

    def su_k(state, **kw):
        return (ssd.ssd_state_update(state, **kw),)

    def su_r(state, **kw):
        return (ssd.ssd_state_update_ref(state, **kw),)

    def ssd_m(x, dt, A, B, C, D, dt_bias):  # mamba_ssm's chunked SSD (fp32 out to match the others)
        y, s = MSSM["chunk"](x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True, return_final_states=True)
        return y.float(), s

    def su_m(state, x, dt, A, B, C, D, dt_bias):  # multi-head form, per-head scalars broadcast with stride 0 (as HF)
        P_, N_ = state.shape[2], state.shape[3]
        return (MSSM["ssu"](state, x, dt[:, :, None].expand(-1, -1, P_), A[:, None, None].expand(-1, P_, N_),
                            B, C, D=D[:, None].expand(-1, P_), dt_bias=dt_bias[:, None].expand(-1, P_),
                            dt_softplus=True),)

    alt = bool(MSSM)
    sh = f"B={Bsz} H={H} P={P} G={G} N={N}"
    return [
        Case("causal_conv1d", model, f"B={Bsz} C={conv_dim} K={K} L={L}", dtype, conv_in, conv_k, conv_r),
        Case("ssd", model, f"{sh} L={L} chunk={chunk}", dtype, pre, ssd_k, ssd_r, {"mamba_ssm": ssd_m} if alt else {}),
        Case("ssd_state_update", model, sh, dtype, upd, su_k, su_r, {"mamba_ssm": su_m} if alt else {}),
    ]


def rgemma_cases(dev, dtype, Bsz, W, H, K, L, model):
    r = lambda *s, dt=dtype: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
    bw = W // H
    wts = {"recurrent_param": r(W), "input_gate_weight": r(H, bw, bw) / bw**0.5, "input_gate_bias": r(H, bw),
           "recurrent_gate_weight": r(H, bw, bw) / bw**0.5, "recurrent_gate_bias": r(H, bw)}
    pos = torch.arange(L, device=dev)[None].repeat(Bsz, 1)
    pre = {"x": r(Bsz, L, W), "position_ids": pos, "y_branch": r(Bsz, L, W), **wts}
    dec = {"x": r(Bsz, 1, W), "position_ids": pos[:, :1] + L, "y_branch": r(Bsz, 1, W),
           "state": torch.randn(Bsz, W, device=dev), **wts}
    w, b = r(W, K) / K**0.5, r(W)
    conv_in = {"x": r(Bsz, W, L), "weight": w, "bias": b}
    conv_up = {"x": r(Bsz, W), "state": r(Bsz, W, K - 1), "weight": w, "bias": b}

    def conv_k(x, weight, bias):
        return cc.causal_conv1d(x, weight, bias, silu=False, state_len=K - 1)

    def conv_r(x, weight, bias):
        return cc.causal_conv1d_ref(x, weight, bias, silu=False, state_len=K - 1)

    def up_k(x, state, weight, bias):
        return (cc.causal_conv1d_update(x, state, weight, bias),)

    def up_r(x, state, weight, bias):
        return (cc.causal_conv1d_update_ref(x, state, weight, bias),)

    return [
        Case("causal_conv1d", model, f"B={Bsz} C={W} K={K} L={L} S={K - 1}", dtype, conv_in, conv_k, conv_r),
        Case("causal_conv1d_update", model, f"B={Bsz} C={W} K={K} S={K - 1}", dtype, conv_up, up_k, up_r),
        Case("rglru", model, f"B={Bsz} W={W} H={H} L={L}", dtype, pre, rg.rglru, rg.rglru_ref),
        Case("rglru_step", model, f"B={Bsz} W={W} H={H} L=1", dtype, dec, rg.rglru, rg.rglru_ref),
    ]


def all_cases(dry: bool):
    dev = "cpu" if dry else "cuda"
    cases = []
    if dry:
        for dt in (torch.float32, torch.bfloat16):
            cases += mamba_cases(dev, dt, 1, 40, 16, 4, 37, "tiny-mamba")
            cases += mamba2_cases(dev, dt, 1, 4, 16, 1, 16, 4, 37, 16, "tiny-mamba2")
            cases += rgemma_cases(dev, dt, 1, 32, 2, 4, 37, "tiny-rgemma")
        return cases
    for dt in (torch.float32, torch.bfloat16):  # HF checkpoints: mamba-130m fp32, the others bf16; both are run
        cases += mamba_cases(dev, dt, 1, 1536, 16, 4, 512, "mamba-130m")
        cases += mamba2_cases(dev, dt, 1, 80, 64, 1, 128, 4, 512, 256, "mamba2-2.7b")
        cases += rgemma_cases(dev, dt, 1, 2560, 10, 4, 512, "recurrentgemma-2b")
    return cases


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON lines output path")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    ap.add_argument("--only", default="", help="comma-separated op names to run")
    ap.add_argument("--mamba-ssm", default="", help="dir holding the mamba_ssm package: adds its Triton kernels")
    args = ap.parse_args()
    if args.mamba_ssm:
        print(load_mamba_ssm(args.mamba_ssm))
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("bench_ssm_ops: expected a CUDA device (or --dry-run)")
    gpu = "cpu-interpreter" if args.dry_run else torch.cuda.get_device_name()
    only = {s for s in args.only.split(",") if s}
    rows, crashed = [], []
    print(f"{'op':<24}{'model':<20}{'dtype':<10}{'ok':<4}{'triton ms':>10}{'ref ms':>10}{'speedup':>9}{'GB/s':>8}")
    with open(args.out, "w") as f:
        for case in all_cases(args.dry_run):
            if only and case.op not in only:
                continue
            torch.manual_seed(0)
            try:
                ok, err, note = check(case)
            except Exception as e:  # a kernel that fails to compile or launch is a row, not the end of the run
                msg = str(e).strip().splitlines()
                print(f"{case.op:<24}{case.model:<20}{str(case.dtype):<10}ERR {type(e).__name__}: "
                      f"{msg[-1][:160] if msg else ''}")
                crashed.append(case.op)
                continue
            res, alt_ok = {}, {}
            for prov, fn in case.alts.items():  # another library's kernel: checked against the same _ref
                try:
                    alt_ok[prov] = check(case, fn)
                except Exception as e:  # noqa: BLE001
                    print(f"{case.op:<24}{case.model:<20}{prov}: ERR {type(e).__name__}: {str(e)[:160]}")
            for prov, fn in (("triton", case.kernel), ("ref", case.ref), *((p, case.alts[p]) for p in alt_ok)):
                inputs = _clone(case.inputs)
                with torch.no_grad():
                    outs = fn(**inputs)
                    q = timeit(fn, inputs, args.dry_run)
                gbps = nbytes(case.inputs, outs) / (q[1] * 1e-3) / 1e9
                pok, perr, pnote = alt_ok.get(prov, (ok, err, note))
                row = Row(case.op, case.model, prov, case.shape, str(case.dtype).replace("torch.", ""), *q, gbps,
                          pok, perr, pnote, gpu, torch.__version__, triton.__version__)
                rows.append(row)
                res[prov] = row
                f.write(json.dumps(dataclasses.asdict(row)) + "\n")
            t, r = res["triton"], res["ref"]
            print(f"{case.op:<24}{case.model:<20}{t.dtype:<10}{'y' if ok else 'N':<4}{t.p50_ms:>10.4f}"
                  f"{r.p50_ms:>10.3f}{r.p50_ms / t.p50_ms:>8.1f}x{t.gbps:>8.1f}" + (f"  {note}" if note else ""))
            for p in alt_ok:
                a = res[p]
                print(f"{'  vs ' + p:<24}{'':<20}{'':<10}{'y' if a.correct else 'N':<4}{a.p50_ms:>10.4f}"
                      f"{'':>10}{a.p50_ms / t.p50_ms:>8.2f}x  (ours vs {p}: >1 means ours is faster)"
                      + (f"  {a.note}" if a.note else ""))
    bad = [r for r in rows if not r.correct and r.provider == "triton"]
    print(f"{len(rows)} rows -> {args.out}; {len(bad)} case(s) incorrect; {len(crashed)} failed to run: "
          f"{sorted(set(crashed))}")
    return 1 if bad or crashed else 0


if __name__ == "__main__":
    sys.exit(main())
