"""The one tolerance table, used by the tests, the verifier and deployment-time acceptance alike."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=1e-2, rtol=1e-2),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1e-2),
}


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    if dtype not in TOLERANCES:
        raise ValueError(f"tolerance: expected one of {sorted(map(str, TOLERANCES))}, got {dtype}")
    return TOLERANCES[dtype]


@dataclass(frozen=True)
class CloseReport:
    ok: bool
    max_abs: float
    max_rel: float
    reason: str = ""
    criterion: str = "table"  # "table": TOLERANCES[dtype] against the reference; "floor": see compare_floor


# Comparisons run where the tensors live, in float64, a chunk of elements at a time: a decode graph's capture check
# compares the whole KV cache (2.7 GB of bf16 at batch 32 on qwen3-4b), which as one float64 copy on the host took
# 20-50 s and 8 GB of GPU memory per capture (measured: docs/hardware.md points to the run).
_CHUNK = 1 << 24


def _pairs(*ts: torch.Tensor):
    """The tensors broadcast together and flattened, on the first one's device, as float64 chunks of _CHUNK
    elements (a tuple per chunk)."""
    dev = ts[0].device
    ts = tuple(t.detach().to(dev) for t in ts)
    if len({t.shape for t in ts}) > 1:
        ts = torch.broadcast_tensors(*ts)
    flat = [t.reshape(-1) for t in ts]
    for i in range(0, flat[0].numel(), _CHUNK):
        yield tuple(f[i:i + _CHUNK].double() for f in flat)


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None) -> CloseReport:
    """Compare `out` with `ref` under TOLERANCES[dtype or ref.dtype]. NaN or Inf in `out` never passes,
    nor does a shape or dtype mismatch."""
    if out.shape != ref.shape:
        return CloseReport(False, float("inf"), float("inf"), f"shape: expected {tuple(ref.shape)}, got {tuple(out.shape)}")
    if out.dtype != ref.dtype:
        return CloseReport(False, float("inf"), float("inf"), f"dtype: expected {ref.dtype}, got {out.dtype}")
    if out.numel() == 0:
        return CloseReport(True, 0.0, 0.0)
    if not ref.is_floating_point():  # integer state (a cache length, a position): exact, there is no rounding
        same = torch.equal(out.detach(), ref.detach().to(out.device))
        return CloseReport(same, 0.0 if same else float("inf"), 0.0 if same else float("inf"),
                           "" if same else f"{ref.dtype} values differ (integers compare exactly)")
    tol = tolerance_for(dtype or ref.dtype)
    finite, within, max_abs, max_rel = [], [], [], []  # per chunk, on the device: one host read at the end
    for o, r in _pairs(out, ref):
        diff = (o - r).abs()
        finite.append(torch.isfinite(o).all())
        within.append((diff <= tol.atol + tol.rtol * r.abs()).all())
        max_abs.append(diff.max())
        max_rel.append((diff / r.abs().clamp_min(1e-12)).max())
    if not bool(torch.stack(finite).all()):
        return CloseReport(False, float("inf"), float("inf"), "non-finite values (NaN/Inf) in output")
    ok, max_abs, max_rel = bool(torch.stack(within).all()), float(torch.stack(max_abs).max()), float(
        torch.stack(max_rel).max())
    return CloseReport(ok, max_abs, max_rel, "" if ok else f"max abs err {max_abs:.3g} over atol={tol.atol} rtol={tol.rtol}")


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None, name: str = "output") -> None:
    rep = compare(out, ref, dtype)
    if not rep.ok:
        raise AssertionError(f"{name}: {rep.reason}")


# ------------------------------------------------------------------------------------------ the rounding floor
# 16-bit tasks whose computation amplifies rounding (Mamba's mixer: one ulp of one intermediate moves an output by
# 2-3) fail the elementwise table even for correctly rounded kernels: the reference in the task dtype (ref16) is one
# rounding of the exact result, the candidate another. The floor measures how far ref16 sits from an fp32 copy of the
# same computation (ref32) and accepts a candidate no farther from ref32 than FLOOR_FACTOR floors.
# Two equally valid roundings are independent errors of about one floor each around the exact result, so they sit
# ~sqrt(2) floors from ref32 at worst on the same footing as ref16's one floor; 2 leaves margin for that and for a
# candidate that rounds differently (e.g. accumulates in fp32 and rounds once), and nothing more.
FLOOR_FACTOR = 2.0
# The floor is a rounding allowance, not a licence: where ref16 itself is farther than this (rel-L2) from ref32 the
# 16-bit reference is mostly noise and the floor is not applied (else zeros or a sign flip could fit within 2 floors).
FLOOR_MAX_REL_L2 = 0.05


def rel_l2(a: torch.Tensor, b: torch.Tensor, base: torch.Tensor | None = None) -> float:
    """||a - b||_2 / ||b||_2 in float64 (inf when b is all zeros and a is not), on a's device, chunked; with `base`,
    of the changes from it: ||a - b||_2 / ||b - base||_2 (a state update judged against what the step wrote)."""
    sq = torch.zeros(2, dtype=torch.float64, device=a.device)
    for x, y, *z in _pairs(a, b, *([] if base is None else [base])):
        sq += torch.stack([(x - y).square().sum(), (y - z[0] if z else y).square().sum()])
    num, den = (float(v) for v in sq.sqrt())
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype`'s values at |x| (elementwise, in x's dtype): eps(dtype) * 2^(exponent(|x|) - 1)."""
    _, e = torch.frexp(x.abs())
    spacing = torch.finfo(dtype).eps * torch.pow(2.0, (e - 1).to(x.dtype))
    return torch.where(x == 0, torch.finfo(dtype).tiny, spacing).clamp_min(torch.finfo(dtype).tiny)


