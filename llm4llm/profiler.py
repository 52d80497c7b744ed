"""Per-phase module profiler: which module instances cost the most time in prefill and in decode.

Every named module gets a forward pre-hook and a forward hook. The top-level model's forward decides the phase
(`kernels_runtime.phase.PhaseTracker`); every module call inside inherits it. Times are inclusive (a module's time
contains its children's). On CUDA each call records a pair of CUDA events, resolved after one synchronize at the
end, so timing adds no per-call sync; on the CPU `perf_counter` brackets the call.

Input/output shape signatures are recorded during the first warm-up run (not timed), so their cost stays out of the
timed run; with `warmup=0` they are recorded in the timed run itself.

Limits: the hooks' own host time is part of what they measure (a few microseconds per call), which matters most for
launch-bound decode steps; function-level boundaries inside a module (e.g. `selective_scan_fn`) are not separated.
"""
from __future__ import annotations

import contextlib
import gc
import platform
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from kernels_runtime.families import family_of
from kernels_runtime.phase import CURRENT_PHASE, PHASES, PhaseTracker
from llm4llm.errors import ScriptError
from llm4llm.records import ModuleRecord, PhaseInfo, ProfileResult

MAX_SIGNATURES = 8  # distinct input / output signatures kept per module and phase


def profile_model(
    model: nn.Module,
    run_fn: Callable[[], Any],
    *,
    device: str | torch.device,
    phase_weights: Mapping[str, float] | Any | None = None,
    warmup: int = 1,
    repeats: int = 1,
    cpu_clock: Callable[[], float] = time.perf_counter,
) -> ProfileResult:
    """Profile `run_fn()` (which drives `model`, e.g. through `generate`) per module and phase.

    `warmup` runs are not timed; of `repeats` timed runs, each phase reports the run with the median whole-model
    time, so that one preempted run cannot skew it (use 3 on a busy host). `phase_weights` ({"prefill": a,
    "decode": b}, or a `PhaseWeights`) are normalised; without them each phase weighs its share of the forward time.
    `cpu_clock` times CPU runs: wall time by default; `time.thread_time` ignores preemption on a shared host
    (but misses work on torch's other threads).
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"profile_model: expected warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    device = torch.device(device)
    cuda = device.type == "cuda"
    named = list(model.named_modules())
    signatures = _Signatures()
    timers = [_Timer(cuda, cpu_clock) for _ in range(repeats)]
    # CUDA events record on the current device's stream: make it the model's device.
    with torch.cuda.device(device) if cuda else contextlib.nullcontext(), PhaseTracker(model) as tracker:
        for i in range(warmup):
            _run_hooked(named, [signatures] if i == 0 else [], run_fn)
        _synchronize(device)
        before = dict(tracker.forwards)
        # No garbage collection inside timed runs: the timers' own event objects grow the heap, and a collection
        # pause inside one module's call (it can last hundreds of milliseconds and land in any module) would be
        # charged to that module, since its events span the host stall.
        gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            for i, timer in enumerate(timers):
                hooked = [timer] if (warmup > 0 or i > 0) else [timer, signatures]
                _run_hooked(named, hooked, run_fn)
        finally:
            if gc_was_enabled:
                gc.enable()
        forwards = {p: (tracker.forwards[p] - before.get(p, 0)) // repeats for p in PHASES}
    _synchronize(device)
    if not any(forwards.values()):
        raise ScriptError("expected run_fn to call the model's forward at least once, got no forward calls")
    times, calls = _median_run([timer.resolve() for timer in timers])
    return _result(model, named, times, calls, forwards, signatures, phase_weights, device,
                   "cuda_events" if cuda else cpu_clock.__name__)


def _median_run(runs: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Per phase, every module's time and calls from the timed run whose whole-model time is the median.

    One run per phase (not a median per module) keeps the records of a phase consistent: children never add up to
    more than their parent."""
    times: dict = {}
    calls: dict = {}
    for phase in PHASES:
        ranked = sorted(runs, key=lambda run: run[0].get(("", phase), 0.0))
        run_times, run_calls = ranked[(len(ranked) - 1) // 2]
        times.update({key: ms for key, ms in run_times.items() if key[1] == phase})
        calls.update({key: n for key, n in run_calls.items() if key[1] == phase})
    return times, calls


def _run_hooked(named: list[tuple[str, nn.Module]], observers: list, run_fn: Callable[[], Any]) -> None:
    """Run `run_fn` once with every observer's hooks on every module, removing them afterwards, also on error."""
    handles = []
    try:
        for obs in observers:
            for path, module in named:
                pre, post = obs.hooks(path)
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))
        run_fn()
    finally:
        for handle in handles:
            handle.remove()


class _Timer:
    """Inclusive time and calls per (module path, phase)."""

    def __init__(self, cuda: bool, clock: Callable[[], float]):
        self.cuda = cuda
        self.clock = clock
        self.cpu_ms: dict[tuple[str, str], float] = defaultdict(float)
        self.events: dict[tuple[str, str], list] = defaultdict(list)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def hooks(self, path: str):
        stack: list = []  # one entry per active call of this module (re-entrant calls nest)

        def pre(module, args, kwargs):
            phase = CURRENT_PHASE.get()
            if phase is None:  # called outside the model's forward: no phase to charge
                stack.append(None)
            elif self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                stack.append((phase, start))
            else:
                stack.append((phase, self.clock()))

        def post(module, args, kwargs, output):
            entry = stack.pop() if stack else None
            if entry is None:
                return
            phase, start = entry
            key = (path, phase)
            self.calls[key] += 1
            if self.cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.events[key].append((start, end))
            else:
                self.cpu_ms[key] += (self.clock() - start) * 1e3

        return pre, post

    def resolve(self) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], int]]:
        """Milliseconds per key; on CUDA, call after a synchronize."""
        if not self.cuda:
            return dict(self.cpu_ms), dict(self.calls)
        times = {key: sum(s.elapsed_time(e) for s, e in pairs) for key, pairs in self.events.items()}
        return times, dict(self.calls)


