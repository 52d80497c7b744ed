"""The bundle in service: re-validate a bundle against tonight's libraries, GPU and workload, and decide whether the
workload keeps it, replaces it with tonight's, or rolls back (to the last version that still passes, or to none).

Pure logic: no Prefect, no SQL. The nightly flow (flows/nightly.py) runs `revalidate` in an isolated process, one
bundle at a time, and records what `decide` returns (storage.repo: bundle_validations, service_decisions,
bundle_current).
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Literal

Verdict = Literal["keep", "replace", "rollback"]


@dataclass
class Validation:
    """One bundle checked tonight, in the model, through the workload's own script."""

    bundle_path: str
    ok: bool
    correctness: str  # "ok: <metric detail>" | "failed: ..." | "runtime: ..." | "unreadable: ..."
    latency: str  # "ok" | "regressed" | "skipped: cpu" | "not measured"
    unpatched_ms: float | None = None
    patched_ms: float | None = None
    gain: float | None = None  # 1 - patched / unpatched, both measured tonight in one process
    reason: str = ""
    versions: dict = field(default_factory=dict)  # {"tonight": {...}, "bundle": {...}}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> Validation | None:
        return None if d is None else cls(**d)


@dataclass
class ServiceDecision:
    decision: Verdict
    target: str | None  # "candidate" | "current" | "fallback" | None (no bundle in service afterwards)
    reason: str


def tonight_versions(device: str) -> dict:
    """What a kernel's behaviour depends on tonight: torch, triton, transformers, CUDA, the driver, the GPU."""
    import torch

    from kernels_runtime.bundle import library_versions

    out = dict(library_versions())
    out["cuda"] = torch.version.cuda
    if device.startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        try:
            import subprocess

            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except Exception:  # noqa: BLE001 - the driver version is informative, never a gate
            out["driver"] = None
    else:
        out["gpu"] = "cpu"
    return out


def revalidate(workload_path: str, bundle_path: str, cfg=None) -> Validation:
    """Check a bundle as acceptance checked it, tonight: teacher-forced logits of the patched model against the
    unpatched one (cfg: llm4llm.config.AcceptSettings, its metric and noise floor), at least one of its kernels running
    in-model (a guard that now rejects every call, after a shape or GPU change, is a failure: the bundle does
    nothing), then on a GPU the end-to-end latency, unpatched and patched alternately in this one process (a bundle
    that makes the model slower than without it has regressed). On the CPU the latency gate is skipped and says so."""
    import kernels_runtime
    from kernels_runtime.bundle import BundleError, load_bundle
    from llm4llm.accept import compare_logits, reference_run, teacher_forced_logits
    from llm4llm.config import AcceptSettings
    from llm4llm.evaluate import measure
    from llm4llm.workload import load_workload

    cfg = cfg or AcceptSettings()
    wl = load_workload(workload_path)
    versions = {"tonight": tonight_versions(wl.device)}
    try:
        bundle = load_bundle(bundle_path, strict=True)
    except (BundleError, OSError) as e:
        return Validation(bundle_path, False, f"unreadable: {type(e).__name__}: {str(e)[:300]}", "not measured",
                          reason=f"the bundle cannot be loaded: {str(e)[:300]}", versions=versions)
    versions["bundle"] = {**bundle.library_versions, "gpu": bundle.gpu}
    built = versions["bundle"]
    changed = [k for k in ("torch", "triton", "transformers", "gpu") if built.get(k)
               and built[k] != versions["tonight"].get(k)]
    since = f" (changed since the bundle was built: {', '.join(changed)})" if changed else ""
    script, model, batch, metric, tokens, ref_logits, floor = reference_run(wl, cfg)

    def failed(correctness: str, why: str) -> Validation:
        kernels_runtime.revert(model)
        return Validation(bundle_path, False, correctness, "not measured", reason=why + since, versions=versions)

    try:
        report = kernels_runtime.apply(model, bundle, strict=True)
        new_logits = teacher_forced_logits(model, batch, tokens, wl.decode_len)
    except Exception as e:  # noqa: BLE001 - a kernel that no longer compiles or runs here is tonight's verdict
        return failed(f"runtime: {type(e).__name__}: {str(e)[:300]}", "the patched model fails to run")
    check = compare_logits(ref_logits, new_logits, wl.torch_dtype, cfg, floor)
    if not check.ok:
        return failed(f"failed: {check.detail}", "in-model correctness fails")
    ran = {p.patch_id: report.calls_of(p.patch_id) for p in bundle.patches}
    if bundle.patches and not any(ran.values()):
        return failed(f"failed: no kernel of the bundle ran in-model ({report.counters()})",
                      "every call fell back (the guards reject tonight's shapes, dtypes or GPU)")
    correctness = f"ok: {check.detail}; kernel calls {ran}"
    kernels_runtime.revert(model)
    if not wl.device.startswith("cuda"):
        return Validation(bundle_path, True, correctness, "skipped: cpu",
                          reason="correct in-model; latency gate skipped on the CPU (no CPU timing may judge a "
                                 "kernel)" + since, versions=versions)
    unpatched, patched = [], []
    for _ in range(max(1, cfg.noisy_rounds) + 1):  # A B A B ...: drift hits both sides alike
        unpatched.append(measure(model, wl, batch, script.run, repeats=cfg.repeats, split=False).total_ms)
        kernels_runtime.apply(model, bundle, strict=True)
        try:
            patched.append(measure(model, wl, batch, script.run, repeats=cfg.repeats, split=False).total_ms)
        finally:
            kernels_runtime.revert(model)
    u, p = statistics.median(unpatched), statistics.median(patched)
    gain = 1 - p / u
    ok = gain >= 0
    return Validation(bundle_path, ok, correctness, "ok" if ok else "regressed", u, p, gain,
                      reason=(f"correct in-model; end to end {u:.1f} -> {p:.1f} ms ({gain:+.1%}, medians of "
                              f"{len(unpatched)} alternating measurements)" if ok else
                              f"slower than the unpatched model tonight: {u:.1f} -> {p:.1f} ms ({gain:+.1%})")
                             + since, versions=versions)


