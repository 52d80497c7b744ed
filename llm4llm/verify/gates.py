"""The runtime gates, run inside the worker process (worker.py) on one device.

Order: static → compile (exec + first call) → for every captured case and `draws` fresh random draws of its shape
signature: launches_triton, current_stream, output_shape_dtype, canaries, inputs_unmodified, poisoned_outputs,
no_cached_output, correctness → timing (CUDA only). The first failing check ends the run with its failure class.

How each cheat is caught:
- unwritten outputs: before each call the allocator is primed with NaN-filled blocks of each output's size, so
  `torch.empty` tends to return poisoned memory (reliably under CUDA's caching allocator, often on the CPU). A wrong
  or non-finite result is re-run with a different finite poison; elements that change with the poison were never
  written. Where the CPU allocator hands out fresh memory the same cheat is caught as wrong_output instead.
- out-of-bounds writes: every input, weight and state tensor is a view into a larger buffer whose margins hold
  canaries, checked bit for bit after the call. Reads out of bounds are not detected (memcheck is, on the GPU).
- side streams: on CUDA the candidate runs under a non-default stream and each Triton launch records the stream
  current at launch time; a launch on any other stream fails the gate.
- cached results: every draw has different inputs; a wrong output bit-identical to an earlier one is cached_output.
"""
from __future__ import annotations

import copy
import math
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kernels_runtime.tolerances import FLOOR_FACTOR, compare, compare_floor, compare_lossy, rel_l2
from llm4llm.taskspec import Task, load_task
from llm4llm.verify.candidate import LAUNCHES, install_launch_hook, load_candidate, unload_candidate
from llm4llm.verify.static_check import check_source, forbidden_names_for
from llm4llm.verify.verdict import NO_GPU, GateResult, Verdict, source_hash

CHECK_GATES = ("launches_triton", "current_stream", "output_shape_dtype", "canaries", "inputs_unmodified",
               "poisoned_outputs", "no_cached_output", "correctness")
KEEP_AS_CAPTURED = ("mask", "position_ids", "cache_position")  # name fragments of inputs that are not random data
CANARY_MIN = 256  # canary margin in elements on each side; a multiple of 64 keeps views 16-byte aligned
CUDA_FAULTS = ("illegal memory access", "illegal instruction", "misaligned address", "device-side assert",
               "unspecified launch failure", "an illegal", "cuda error", "cudaerror", "hardware exception")


class GateFailure(Exception):
    def __init__(self, gate: str, failure_class: str, message: str, poisoned: bool = False):
        super().__init__(message)
        self.gate, self.failure_class, self.message, self.poisoned = gate, failure_class, message, poisoned


@dataclass
class Draw:
    """One call to judge: the data, and the reference's result for it."""

    key: tuple[int, int]  # (case index, draw index); draw 0 is the captured call
    inputs: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    ref: dict[str, torch.Tensor] = field(default_factory=dict)
    # 16-bit tasks only: the same reference with module, weights, inputs and state upcast to fp32 (the floor's anchor);
    # None where the task is not 16-bit or the upcast reference could not be computed
    ref32: dict[str, torch.Tensor] | None = None


@dataclass
class Guarded:
    """A draw's tensors as views inside canary buffers, with pristine copies to check them against."""

    inputs: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    buffers: list[tuple[str, torch.Tensor, int, int, torch.Tensor]]  # name, buffer, pad, numel, margins copy
    originals: dict[str, torch.Tensor]  # inputs and weights, which must come back unmodified


# ---------------------------------------------------------------------------------------------------- the reference

def reference_fn(task: Task, device: torch.device, upcast: bool = False) -> Callable[..., dict[str, torch.Tensor]]:
    """Task.reference() where the spec has a recipe; a stateless module without one is called with its inputs
    positionally, in `input_names` order, its outputs named in `output_names` order.

    upcast=True: the same path with the module's floating parameters and buffers, and every floating weight, input
    and state tensor, in fp32 (integer and bool tensors unchanged): the fp32 anchor of the rounding floor."""
    spec = task.spec
    if spec.recipe and not upcast:
        return task.reference(device)
    module = task.load_module(device).eval()
    if upcast:
        module = module.float()
    up = _upcast if upcast else (lambda d: d)
    if spec.recipe:
        from kernels_runtime.boundary import call_reference

        return lambda inputs, weights, state, static: call_reference(module, up(weights), up(inputs), up(state),
                                                                     static, spec.recipe)

    def ref(inputs, weights, state, static):
        inputs = up(inputs)
        out = torch.func.functional_call(module, up(weights), tuple(inputs[n] for n in spec.input_names))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return dict(zip(spec.output_names, outs))

    return ref