class _Signatures:
    """Distinct input/output shape+dtype signatures per (module path, phase), at most MAX_SIGNATURES each."""

    def __init__(self):
        self.inputs: dict[tuple[str, str], list[str]] = defaultdict(list)
        self.outputs: dict[tuple[str, str], list[str]] = defaultdict(list)

    def hooks(self, path: str):
        phases: list = []  # the phase of each active call: the top-level post-hook runs after the tracker resets it

        def pre(module, args, kwargs):
            phase = CURRENT_PHASE.get()
            phases.append(phase)
            if phase is not None:
                _add(self.inputs[(path, phase)], signature((args, kwargs)))

        def post(module, args, kwargs, output):
            phase = phases.pop() if phases else None
            if phase is not None:
                _add(self.outputs[(path, phase)], signature(output))

        return pre, post


def _add(seen: list[str], sig: str) -> None:
    if sig not in seen and len(seen) < MAX_SIGNATURES:
        seen.append(sig)


def signature(obj: Any) -> str:
    """"[1, 16, 64]:float32|[1, 16]:int64" over the tensors in `obj` (nested tuples, lists, dicts), in order."""
    return "|".join(f"{list(t.shape)}:{str(t.dtype).removeprefix('torch.')}" for t in _tensors(obj, 3))


def _tensors(obj: Any, depth: int):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item, depth - 1)
    elif depth > 0 and isinstance(obj, Mapping):
        for item in obj.values():
            yield from _tensors(item, depth - 1)


def _result(model, named, times, calls, forwards, signatures, phase_weights, device, timer) -> ProfileResult:
    phase_ms = {p: times.get(("", p), 0.0) for p in PHASES if forwards[p] > 0}
    weights = _phase_weights(phase_ms, phase_weights)
    phases = {p: PhaseInfo(phase=p, forwards=forwards[p], time_ms=ms, weight=weights[p]) for p, ms in phase_ms.items()}
    records = []
    for path, module in named:
        family = family_of(module, name=path, root=model)
        for phase, info in phases.items():
            key = (path, phase)
            if calls.get(key, 0) == 0:
                continue
            ms = times.get(key, 0.0)
            share = ms / info.time_ms if info.time_ms > 0 else 0.0
            records.append(ModuleRecord(
                module_path=path, class_name=type(module).__name__, family=family, phase=phase,
                calls=calls[key], time_ms=ms, share=share, hotspot_score=share * info.weight,
                depth=path.count(".") + 1 if path else 0,
                in_shapes=list(signatures.inputs.get(key, [])), out_shapes=list(signatures.outputs.get(key, [])),
            ))
    return ProfileResult(phases=phases, records=records, hardware=hardware_info(device), timer=timer)


def _phase_weights(phase_ms: dict[str, float], user: Any) -> dict[str, float]:
    if user is not None:
        given = user.model_dump() if hasattr(user, "model_dump") else dict(user)
        total = sum(float(given.get(p, 0.0)) for p in PHASES)
        if total <= 0:
            raise ValueError(f"phase_weights: expected prefill + decode > 0, got {given}")
        return {p: float(given.get(p, 0.0)) / total for p in phase_ms}
    total = sum(phase_ms.values())
    return {p: (ms / total if total > 0 else 1.0 / len(phase_ms)) for p, ms in phase_ms.items()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hardware_info(device: str | torch.device) -> dict:
    """Where a profile was taken: device kind, GPU name, capability ("9.0") and SM count (CUDA only), library
    versions."""
    device = torch.device(device)
    info: dict[str, Any] = {
        "device": device.type,
        "gpu_name": None,
        "capability": None,
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        info.update(gpu_name=torch.cuda.get_device_name(index), capability=f"{major}.{minor}",
                    sm_count=torch.cuda.get_device_properties(index).multi_processor_count)
    return info


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def format_hotspots(result: ProfileResult, top: int = 20, *, include_model: bool = False):
    """A rich Table of the `top` hotspots by score (the whole-model rows are left out unless `include_model`)."""
    from rich.table import Table

    hw = result.hardware
    where = hw.get("gpu_name") or hw.get("cpu") or hw.get("device")
    phases = ", ".join(f"{p.phase} {p.time_ms:.2f} ms × {p.forwards} (w {p.weight:.2f})"
                       for p in result.phases.values())
    table = Table(title=f"Hotspots on {where} ({result.timer}) — {phases}")
    for column, justify in (("rank", "right"), ("module", "left"), ("class", "left"), ("family", "left"),
                            ("phase", "left"), ("calls", "right"), ("ms", "right"), ("share", "right"),
                            ("score", "right")):
        table.add_column(column, justify=justify)
    rows = [r for r in result.ranked() if include_model or r.family != "model"]
    for rank, r in enumerate(rows[:top], start=1):
        table.add_row(str(rank), r.module_path or "(model)", r.class_name, r.family, r.phase, str(r.calls),
                      f"{r.time_ms:.3f}", f"{r.share:.3f}", f"{r.hotspot_score:.3f}")
    return table