def _rel(v: Validation) -> float | None:
    """Latency relative to the unpatched model measured beside it (comparable across processes and nights)."""
    return v.patched_ms / v.unpatched_ms if v.patched_ms and v.unpatched_ms else None


def decide(current: Validation | None, candidate: Validation | None, fallback: Validation | None,
           delta: float | None = None, *, fallback_version: int | None = None) -> ServiceDecision:
    """Keep, replace or roll back. `current`: the bundle in service re-validated tonight (None: none in service);
    `candidate`: tonight's accepted bundle re-validated (None: none accepted); `fallback`: the newest earlier version
    that passes tonight (None: none does). Tonight's bundle replaces a passing one only when it is faster by delta
    (None: AcceptSettings' default) relative to the unpatched model (both measured on a GPU); a failing bundle is
    replaced by tonight's, else rolled back to the fallback, else to none."""
    from llm4llm.config import AcceptSettings

    delta = AcceptSettings().delta if delta is None else delta
    cand_ok = candidate is not None and candidate.ok
    if current is None:
        if cand_ok:
            return ServiceDecision("replace", "candidate", f"no bundle in service; tonight's bundle passes: "
                                                           f"{candidate.reason}")
        why = "none accepted tonight" if candidate is None else f"tonight's fails: {candidate.reason}"
        return ServiceDecision("keep", None, f"no bundle in service and {why}")
    if current.ok:
        if not cand_ok:
            why = "no new bundle accepted tonight" if candidate is None else f"tonight's fails: {candidate.reason}"
            return ServiceDecision("keep", "current", f"the bundle in service passes ({current.reason}); {why}")
        rc, rn = _rel(current), _rel(candidate)
        if rc is None or rn is None:
            return ServiceDecision("keep", "current", f"the bundle in service passes ({current.reason}); tonight's "
                                                      f"passes too but cannot be shown faster without GPU timing")
        if rn <= rc * (1 - delta):
            return ServiceDecision("replace", "candidate", f"tonight's bundle runs at {rn:.3f} of the unpatched "
                                                           f"model, the one in service at {rc:.3f} (faster by at "
                                                           f"least delta {delta:.0%})")
        return ServiceDecision("keep", "current", f"the bundle in service passes at {rc:.3f} of the unpatched model; "
                                                  f"tonight's ({rn:.3f}) is not faster by delta {delta:.0%}")
    broke = f"the bundle in service fails tonight: {current.reason} ({current.correctness}; latency {current.latency})"
    if cand_ok:
        return ServiceDecision("replace", "candidate", f"{broke}; tonight's bundle passes: {candidate.reason}")
    if fallback is not None and fallback.ok:
        v = f"version {fallback_version}" if fallback_version is not None else "an earlier version"
        return ServiceDecision("rollback", "fallback", f"{broke}; rolled back to {v}, which passes: "
                                                       f"{fallback.reason}")
    return ServiceDecision("rollback", None, f"{broke}; no earlier version passes: no bundle in service")