def compare_floor(out: torch.Tensor, ref16: torch.Tensor, ref32: torch.Tensor,
                  dtype: torch.dtype | None = None) -> CloseReport:
    """The calibrated second criterion for 16-bit tasks. Passes when
        ||out - ref32||_2 <= FLOOR_FACTOR * ||ref16 - ref32||_2   and
        |out - ref32| <= max(FLOOR_FACTOR * max|ref16 - ref32| + atol, ulp(ref32))   elementwise (atol of
        TOLERANCES[dtype or ref16.dtype], the ulp of ref16's dtype),
    with the floor rel-L2 ||ref16 - ref32|| / ||ref32|| at most FLOOR_MAX_REL_L2. NaN/Inf in `out` (or in either
    reference), a shape or dtype mismatch with ref16, or a ref32 of another shape never pass. max_abs/max_rel are
    against ref16, as in compare()."""
    base = compare(out, ref16, dtype)
    if base.ok or out.shape != ref16.shape or out.dtype != ref16.dtype:
        return base
    def fail(why: str) -> CloseReport:
        return CloseReport(False, base.max_abs, base.max_rel, f"{base.reason}; floor: {why}", "floor")

    if ref32.shape != ref16.shape:
        return fail(f"fp32 reference shape {tuple(ref32.shape)} differs from {tuple(ref16.shape)}")
    o, r16, r32 = (t.detach().to(out.device).double() for t in (out, ref16, ref32))  # where they live, no host copy
    if not torch.isfinite(o).all():
        return fail("non-finite values (NaN/Inf) in output")
    if not (torch.isfinite(r16).all() and torch.isfinite(r32).all()):
        return fail("non-finite reference; not applied")
    den = float(r32.norm())
    if den == 0:
        return fail("fp32 reference is all zeros; not applied")
    floor_l2, got_l2 = float((r16 - r32).norm()) / den, float((o - r32).norm()) / den
    floor_max, got_max = float((r16 - r32).abs().max()), float((o - r32).abs().max())
    atol = tolerance_for(dtype or ref16.dtype).atol
    if floor_l2 > FLOOR_MAX_REL_L2:
        return fail(f"rel-L2 of the {ref16.dtype} reference vs fp32 {floor_l2:.3g} > {FLOOR_MAX_REL_L2}; not applied")
    if got_l2 > FLOOR_FACTOR * floor_l2:
        return fail(f"rel-L2 vs fp32 {got_l2:.3g} > {FLOOR_FACTOR:g} x {floor_l2:.3g}")
    # Elementwise: within FLOOR_FACTOR max floors, or within one output ulp at that element's magnitude. The second
    # admits a candidate that rounds once where ref16 happened to round well (ref16's max error can sit far below
    # half an ulp of the largest outputs, and a once-rounded value is up to half an ulp away, plus fp32 reordering).
    bound = torch.maximum(torch.full_like(r32, FLOOR_FACTOR * floor_max + atol), ulp(r32, ref16.dtype))
    if not bool(((o - r32).abs() <= bound).all()):
        worst = int(((o - r32).abs() - bound).argmax())
        return fail(f"max abs vs fp32 {got_max:.3g} > {FLOOR_FACTOR:g} x {floor_max:.3g} + {atol:g} and beyond one "
                    f"{ref16.dtype} ulp (element {worst}: |err| {float((o - r32).abs().flatten()[worst]):.3g}, "
                    f"ulp {float(ulp(r32, ref16.dtype).flatten()[worst]):.3g})")
    return CloseReport(True, base.max_abs, base.max_rel,
                       f"floor: rel-L2 vs fp32 {got_l2:.3g} <= {FLOOR_FACTOR:g} x {floor_l2:.3g}, "
                       f"max abs vs fp32 {got_max:.3g} <= {FLOOR_FACTOR:g} x {floor_max:.3g} + {atol:g}", "floor")


# ------------------------------------------------------------------------------------------ lossy candidates
# A lossy kernel (TileMix's INT8 score tiles) of a workload that opted in (allow_lossy + accuracy budget) differs
# from the reference by design, so the table cannot judge it. The verifier still rejects a broken one: its output
# must stay within LOSSY_MAX_REL_L2 (rel-L2) of the fp32 reference (the 16-bit one where none exists), finite. The
# workload's own budget (logits deviation, token agreement) is what acceptance enforces in the model; this bound
# only separates quantisation error (uniform INT8 attention: of order 1e-2) from a wrong kernel (of order 1).
LOSSY_MAX_REL_L2 = 0.1


def compare_lossy(out: torch.Tensor, ref: torch.Tensor, ref32: torch.Tensor | None = None) -> CloseReport:
    """The criterion for an opted-in lossy candidate: finite, same shape and dtype as `ref`, and rel-L2 against
    `ref32` (else `ref`) at most LOSSY_MAX_REL_L2."""
    base = compare(out, ref)
    if base.ok or out.shape != ref.shape or out.dtype != ref.dtype:
        return base
    anchor = ref32 if ref32 is not None and ref32.shape == ref.shape else ref
    o = out.detach().double()
    if not torch.isfinite(o).all():
        return CloseReport(False, base.max_abs, base.max_rel, "lossy: non-finite values (NaN/Inf) in output", "lossy")
    got = rel_l2(o, anchor)
    ok = got <= LOSSY_MAX_REL_L2
    what = "fp32" if anchor is ref32 else str(ref.dtype)
    return CloseReport(ok, base.max_abs, base.max_rel,
                       f"lossy: rel-L2 vs {what} {got:.3g} {'<=' if ok else '>'} {LOSSY_MAX_REL_L2:g}", "lossy")
