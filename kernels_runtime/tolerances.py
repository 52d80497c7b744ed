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


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None) -> CloseReport:
    """Compare `out` with `ref` under TOLERANCES[dtype or ref.dtype]. NaN or Inf in `out` never passes,
    nor does a shape or dtype mismatch."""
    if out.shape != ref.shape:
        return CloseReport(False, float("inf"), float("inf"), f"shape: expected {tuple(ref.shape)}, got {tuple(out.shape)}")
    if out.dtype != ref.dtype:
        return CloseReport(False, float("inf"), float("inf"), f"dtype: expected {ref.dtype}, got {out.dtype}")
    if out.numel() == 0:
        return CloseReport(True, 0.0, 0.0)
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(o).all():
        return CloseReport(False, float("inf"), float("inf"), "non-finite values (NaN/Inf) in output")
    diff = (o - r).abs()
    max_abs = float(diff.max())
    max_rel = float((diff / r.abs().clamp_min(1e-12)).max())
    tol = tolerance_for(dtype or ref.dtype)
    ok = bool((diff <= tol.atol + tol.rtol * r.abs()).all())
    return CloseReport(ok, max_abs, max_rel, "" if ok else f"max abs err {max_abs:.3g} over atol={tol.atol} rtol={tol.rtol}")


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None, name: str = "output") -> None:
    rep = compare(out, ref, dtype)
    if not rep.ok:
        raise AssertionError(f"{name}: {rep.reason}")
