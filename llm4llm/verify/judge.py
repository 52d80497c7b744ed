"""Judging one candidate call by call: the draws it runs on, the canary-guarded views it gets, one guarded call
(`call_candidate`, exceptions classified into failure classes) and the per-call checks (`Judge`: launches, stream,
shapes, canaries, unmodified inputs, poisoned and cached outputs, correctness against TOLERANCES or the rounding
floor). The model tasks' gates (gates.py), their timing (timing.py) and KernelBench's protocol
(llm4llm/kernelbench/protocol.py) all judge with these; this module imports none of them.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kernels_runtime.tolerances import FLOOR_FACTOR, compare, compare_floor, compare_lossy, rel_l2
from llm4llm.taskspec import Task
from llm4llm.verify.candidate import LAUNCHES
from llm4llm.verify.verdict import GateResult, Verdict

CHECK_GATES = ("launches_triton", "current_stream", "output_shape_dtype", "output_ownership", "canaries",
               "inputs_unmodified",
               "poisoned_outputs", "no_cached_output", "correctness")
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


_DRAW_FIELDS = ("inputs", "weights", "state", "ref", "ref32")


def draw_device(d: Draw) -> torch.device | None:
    """Where the draw's tensors live (its first one's device; None for a draw without tensors)."""
    t = next((t for f in _DRAW_FIELDS for t in (getattr(d, f) or {}).values()), None)
    return None if t is None else t.device


def same_device(a: torch.device, b: torch.device) -> bool:
    """a and b are one device (`cuda` names the current one, which a tensor's device spells `cuda:0`)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


@dataclass
class DeltaRef:
    """A reference output kept as its changes from one of the draw's state tensors: a static KV cache's state-out is
    the cache with one position written, so the reference and its fp32 anchor, kept whole, held the cache three
    times over beside each draw (a 7B regime's draws then did not fit the GPU and were copied over for every call).
    `resident` rebuilds the whole tensor for the block that judges with it, from the draw's state there."""

    state: str  # the draw's state tensor it differs from
    shape: torch.Size
    dtype: torch.dtype
    idx: torch.Tensor  # flat int64 indices of the elements whose bits differ
    val: torch.Tensor  # their values

    @staticmethod
    def of(t: torch.Tensor, base: torch.Tensor | None, state: str) -> "DeltaRef | None":
        """`t` as its bitwise changes from `base` (cast to t's dtype: exact for an fp32 anchor of a 16-bit state),
        or None where they do not match in shape or too much of it changed (answer.changed_elements, the rule a
        judged call's answer is delta-coded by)."""
        from llm4llm.verify.answer import changed_elements

        idx = None if base is None or base.shape != t.shape else changed_elements(t, base.to(t.dtype))
        if idx is None:
            return None
        return DeltaRef(state, t.shape, t.dtype, idx, t.detach().contiguous().reshape(-1)[idx].clone())

    @property
    def device(self) -> torch.device:
        return self.idx.device

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def to(self, device) -> "DeltaRef":
        return DeltaRef(self.state, self.shape, self.dtype, self.idx.to(device), self.val.to(device))

    def full(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        flat = state[self.state].to(self.dtype, copy=True).contiguous().reshape(-1)
        flat[self.idx.to(flat.device)] = self.val.to(flat.device)
        return flat.view(self.shape)


def compact_refs(d: Draw) -> None:
    """Each `state_out.<name>` reference (and fp32 anchor) of the draw that differs from the draw's state `<name>` in
    few elements, kept as a DeltaRef (the rest as they are)."""
    for f in ("ref", "ref32"):
        refs = getattr(d, f)
        if not refs:
            continue
        for n, t in list(refs.items()):
            if n.startswith("state_out.") and isinstance(t, torch.Tensor):
                name = n[len("state_out."):]
                delta = DeltaRef.of(t, d.state.get(name), name)
                if delta is not None:
                    refs[n] = delta


@contextlib.contextmanager
def _whole_refs(d: Draw):
    """The draw's DeltaRefs rebuilt whole from its state for the block, its compact ones back after it."""
    kept = {f: getattr(d, f) for f in ("ref", "ref32")}
    if not any(isinstance(v, DeltaRef) for refs in kept.values() for v in (refs or {}).values()):
        yield d
        return
    for f, refs in kept.items():
        if refs:
            setattr(d, f, {n: v.full(d.state) if isinstance(v, DeltaRef) else v for n, v in refs.items()})
    try:
        yield d
    finally:
        for f, refs in kept.items():
            setattr(d, f, refs)


@contextlib.contextmanager
def resident(d: Draw, device: torch.device):
    """The draw on `device` for the block, its DeltaRefs whole: a draw kept on the host (make_draws' `home`, when a
    task's draws would crowd the GPU) is copied over, and after the block its host tensors are back and any
    reference the block computed (ref, ref32) is moved to the host. A draw already there is used as it is."""
    home = draw_device(d)
    if home is None or same_device(home, torch.device(device)):
        with _whole_refs(d):
            yield d
        return
    kept = {f: getattr(d, f) for f in _DRAW_FIELDS}
    for f, v in kept.items():
        setattr(d, f, None if v is None else {n: t.to(device) for n, t in v.items()})
    try:
        with _whole_refs(d):
            yield d
    finally:
        for f in _DRAW_FIELDS:
            now = getattr(d, f)
            computed = f in ("ref", "ref32") and now is not None and not kept[f]
            setattr(d, f, {n: t.to(home) for n, t in now.items()} if computed else kept[f])


@dataclass
class Guarded:
    """A draw's tensors as views inside canary buffers, with pristine copies to check them against."""

    inputs: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    buffers: list[tuple[str, torch.Tensor, int, int, torch.Tensor]]  # name, buffer, pad, numel, margins copy
    originals: dict[str, torch.Tensor]  # inputs and weights, which must come back unmodified



@dataclass(frozen=True)
class Canary:
    """Per-candidate canary layout: extra margin (in 64-element steps) and fill values drawn from the judge's seed,
    so a kernel cannot recognise canary views by a fixed offset or value and skip the work on plain tensors."""

    seed: int = 0

    def pad(self, name: str, n: int) -> int:
        base = max(CANARY_MIN, -(-min(n, 1 << 16) // 64) * 64)
        if not self.seed:
            return base
        return base + 64 * (_mix(self.seed, name) % 16)

    def value(self, dtype: torch.dtype):
        if dtype == torch.bool:
            return True
        k = _mix(self.seed, str(dtype)) % 997 if self.seed else 0
        if dtype.is_floating_point:
            return -1234.5 - 0.5 * k
        return (173 - k % 50) if dtype == torch.uint8 else -91 - k % 20


def _mix(seed: int, name: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def canary_fill(buf: torch.Tensor, canary: Canary | None = None) -> None:
    buf.fill_((canary or Canary()).value(buf.dtype))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def guard(draw: Draw, canary: Canary | None = None) -> Guarded:
    canary = canary or Canary()
    buffers, views, originals = [], {"inputs": {}, "weights": {}, "state": {}}, {}
    for kind in views:
        for name, t in getattr(draw, kind).items():
            n = t.numel()
            pad = canary.pad(f"{kind}.{name}", n)
            buf = _pristine_buffer(t, pad, canary)
            view = buf[pad:pad + n].view(t.shape)
            margins = torch.cat([buf[:pad], buf[pad + n:]]).clone()
            buffers.append((f"{kind}.{name}", buf, pad, n, margins))
            views[kind][name] = view
            if kind != "state":
                originals[f"{kind}.{name}"] = t.clone()
    return Guarded(views["inputs"], views["weights"], views["state"], buffers, originals)


def _pristine_buffer(t: torch.Tensor, pad: int, canary: Canary) -> torch.Tensor:
    """`t` flattened between two `pad`-element canary margins: the buffer `guard` hands the candidate."""
    buf = torch.empty(t.numel() + 2 * pad, dtype=t.dtype, device=t.device)
    canary_fill(buf, canary)
    buf[pad:pad + t.numel()].copy_(t.reshape(-1))
    return buf


def answer_bases(draw: Draw, canary: Canary) -> dict[str, Any]:
    """What each side holds of a judged call's answer before the call (answer.delta_encode): every input and state
    buffer as `guard` builds it (the draw inside its canary margins; built when asked), and a `state_out.<name>`
    output's state. The worker and the parent make the same draws from the same seed, so these are equal on both."""
    bases: dict[str, Any] = {}
    for kind in ("inputs", "state"):
        for name, t in getattr(draw, kind).items():
            bases[f"buf.{kind}.{name}"] = functools.partial(_pristine_buffer, t, canary.pad(f"{kind}.{name}",
                                                                                           t.numel()), canary)
    bases.update({f"out.state_out.{name}": t for name, t in draw.state.items()})
    return bases


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

def classify_exception(e: BaseException, first_call: bool) -> GateFailure:
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
    if isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in low \
            or "can't allocate memory" in low or "not enough memory" in low:  # the CPU allocator's words too
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
        raise classify_exception(e, first_call) from None
    return out, (stream.cuda_stream if stream is not None else None)


def check_shapes(out: Any, expected: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if not isinstance(out, dict):
        raise GateFailure("output_shape_dtype", "shape_dtype", f"entry: expected a dict of tensors, got {type(out)}")
    for name, r in expected.items():
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
    return {n: out[n] for n in expected}


def check_guards(g: Guarded) -> None:
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


def check_rewritten(outs: dict[str, torch.Tensor], again: dict[str, torch.Tensor]) -> None:
    """A second run under another poison must give the same bits: outputs that differ read memory the candidate
    never wrote."""
    unwritten = {n: int((_bits(outs[n]).view(-1) != _bits(again[n]).view(-1)).sum()) for n in outs
                 if outs[n].dtype == again[n].dtype}
    unwritten = {n: c for n, c in unwritten.items() if c}
    if unwritten:
        raise GateFailure("poisoned_outputs", "unwritten_output",
                          f"outputs depend on the prior contents of their memory (bytes never written): {unwritten}")


def nonfinite_where_ref_finite(outs: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
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
        outs = check_shapes(out, draw.ref, self.device)
        check_guards(g)
        kept = {n: t.detach().clone() for n, t in outs.items()}
        if self.device.type == "cuda":
            # the outputs' blocks go back to the candidate stream's pool: finish reading them before it reuses them
            torch.cuda.synchronize(self.device)
        return kept, g

    def judge(self, draw: Draw) -> None:
        home = draw_device(draw)
        with resident(draw, self.device):
            self._judge(draw, home)

    def _judge(self, draw: Draw, home: torch.device | None) -> None:
        outs, _ = self.run_once(draw, float("nan"))
        reports, floored = compare_outputs(self.task, outs, draw.ref, draw.ref32)
        for n in floored:
            self._note_floor(n, draw, outs[n])
        if self.lossy is not None:  # opted in: judged by the lossy bound (acceptance enforces the budget in-model)
            for n, r in reports.items():
                if not r.ok:
                    reports[n] = compare_lossy(outs[n], draw.ref[n], (draw.ref32 or {}).get(n))
                    if reports[n].ok and rel_l2(outs[n], draw.ref[n]) > self.lossy_worst[0]:
                        self.lossy_worst = (rel_l2(outs[n], draw.ref[n]), f"{n}: {reports[n].reason} "
                                                                          f"(case {draw.key[0]}, draw {draw.key[1]})")
        nonfinite = nonfinite_where_ref_finite(outs, draw.ref)
        if nonfinite or not all(r.ok for r in reports.values()):
            again, _ = self.run_once(draw, 3.0)
            check_rewritten(outs, again)
            if nonfinite:
                raise GateFailure("poisoned_outputs", "nan_inf", f"NaN/Inf where the reference is finite: {nonfinite}")
            for key, prev in self.history:
                if key != draw.key and all(same_bits(outs[n], prev[n].to(outs[n].device)) for n in outs):
                    raise GateFailure("no_cached_output", "cached_output",
                                      f"draw {draw.key}: outputs are bit-identical to those returned for draw {key} "
                                      f"(different inputs)")
            bad = {n: r for n, r in reports.items() if not r.ok}
            self._errs(reports)
            raise GateFailure("correctness", "wrong_output", "; ".join(f"{n}: {r.reason}" for n, r in bad.items())
                              + f" (case {draw.key[0]}, draw {draw.key[1]})")
        self._errs(reports)
        # kept where the draw lives: a host-kept draw's outputs would otherwise pile up on the GPU, draw after draw
        self.history.append((draw.key, outs if home is None else {n: t.to(home) for n, t in outs.items()}))

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


def compare_outputs(task: Task, outs: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                    ref32: dict[str, torch.Tensor] | None) -> tuple[dict[str, Any], list[str]]:
    """The correctness comparison of one call: each output against TOLERANCES (the task's compute dtype where
    coarser), and on 16-bit tasks, where the table rejects it, against the rounding floor (`ref32`, the fp32
    anchor). Returns the reports by name and the names that passed by the floor."""
    tdt = {n: tolerance_dtype(task.spec.dtype, r.dtype) for n, r in ref.items()}
    reports = {n: compare(outs[n], ref[n], tdt[n]) for n in ref}
    floored = []
    if ref32 is not None:  # 16-bit task: an output the table rejects may still sit within the rounding floor
        for n, r in reports.items():
            if not r.ok and n in ref32:
                reports[n] = compare_floor(outs[n], ref[n], ref32[n], tdt[n])
                if reports[n].ok:
                    floored.append(n)
    return reports, floored



def append_passed_before(v: Verdict, failing: str | None, runs: int = 0, cases: int = 0, draws: int = 0,
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