def _upcast(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.float() if t.is_floating_point() else t for n, t in d.items()}


def is_16bit(task: Task) -> bool:
    return getattr(torch, task.spec.dtype, None) in (torch.float16, torch.bfloat16)


def _fresh(name: str, t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A fresh draw like `t`: floats from randn scaled by t's std; integers, bools, masks and positions as captured."""
    if not t.is_floating_point() or any(k in name for k in KEEP_AS_CAPTURED) or not torch.isfinite(t).all():
        return t.clone()
    std = float(t.float().std()) if t.numel() > 1 else 1.0
    std = std if math.isfinite(std) and std > 0 else 1.0
    return (torch.randn(t.shape, generator=gen, device="cpu") * std).to(device=t.device, dtype=t.dtype)


def make_draws(task: Task, device: torch.device, draws: int, seed: int) -> list[Draw]:
    out = []
    for k, case in enumerate(task.cases):
        to_dev = lambda d: {n: t.to(device) for n, t in d.items()}  # noqa: E731
        inputs, weights, state = to_dev(case.inputs), to_dev(case.weights), to_dev(case.state)
        out.append(Draw((k, 0), inputs, weights, state))
        for d in range(1, draws + 1):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + k * 1009 + d)
            out.append(Draw((k, d), {n: _fresh(n, t, gen) for n, t in inputs.items()}, weights,
                            {n: _fresh(n, t, gen) for n, t in state.items()}))
    return out


def expected_names(task: Task) -> list[str]:
    return [*task.spec.output_names, *(f"state_out.{n}" for n in task.spec.state_names)]


@torch.no_grad()
def fill_reference(task: Task, draws: list[Draw], ref: Callable, ref32: Callable | None = None) -> None:
    """Each draw's reference outputs (d.ref); with `ref32` (16-bit tasks), also the fp32 anchor (d.ref32). A ref32
    that raises, lacks an output or returns another shape leaves d.ref32 None: the floor is then not applied."""
    def call(fn, d):
        return fn({n: t.clone() for n, t in d.inputs.items()}, {n: t.clone() for n, t in d.weights.items()},
                  {n: t.clone() for n, t in d.state.items()}, copy.deepcopy(task.spec.static))

    for d in draws:
        got = call(ref, d)
        missing = [n for n in expected_names(task) if n not in got]
        if missing:
            raise RuntimeError(f"reference: expected outputs {expected_names(task)}, missing {missing}")
        d.ref = {n: got[n].detach() for n in expected_names(task)}
        if ref32 is None:
            continue
        try:
            wide = call(ref32, d)
            wide = {n: wide[n].detach() for n in expected_names(task)}
        except Exception:  # noqa: BLE001 - an fp32 copy the module refuses only costs the floor, never the run
            continue
        if all(wide[n].shape == d.ref[n].shape for n in d.ref):
            d.ref32 = wide


# ------------------------------------------------------------------------------------------------ guarded buffers

def _canary_fill(buf: torch.Tensor) -> None:
    if buf.dtype == torch.bool:
        buf.fill_(True)
    elif buf.is_floating_point():
        buf.fill_(-1234.5)
    else:
        buf.fill_(-91 if buf.dtype != torch.uint8 else 173)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def guard(draw: Draw) -> Guarded:
    buffers, views, originals = [], {"inputs": {}, "weights": {}, "state": {}}, {}
    for kind in views:
        for name, t in getattr(draw, kind).items():
            n = t.numel()
            pad = max(CANARY_MIN, -(-min(n, 1 << 16) // 64) * 64)
            buf = torch.empty(n + 2 * pad, dtype=t.dtype, device=t.device)
            _canary_fill(buf)
            view = buf[pad:pad + n].view(t.shape)
            view.copy_(t)
            margins = torch.cat([buf[:pad], buf[pad + n:]]).clone()
            buffers.append((f"{kind}.{name}", buf, pad, n, margins))
            views[kind][name] = view
            if kind != "state":
                originals[f"{kind}.{name}"] = t.clone()
    return Guarded(views["inputs"], views["weights"], views["state"], buffers, originals)


def _poison_allocator(ref: dict[str, torch.Tensor], value: float, device: torch.device) -> None:
    """Leave freed blocks of each output's size (and, on CUDA, a large one) filled with `value`, so that the
    candidate's `torch.empty` is likely to return memory holding it."""
    blocks = []
    for t in ref.values():
        fill = value if t.is_floating_point() else (True if t.dtype == torch.bool else -7)
        blocks += [torch.full(t.shape, fill, dtype=t.dtype, device=device) for _ in range(2)]
    if device.type == "cuda":
        blocks.append(torch.full((16 << 20,), value, dtype=torch.float32, device=device))
    del blocks


# --------------------------------------------------------------------------------------------------- one call

def _classify_exception(e: BaseException, first_call: bool) -> GateFailure:
    from triton.compiler.errors import CompilationError

    tb = "".join(traceback.format_exception(e))[-6000:]
    msg = f"{type(e).__name__}: {e}"
    low = msg.lower()
    try:
        from triton.runtime.errors import InterpreterError
    except ImportError:  # pragma: no cover - older Triton
        InterpreterError = CompilationError  # noqa: N806
    if isinstance(e, CompilationError) or (first_call and isinstance(e, InterpreterError)):
        return GateFailure("compile", "compile", f"Triton compilation failed:\n{tb}")
    if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in low:
        return GateFailure("compile" if first_call else "correctness", "oom", msg[:2000])
    if any(k in low for k in CUDA_FAULTS):
        return GateFailure("compile" if first_call else "correctness", "gpu_fault", msg[:2000], poisoned=True)
    return GateFailure("compile" if first_call else "correctness", "runtime_error", f"candidate raised:\n{tb}")


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _candidate_stream(device: torch.device) -> torch.cuda.Stream | None:
    """One non-default stream per device, reused: CUDA's caching allocator pools blocks per stream, so the poisoned
    blocks must be freed on the stream the candidate allocates on."""
    if device.type != "cuda":
        return None
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def call_candidate(entry: Callable, g: Guarded, static: dict, device: torch.device, first_call: bool = False,
                   ref: dict[str, torch.Tensor] | None = None, poison: float = float("nan")):
    """Call `entry` under a non-default stream (CUDA) and wait for that stream only; with `ref`, prime the allocator
    with `poison` first. Returns (outputs, stream id)."""
    LAUNCHES.reset()
    stream = _candidate_stream(device)
    try:
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                if ref is not None:
                    _poison_allocator(ref, poison, device)
                out = entry(g.inputs, g.weights, g.state, copy.deepcopy(static))
            stream.synchronize()
        else:
            if ref is not None:
                _poison_allocator(ref, poison, device)
            out = entry(g.inputs, g.weights, g.state, copy.deepcopy(static))
    except BaseException as e:  # noqa: BLE001 - SystemExit from a candidate is a runtime error too
        raise _classify_exception(e, first_call) from None
    return out, (stream.cuda_stream if stream is not None else None)


def _check_shapes(out: Any, draw: Draw, device: torch.device) -> dict[str, torch.Tensor]:
    if not isinstance(out, dict):
        raise GateFailure("output_shape_dtype", "shape_dtype", f"entry: expected a dict of tensors, got {type(out)}")
    for name, r in draw.ref.items():
        if name not in out:
            raise GateFailure("output_shape_dtype", "shape_dtype",
                              f"output {name!r}: expected in the returned dict, got keys {sorted(out)}")
        t = out[name]
        if not isinstance(t, torch.Tensor):
            raise GateFailure("output_shape_dtype", "shape_dtype", f"output {name!r}: expected a tensor, got {type(t)}")
        got, exp = (tuple(t.shape), t.dtype, t.device.type), (tuple(r.shape), r.dtype, device.type)
        if got != exp:
            raise GateFailure("output_shape_dtype", "shape_dtype",
                              f"output {name!r}: expected (shape, dtype, device) {exp}, got {got}")
    return {n: out[n] for n in draw.ref}


def _check_guards(g: Guarded) -> None:
    for name, buf, pad, n, margins in g.buffers:
        now = torch.cat([buf[:pad], buf[pad + n:]])
        if not same_bits(now, margins):
            bad = int((_bits(now) != _bits(margins)).sum())
            raise GateFailure("canaries", "out_of_bounds",
                              f"{name}: {bad} canary bytes around the tensor were overwritten (write out of bounds)")
    views = {**{f"inputs.{k}": v for k, v in g.inputs.items()}, **{f"weights.{k}": v for k, v in g.weights.items()}}
    mutated = [k for k, orig in g.originals.items() if not same_bits(views[k], orig)]
    if mutated:
        raise GateFailure("inputs_unmodified", "input_mutated", f"candidate modified its inputs: {mutated}")


def _nonfinite_where_ref_finite(outs: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, t in outs.items() if t.is_floating_point()
            and bool((~torch.isfinite(t) & torch.isfinite(ref[n])).any())]


@dataclass
class Judge:
    """Runs the candidate over the draws and applies the per-call checks."""

    entry: Callable
    task: Task
    device: torch.device
    history: list[tuple[tuple[int, int], dict[str, torch.Tensor]]] = field(default_factory=list)
    max_abs: float = 0.0
    max_rel: float = 0.0
    runs: int = 0
    floor_passes: int = 0  # outputs (over all draws) that failed the table but passed the rounding floor
    floor_worst: tuple[float, str] = (-1.0, "")  # (got rel-L2 / floor rel-L2, note) of the tightest floor pass
    # the candidate's LOSSY declaration, honoured only when the task's workload opted in (spec.accuracy_budget)
    lossy: dict | None = None
    lossy_worst: tuple[float, str] = (-1.0, "")

    def run_once(self, draw: Draw, poison: float) -> tuple[dict[str, torch.Tensor], Guarded]:
        g = guard(draw)
        out, stream = call_candidate(self.entry, g, self.task.spec.static, self.device, ref=draw.ref, poison=poison)
        self.runs += 1
        if LAUNCHES.count == 0:
            raise GateFailure("launches_triton", "no_triton", "entry returned without launching a Triton kernel")
        if stream is not None and any(s != stream for s in LAUNCHES.streams):
            raise GateFailure("current_stream", "side_stream",
                              "a Triton kernel was launched on a stream other than the caller's current stream")
        outs = _check_shapes(out, draw, self.device)
        _check_guards(g)
        kept = {n: t.detach().clone() for n, t in outs.items()}
        if self.device.type == "cuda":
            # the outputs' blocks go back to the candidate stream's pool: finish reading them before it reuses them
            torch.cuda.synchronize(self.device)
        return kept, g

    def judge(self, draw: Draw) -> None:
        outs, _ = self.run_once(draw, float("nan"))
        tdt = {n: tolerance_dtype(self.task.spec.dtype, r.dtype) for n, r in draw.ref.items()}
        reports = {n: compare(outs[n], draw.ref[n], tdt[n]) for n in draw.ref}
        if draw.ref32 is not None:  # 16-bit task: an output the table rejects may still sit within the rounding floor
            for n, r in reports.items():
                if not r.ok:
                    reports[n] = compare_floor(outs[n], draw.ref[n], draw.ref32[n], tdt[n])
                    if reports[n].ok:
                        self._note_floor(n, draw, outs[n])
        if self.lossy is not None:  # opted in: judged by the lossy bound (acceptance enforces the budget in-model)
            for n, r in reports.items():
                if not r.ok:
                    reports[n] = compare_lossy(outs[n], draw.ref[n], (draw.ref32 or {}).get(n))
                    if reports[n].ok and rel_l2(outs[n], draw.ref[n]) > self.lossy_worst[0]:
                        self.lossy_worst = (rel_l2(outs[n], draw.ref[n]), f"{n}: {reports[n].reason} "
                                                                          f"(case {draw.key[0]}, draw {draw.key[1]})")
        nonfinite = _nonfinite_where_ref_finite(outs, draw.ref)
        if nonfinite or not all(r.ok for r in reports.values()):
            again, _ = self.run_once(draw, 3.0)
            unwritten = {n: int((_bits(outs[n]).view(-1) != _bits(again[n]).view(-1)).sum()) for n in outs
                         if outs[n].dtype == again[n].dtype}
            unwritten = {n: c for n, c in unwritten.items() if c}
            if unwritten:
                raise GateFailure("poisoned_outputs", "unwritten_output",
                                  f"outputs depend on the prior contents of their memory (bytes never written): "
                                  f"{unwritten}")
            if nonfinite:
                raise GateFailure("poisoned_outputs", "nan_inf", f"NaN/Inf where the reference is finite: {nonfinite}")
            for key, prev in self.history:
                if key != draw.key and all(same_bits(outs[n], prev[n]) for n in outs):
                    raise GateFailure("no_cached_output", "cached_output",
                                      f"draw {draw.key}: outputs are bit-identical to those returned for draw {key} "
                                      f"(different inputs)")
            bad = {n: r for n, r in reports.items() if not r.ok}
            self._errs(reports)
            raise GateFailure("correctness", "wrong_output", "; ".join(f"{n}: {r.reason}" for n, r in bad.items())
                              + f" (case {draw.key[0]}, draw {draw.key[1]})")
        self._errs(reports)
        self.history.append((draw.key, outs))

    def _note_floor(self, name: str, draw: Draw, out: torch.Tensor) -> None:
        self.floor_passes += 1
        floor = rel_l2(draw.ref[name], draw.ref32[name])
        got = rel_l2(out, draw.ref32[name])
        ratio = got / floor if floor > 0 else float("inf")
        if ratio > self.floor_worst[0]:
            note = (f"{name}: rel-L2 vs fp32 {got:.3g} <= {FLOOR_FACTOR:g} x {floor:.3g} "
                    f"(case {draw.key[0]}, draw {draw.key[1]})")
            self.floor_worst = (ratio, note)

    def floor_detail(self) -> str:
        lossy = (f"; lossy candidate {self.lossy} of an opted-in workload: worst {self.lossy_worst[1]}"
                 if self.lossy is not None and self.lossy_worst[0] >= 0 else "")
        if not self.floor_passes:
            return lossy
        return (f"; {self.floor_passes} output(s) passed by the rounding floor instead (tightest: "
                f"{self.floor_worst[1]})" + lossy)

    def _errs(self, reports) -> None:
        finite = [r for r in reports.values() if math.isfinite(r.max_abs)]
        self.max_abs = max([self.max_abs, *(r.max_abs for r in finite)])
        self.max_rel = max([self.max_rel, *(r.max_rel for r in finite)])


# ------------------------------------------------------------------------------------------------------ the run

def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_gates(task_dir: str, source: str, device: str = "cpu", draws: int = 5, seed: int = 0,
              timing: bool = True, memcheck: bool = False, decode_timing: str = "launch",
              **_: Any) -> tuple[Verdict, bool]:
    """Judge one candidate. Returns the verdict and whether this process's CUDA context is poisoned (the worker
    must then be replaced)."""
    dev = torch.device(device)
    task = load_task(Path(task_dir))
    v = Verdict(source_hash=source_hash(source), task_id=task.spec.task_id, worker_pid=os.getpid(),
                device_name=_device_name(dev), timing_source="cuda_events" if dev.type == "cuda" else "none: cpu")
    rep = check_source(source, forbidden_names_for(task.spec.module_class))
    if not rep.ok:
        return v.fail("static", "static", rep.reason), False
    v.gates.append(GateResult(name="static", passed=True, detail="allowed imports and calls only"))
    install_launch_hook()
    name = f"llm4llm_candidate_{v.source_hash[:16]}"
    try:
        with tempfile.TemporaryDirectory(prefix="llm4llm-cand-") as tmp:
            try:
                module = load_candidate(source, Path(tmp), name)
            except BaseException as e:  # noqa: BLE001
                return v.fail("compile", "compile", "executing the source failed:\n"
                              + "".join(traceback.format_exception(e))[-6000:]), False
            entry = getattr(module, "entry", None)
            if not callable(entry):
                return v.fail("compile", "compile", "the module defines no callable `entry`"), False
            lossy = getattr(module, "LOSSY", None) if task.spec.accuracy_budget else None
            return _run_loaded(v, task, entry, dev, draws, seed, timing, memcheck, source, decode_timing,
                               lossy=dict(lossy) if isinstance(lossy, dict) else None)
    finally:
        unload_candidate(name)


def _run_loaded(v: Verdict, task: Task, entry: Callable, dev: torch.device, draws: int, seed: int, timing: bool,
                memcheck: bool, source: str, decode_timing: str = "launch",
                lossy: dict | None = None) -> tuple[Verdict, bool]:
    all_draws = make_draws(task, dev, draws, seed)
    fill_reference(task, all_draws, reference_fn(task, dev), reference_fn(task, dev, upcast=True) if is_16bit(task)
                   else None)
    t0 = time.perf_counter()
    try:
        call_candidate(entry, guard(all_draws[0]), task.spec.static, dev, first_call=True)
    except GateFailure as f:
        return v.fail(f.gate, f.failure_class, f.message), f.poisoned
    v.gates.append(GateResult(name="compile", passed=True, detail=f"first call {time.perf_counter() - t0:.2f}s"))
    judge = Judge(entry, task, dev, lossy=lossy)
    try:
        for d in all_draws:
            try:
                judge.judge(d)
            except RuntimeError as e:  # a CUDA fault can surface at a later synchronisation, in the checks
                failure = _classify_exception(e, first_call=False)
                if failure.failure_class not in ("gpu_fault", "oom"):
                    raise
                raise failure from None
    except GateFailure as f:
        _append_passed_before(v, f.gate)
        v.max_abs_err, v.max_rel_err = judge.max_abs, judge.max_rel
        return v.fail(f.gate, f.failure_class, f.message), f.poisoned
    v.max_abs_err, v.max_rel_err = judge.max_abs, judge.max_rel
    _append_passed_before(v, None, runs=judge.runs, cases=len(task.cases), draws=draws, dev=dev,
                          floor=judge.floor_detail())
    if memcheck:
        from llm4llm.verify.sanitizer import memcheck_gate

        g = memcheck_gate(str(task.path), source, str(dev))
        if not g.passed:
            return v.fail("memcheck", "out_of_bounds", g.detail), False
        v.gates.append(g)
    if dev.type == "cpu":
        from llm4llm.verify.aot import aot_arch, aot_gate

        arch = aot_arch()
        if arch is not None:  # the interpreter ran it; would the GPU compiler take it?
            g = aot_gate(str(task.path), source, arch)
            if not g.passed:
                return v.fail(g.name, "compile", g.detail), False
            v.gates.append(g)
    if dev.type != "cuda" or not timing:
        why = NO_GPU if dev.type != "cuda" else "skipped: timing off"
        v.gates += [GateResult(name="timing_cold", passed=True, detail=why),
                    GateResult(name="timing_in_context", passed=True, detail=why)]
        return v.finish(), False
    from llm4llm.verify.timing import time_task

    try:
        time_task(v, task, entry, all_draws, dev, source=source, decode_graph=decode_timing != "launch",
                  prefill_graph=decode_timing == "graph_prefill")
    except GateFailure as f:
        return v.fail(f.gate, f.failure_class, f.message), f.poisoned
    return v.finish(), False


def _append_passed_before(v: Verdict, failing: str | None, runs: int = 0, cases: int = 0, draws: int = 0,
                          dev: torch.device | None = None, floor: str = "") -> None:
    """Record the per-call gates that passed (all of them, or those before the failing one)."""
    details = {
        "current_stream": "launches on the caller's stream" if dev is None or dev.type == "cuda"
        else "skipped: no GPU (no streams on the CPU)",
        "correctness": f"{runs} calls: {cases} captured case(s) + {draws} fresh draws each, TOLERANCES[dtype]" + floor,
    }
    for name in CHECK_GATES:
        if name == failing:
            return
        v.gates.append(GateResult(name=name, passed=True, detail=details.get(name, "")))


def tolerance_dtype(task_dtype: str, tensor_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype whose TOLERANCES row judges an output: the task's compute dtype when it is coarser than the
    tensor's (HF keeps some state in fp32, e.g. Mamba's ssm_state, but computes it from bf16 activations, so
    fp32's 1e-4 would reject every correct bf16 kernel); otherwise the tensor's own dtype."""
    compute = getattr(torch, task_dtype, None)
    if tensor_dtype == torch.float32 and compute in (torch.bfloat16, torch.float16):
        return compute
    return None
