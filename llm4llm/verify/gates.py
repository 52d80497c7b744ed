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
- output ownership: every call's outputs must be fresh memory: an output sharing storage with an input, a weight, or
  an output of one of the last HELD_CALLS calls (which the worker keeps alive, so the allocator cannot hand the same
  address back legitimately) is output_aliased. Only a `state_out.<name>` may be its state buffer (in-place state).
- torch doing the work: every judged call runs under a dispatch-mode counter, on the calling thread and on every
  Python thread the candidate starts (`install_thread_counting`); the parent judges each call's counts. After the
  timed calls, one draw per case is judged again, so a candidate that changes behaviour after N calls is caught.
- timing-only shortcuts (correct on the judged calls, wrong or skipped while timed): every timed call runs on fresh
  inputs (timing.fill_fresh), and a random sample of timed calls, chosen after each call returned
  (timing.TimedSample), is compared with the reference like the draws (`check_timed_samples`): timed_output_mismatch.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kernels_runtime.tolerances import compare_lossy
from llm4llm.outcomes import FATAL_TO_WORKER, DecodeTiming, FailureClass
from llm4llm.scratch import scratch_dir
from llm4llm.taskkind import kind_of
from llm4llm.taskspec import Task, load_task
from llm4llm.verify.answer import AnswerError, delta_decode, delta_encode, read_answer
from llm4llm.verify.candidate import LAUNCHES, install_launch_hook, load_candidate, unload_candidate
from llm4llm.verify.judge import (Canary, Draw, GateFailure, Guarded, Judge, answer_bases, append_passed_before,
                                  call_candidate, canary_fill, check_guards, check_shapes, classify_exception,
                                  compact_refs, compare_outputs, guard, nonfinite_where_ref_finite,
                                  resident)
from llm4llm.verify.static_gate import check_task_source
from llm4llm.verify.timing import KEEP_AS_CAPTURED  # name fragments of inputs that are not random data
from llm4llm.verify.timing import flat_outputs, fresh_draw, module_runner, time_task
from llm4llm.verify.verdict import NO_GPU, GateResult, Verdict, source_hash

log = logging.getLogger(__name__)
# LLM4LLM_TIMED_CHECK=off: the sampled timed outputs are not judged (the gate says so in every verdict); for
# debugging the check itself on a new GPU, like LLM4LLM_SANDBOX_OFF for the sandbox
TIMED_CHECK_ENV = "LLM4LLM_TIMED_CHECK"


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
    """A fresh draw like `t`: floats from randn scaled by t's std; integers, bools, masks and positions as captured.
    Drawn on the generator's device: a KV cache of 277M elements took ~3 s a draw from the CPU's generator (the
    references of a 7B serving regime's decode layer took 83 s), microseconds from the GPU's."""
    if not t.is_floating_point() or any(k in name for k in KEEP_AS_CAPTURED) or not torch.isfinite(t).all():
        return t.clone()
    std = float(t.float().std()) if t.numel() > 1 else 1.0
    std = std if math.isfinite(std) and std > 0 else 1.0
    return (torch.randn(t.shape, generator=gen, device=gen.device) * std).to(device=t.device, dtype=t.dtype)


# The draws of a task's cases, in the verifying parent (with each draw's reference and fp32 anchor) and in its worker
# (the draws alone), are kept on the GPU up to this share of its memory, the smallest cases first; a case past it
# keeps its draws on the host, each copied over for its own call (judge.resident) in every phase of the check.
# Llama-2-7B's decode layer over a serving regime (a 1.1 GB KV cache a draw at batch 32 x 2048, 6-9 draws a case,
# each reference whole) once held 78 GB in the verifying parent, and the worker beside it could not load its first
# draw. A state output that differs from its state in a few positions (a static KV cache's state-out) is kept as a
# judge.DeltaRef, so it costs next to nothing here; every other output its reference plus a twice-as-wide anchor.
HOST_DRAWS_SHARE = 0.4
REF_COPIES = 3  # a whole reference in the parent: itself and the fp32 anchor (twice its bytes)


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _few_changes(out: torch.Tensor, base: torch.Tensor | None) -> bool:
    """Whether `out` differs from `base` in few enough elements to be kept as a judge.DeltaRef, judged on a strided
    sample of at most 64k elements (a cache that rolls each step, as a full sliding window does, changes most)."""
    from llm4llm.verify.answer import DELTA_MAX_FRACTION

    if base is None or base.shape != out.shape or base.dtype != out.dtype or not out.numel():
        return False
    step = max(1, out.numel() // 65536)
    a, b = out.reshape(-1)[::step], base.reshape(-1)[::step]
    return int((a != b).sum()) <= DELTA_MAX_FRACTION * a.numel()


def case_need(case, draws: int) -> int:
    """GPU bytes a case's draws take in the parent and its worker: the draws twice (both hold them) and the
    references that stay whole (all but a state-out that differs from its state in few elements, as the case's
    recorded reference shows; all of them where the case recorded none)."""
    data = _nbytes(case.inputs) + _nbytes(case.state)
    ref = getattr(case, "ref", None) or {}
    whole = sum(t.numel() * t.element_size() for n, t in ref.items()
                if not (n.startswith("state_out.") and _few_changes(t, case.state.get(n[len("state_out."):]))))
    return (draws + 1) * (2 * data + REF_COPIES * (whole if ref else data))


def draws_home(task: Task, device: torch.device, draws: int) -> list[torch.device]:
    """Where make_draws keeps each case's draws: on `device`, or on the host for the largest cases, those past
    HOST_DRAWS_SHARE of the GPU's memory once the smaller ones are counted (case_need)."""
    homes = [device] * len(task.cases)
    if device.type != "cuda":
        return homes
    need = [case_need(case, draws) for case in task.cases]
    room = HOST_DRAWS_SHARE * torch.cuda.get_device_properties(device).total_memory
    for k in sorted(range(len(need)), key=lambda k: need[k]):
        room -= need[k]
        if room < 0:
            homes[k] = torch.device("cpu")
    return homes


def make_draws(task: Task, device: torch.device, draws: int, seed: int,
               home: torch.device | list[torch.device] | None = None) -> list[Draw]:
    """Each case's captured call and `draws` fresh ones, drawn on `device` (deterministic in `seed` there: the
    verifying parent and its worker draw the same) and kept on `home` (default `device`; one device, or one a case:
    draws_home says which cases the host keeps, whose draws the judge copies over for each call)."""
    out = []
    homes = home if isinstance(home, list) else [home or device] * len(task.cases)
    for k, case in enumerate(task.cases):
        on = lambda d, dev: {n: t.to(dev) for n, t in d.items()}  # noqa: E731
        inputs, state = on(case.inputs, device), on(case.state, device)
        weights = on(case.weights, homes[k])
        out.append(Draw((k, 0), on(inputs, homes[k]), weights, on(state, homes[k])))
        for d in range(1, draws + 1):
            gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + k * 1009 + d)
            out.append(Draw((k, d), on({n: _fresh(n, t, gen) for n, t in inputs.items()}, homes[k]), weights,
                            on({n: _fresh(n, t, gen) for n, t in state.items()}, homes[k])))
    return out


def expected_names(task: Task) -> list[str]:
    return [*task.spec.output_names, *(f"state_out.{n}" for n in task.spec.state_names)]


@torch.no_grad()
def fill_reference(task: Task, draws: list[Draw], ref: Callable, ref32: Callable | None = None,
                   device: torch.device | None = None, compact: bool = False) -> None:
    """Each draw's reference outputs (d.ref); with `ref32` (16-bit tasks), also the fp32 anchor (d.ref32). A ref32
    that raises, lacks an output or returns another shape leaves d.ref32 None: the floor is then not applied.
    device: where the references run (a host-kept draw is copied there for its own, its results kept on the host).
    compact: state outputs kept as their few changes from the draw's state (judge.DeltaRef; a draw judged through
    judge.resident has them whole there)."""
    for d in draws:
        with contextlib.nullcontext() if device is None else resident(d, device):
            _fill_one(task, d, ref, ref32)
            if compact:  # on the device, before a host-kept draw's references go back to the host
                compact_refs(d)


@torch.no_grad()
def _fill_one(task: Task, d: Draw, ref: Callable, ref32: Callable | None) -> None:
    def call(fn):
        return fn({n: t.clone() for n, t in d.inputs.items()}, {n: t.clone() for n, t in d.weights.items()},
                  {n: t.clone() for n, t in d.state.items()}, copy.deepcopy(task.spec.static))

    got = call(ref)
    missing = [n for n in expected_names(task) if n not in got]
    if missing:
        raise RuntimeError(f"reference: expected outputs {expected_names(task)}, missing {missing}")
    d.ref = {n: got[n].detach() for n in expected_names(task)}
    if ref32 is None:
        return
    try:
        wide = call(ref32)
        wide = {n: wide[n].detach() for n in expected_names(task)}
    except Exception:  # noqa: BLE001 - an fp32 copy the module refuses only costs the floor, never the run
        return
    if all(wide[n].shape == d.ref[n].shape for n in d.ref):
        d.ref32 = wide


# ------------------------------------------------------------------------------------------------ guarded buffers

# ------------------------------------------------------------------------------------------------------ the run

def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_gates(task_dir: str, source: str, device: str = "cpu", draws: int = 5, seed: int = 0,
              timing: bool = True, memcheck: bool = False, decode_timing: DecodeTiming | str = DecodeTiming.LAUNCH,
              **_: Any) -> tuple[Verdict, bool]:
    """Judge one candidate. Returns the verdict and whether this process's CUDA context is poisoned (the worker
    must then be replaced)."""
    dev = torch.device(device)
    task = load_task(Path(task_dir))
    v = Verdict(source_hash=source_hash(source), task_id=task.spec.task_id, worker_pid=os.getpid(),
                device_name=_device_name(dev), timing_source="cuda_events" if dev.type == "cuda" else "none: cpu")
    rep = check_task_source(source, task.spec)
    if not rep.ok:
        return v.fail("static", FailureClass.STATIC, rep.reason), False
    v.gates.append(GateResult(name="static", passed=True, detail="allowed imports and calls only"))
    install_launch_hook()
    name = f"llm4llm_candidate_{v.source_hash[:16]}"
    try:
        with tempfile.TemporaryDirectory(prefix="llm4llm-cand-") as tmp:
            try:
                module = load_candidate(source, Path(tmp), name)
            except BaseException as e:  # noqa: BLE001
                return v.fail("compile", FailureClass.COMPILE, "executing the source failed:\n"
                              + "".join(traceback.format_exception(e))[-6000:]), False
            if (kind := kind_of(task.spec)) is not None:  # a task of another kind: judged by its own protocol
                return kind.judge(v, task, module, dev, timing)
            entry = getattr(module, "entry", None)
            if not callable(entry):
                return v.fail("compile", FailureClass.COMPILE, "the module defines no callable `entry`"), False
            lossy = getattr(module, "LOSSY", None) if task.spec.accuracy_budget else None
            return _run_loaded(v, task, entry, dev, draws, seed, timing, memcheck, source, decode_timing,
                               lossy=dict(lossy) if isinstance(lossy, dict) else None)
    finally:
        unload_candidate(name)


def _run_loaded(v: Verdict, task: Task, entry: Callable, dev: torch.device, draws: int, seed: int, timing: bool,
                memcheck: bool, source: str, decode_timing: DecodeTiming | str = DecodeTiming.LAUNCH,
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
                failure = classify_exception(e, first_call=False)
                if failure.failure_class not in FATAL_TO_WORKER:
                    raise
                raise failure from None
    except GateFailure as f:
        append_passed_before(v, f.gate)
        v.max_abs_err, v.max_rel_err = judge.max_abs, judge.max_rel
        return v.fail(f.gate, f.failure_class, f.message), f.poisoned
    v.max_abs_err, v.max_rel_err = judge.max_abs, judge.max_rel
    append_passed_before(v, None, runs=judge.runs, cases=len(task.cases), draws=draws, dev=dev,
                          floor=judge.floor_detail())
    if memcheck:
        from llm4llm.verify.sanitizer import memcheck_gate

        g = memcheck_gate(str(task.path), source, str(dev))
        if not g.passed:
            return v.fail("memcheck", FailureClass.OUT_OF_BOUNDS, g.detail), False
        v.gates.append(g)
    if dev.type != "cuda" or not timing:
        why = NO_GPU if dev.type != "cuda" else "skipped: timing off"
        v.gates += [GateResult(name="timing_cold", passed=True, detail=why),
                    GateResult(name="timing_in_context", passed=True, detail=why)]
        return v.finish(), False
    samples: list = []
    try:
        time_task(v, task, entry, all_draws, dev, source=source, decode_graph=decode_timing != DecodeTiming.LAUNCH,
                  prefill_graph=decode_timing == DecodeTiming.GRAPH_PREFILL, samples=samples)
        meta, tensors = samples_payload(samples)
        v.gates.append(GateResult(name="timed_outputs", passed=True,
                                  detail=check_timed_samples(task, dev, meta, {n: t.to(dev) for n, t in
                                                                               tensors.items()}, lossy=lossy)))
    except GateFailure as f:
        return v.fail(f.gate, f.failure_class, f.message), f.poisoned
    return v.finish(), False



# ------------------------------------------------------------------------------------------ timed-call samples

def samples_payload(samples: list) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The worker's `TimedSample`s as JSON metadata and host tensors (`s<j>.<output name>`) for the parent."""
    meta, tensors = [], {}
    for sampler in samples:
        for call, seed, outs in sampler.kept:
            j = len(meta)
            meta.append({"case": sampler.case, "mode": sampler.mode, "via": sampler.via, "seed": int(seed),
                         "call": call, "of": sampler.seen, "names": sorted(outs)})
            for n, t in outs.items():
                tensors[f"s{j}.{n}"] = t.detach().to("cpu", copy=True).contiguous()
    return meta, tensors


@torch.no_grad()
def _module_outputs(task: Task, dev: torch.device, inputs: dict, state: dict, upcast: bool,
                    cache: dict) -> dict[str, torch.Tensor]:
    """The task's module called as the timing calls it (timing.module_call, its own weights), its output tensors
    by `timing.flat_outputs` name; upcast: module and floats in fp32 (the rounding floor's anchor)."""
    if upcast not in cache:
        module = task.load_module(dev).eval()
        cache[upcast] = module_runner(task, module.float() if upcast else module)
    run, prepare = cache[upcast]
    up = _upcast if upcast else (lambda d: d)
    call, cleanup = prepare({n: t.clone() for n, t in up(inputs).items()}, {},
                            {n: t.clone() for n, t in up(state).items()}, copy.deepcopy(task.spec.static))
    try:
        out = run(call)
        return {n: t.detach().clone() for n, t in flat_outputs(out, "module").items()}
    finally:
        cleanup()


def check_timed_samples(task: Task, dev: torch.device, meta: list[dict], tensors: dict[str, torch.Tensor],
                        lossy: dict | None = None) -> str:
    """Judge the sampled timed calls (`timing.TimedSample`) like the draws (`compare_outputs`, NaN/Inf where the
    reference is finite): each call's fresh inputs are rebuilt here from its seed (`timing.fresh_draw`), its
    reference computed here; the worker sent only the seed and the outputs. A bare-entry call is compared with the
    task's reference (all outputs, state_out.* included), a call through kernels_runtime's dispatch with the
    module's own forward (its returned tensors). Raises GateFailure(timed_output_mismatch); returns the detail."""
    if not meta:  # cold timing always runs back to back, so every timing offers calls to a sample
        raise GateFailure("timed_outputs", FailureClass.TIMED_OUTPUT_MISMATCH,
                          "no sampled timed call came back from the worker")
    ref_fn = reference_fn(task, dev)
    ref32_fn = reference_fn(task, dev, upcast=True) if is_16bit(task) else None
    modules: dict = {}
    for j, m in enumerate(meta):
        k = int(m["case"])
        case = task.cases[k]
        t_in = {n: t.to(dev) for n, t in case.inputs.items()}
        t_state = {n: t.to(dev) for n, t in case.state.items()}
        inputs, state = fresh_draw(t_in, t_state, int(m["seed"]))
        where = f"{m['mode']} timing of case {k}, timed call {m['call']} of {m['of']} ({m['via']})"
        if m["via"] == "module":
            ref = _module_outputs(task, dev, inputs, state, False, modules)
            ref32 = None
            if is_16bit(task):
                try:
                    wide = _module_outputs(task, dev, inputs, state, True, modules)
                    ref32 = wide if all(n in wide and wide[n].shape == r.shape for n, r in ref.items()) else None
                except Exception:  # noqa: BLE001 - as fill_reference: the floor is then not applied
                    ref32 = None
        else:
            d = Draw((k, -1), inputs, {n: t.to(dev) for n, t in case.weights.items()}, state)
            fill_reference(task, [d], ref_fn, ref32_fn)
            ref, ref32 = d.ref, d.ref32
        outs = {n: tensors[f"s{j}.{n}"].to(dev) for n in ref if f"s{j}.{n}" in tensors}
        missing = [n for n in ref if n not in outs]
        if missing:
            raise GateFailure("timed_outputs", FailureClass.TIMED_OUTPUT_MISMATCH,
                              f"{where}: outputs {missing} missing from the sampled call's answer")
        reports, _ = compare_outputs(task, outs, ref, ref32)
        if lossy is not None:  # an opted-in lossy candidate: the lossy bound, as its draws were judged
            reports = {n: r if r.ok else compare_lossy(outs[n], ref[n], (ref32 or {}).get(n)) for n, r in reports.items()}
        nonfinite = nonfinite_where_ref_finite(outs, ref)
        bad = {n: r.reason for n, r in reports.items() if not r.ok}
        if nonfinite or bad:
            why = "; ".join([*(f"{n}: {r}" for n, r in bad.items()),
                             *([f"NaN/Inf where the reference is finite: {nonfinite}"] if nonfinite else [])])
            raise GateFailure("timed_outputs", FailureClass.TIMED_OUTPUT_MISMATCH,
                              f"{where}: a timed call's outputs differ from the reference on its fresh inputs "
                              f"(the calls judged before timing were right): {why}")
    runs = {(m["case"], m["mode"], m["via"]): m["of"] for m in meta}
    return (f"{len(meta)} timed calls, chosen at random after each returned, of {sum(runs.values())} timed on "
            f"fresh inputs, match the reference")


# ------------------------------------------------------------------------------------------- the split judge
# The candidate runs in the sandboxed worker (CandidateSession) and returns only tensors, written to files in its
# private dir; the draws' references, the comparisons, the canary and input checks run in the parent
# (RemoteJudge), where the candidate cannot read or patch them. The worker never holds a reference output.

HEAVY_ATEN = ("mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "convolution", "conv", "_scaled_dot",
              "softmax", "_softmax", "log_softmax", "einsum", "cumsum", "rms_norm", "layer_norm", "native_layer_norm",
              "_fused", "scaled_dot_product", "topk", "sort")
# views, allocations, copies and casts: moving data is not doing the task's work
FREE_ATEN = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like",
             "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "arange", "fill_", "zero_",
             "view", "_unsafe_view", "reshape", "as_strided", "t", "transpose", "permute", "expand", "select", "slice",
             "unsqueeze", "squeeze", "detach", "alias", "unbind", "split", "split_with_sizes", "chunk", "narrow",
             "clone", "copy_", "_to_copy", "contiguous", "lift_fresh", "resize_", "set_", "view_as_real",
             "view_as_complex", "_reshape_alias", "flatten", "unflatten", "movedim", "diagonal", "lift_fresh_copy",
             "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_local_scalar_dense",
             "item", "scalar_tensor", "_has_compatible_shallow_copy_type", "record_stream", "stride", "size",
             "numel", "dim", "is_contiguous", "storage_offset", "equal", "isfinite", "index_select", "cat", "stack"}
TORCH_WORK_SHARE = 0.25  # elements produced by compute aten ops, as a share of the outputs', above which torch did it
# Library launchers whose aten ops are cuBLAS doing a task's GEMM (`linear(impl="cublas")`): glue only where the task's
# work is something else, the attention templates' projections around their attention kernel; in any other family
# a candidate calling it would pass this gate with cuBLAS doing the work
BLAS_LAUNCHERS = frozenset({"_cublas_linear"})
BLAS_GLUE_FAMILIES = frozenset({"attention"})


def _aten_name(func) -> str:
    name = getattr(func, "__name__", str(func))  # "mul.Tensor"
    return name.split(".")[0]


_OPS_DIR = str(Path(__file__).resolve().parents[2] / "kernels_runtime" / "ops")


def _library_launcher() -> str | None:
    """The kernels_runtime.ops function that issued this aten op (reviewed library code whose torch glue is part of
    its design, e.g. rglru's cuBLAS baddbmm), or None. Its pure-PyTorch `*_ref` references do not count."""
    import sys

    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if fn.startswith(_OPS_DIR):
            return None if f.f_code.co_name.endswith("_ref") else f.f_code.co_name
        if "/torch/" not in fn and not fn.endswith("gates.py"):
            return None  # the first frame outside torch and this module decides
        f = f.f_back
    return None


class AtenCounter:
    """Counts the aten ops a call runs outside Triton (a TorchDispatchMode): the heavy ones, and the elements the
    other non-free ones produce. While it is active (`with counter:`), ops on the candidate's own Python threads are
    counted too (`install_thread_counting`)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter.seen(func, out)
                return out

        self.mode, self.ops, self.elements, self.blas, self.threads = _Mode(), {}, 0, {}, 0

    def seen(self, func, out, helper_thread: bool = False) -> None:
        name = _aten_name(func)
        if name in FREE_ATEN:
            return
        launcher = _library_launcher()
        if launcher in BLAS_LAUNCHERS:
            self.blas[name] = self.blas.get(name, 0) + 1
        elif launcher is None:
            self.ops[name] = self.ops.get(name, 0) + 1
            self.threads += helper_thread
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self.elements += t.numel()

    def __enter__(self) -> "AtenCounter":
        _ACTIVE_COUNTER[0] = self
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.mode.__exit__(*exc)
        finally:
            _ACTIVE_COUNTER[0] = None

    def report(self) -> dict:
        return {"ops": dict(self.ops), "elements": int(self.elements), "library_blas": dict(self.blas),
                "helper_thread_ops": int(self.threads)}


_ACTIVE_COUNTER: list[AtenCounter | None] = [None]  # the counter of the judged call in progress, if any


def install_thread_counting() -> Callable[[], None]:
    """Make every Python thread started from now on count its aten ops into the active AtenCounter: torch work
    handed to a helper thread (threading, a ThreadPoolExecutor) during a judged call counts as the call's own.
    A dispatch mode is thread-local, so each new thread runs its whole life under a forwarding mode of its own. The
    sandboxed worker calls this before it loads a candidate (never a process that runs anything else: every later
    thread carries the mode). Idempotent; returns the undo."""
    import threading

    from torch.utils._python_dispatch import TorchDispatchMode

    inner = threading.Thread._bootstrap_inner
    if getattr(inner, "_llm4llm_counting", False):
        return lambda: None

    class _ThreadMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            counter = _ACTIVE_COUNTER[0]
            if counter is not None:
                counter.seen(func, out, helper_thread=True)
            return out

    def bootstrap_inner(self, _inner=inner):
        with _ThreadMode():
            _inner(self)

    bootstrap_inner._llm4llm_counting = True
    threading.Thread._bootstrap_inner = bootstrap_inner

    def undo() -> None:
        threading.Thread._bootstrap_inner = inner

    return undo


HELD_CALLS = 4  # the worker keeps the outputs of this many earlier calls alive to recognise a reused buffer


def _storage_span(t: torch.Tensor) -> tuple[int, int] | None:
    s = t.untyped_storage()
    return (s.data_ptr(), s.data_ptr() + s.nbytes()) if s.nbytes() else None


def _overlaps(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


def ownership_failure(outs: dict[str, torch.Tensor], g: Guarded, held: list[dict[str, torch.Tensor]]) -> str | None:
    """Why the outputs of a call are not the caller's own fresh memory (None: they are). `held`: earlier calls'
    outputs, still alive, so sharing their storage means the candidate hands out one buffer on every call (a caller
    holding the previous result sees it overwritten). An output sharing an input's or a weight's storage returns
    the caller's own tensor as a result. Only `state_out.<name>` may live in state buffer `<name>` (updated in place,
    as stateful tasks declare)."""
    bufs = {name: _storage_span(buf) for name, buf, *_ in g.buffers}
    for n, t in outs.items():
        span = _storage_span(t)
        for name, b in bufs.items():
            if _overlaps(span, b) and not (n.startswith("state_out.") and name == f"state.{n[len('state_out.'):]}"):
                return (f"output {n!r} shares storage with {name}: outputs must be fresh memory, not the caller's "
                        f"tensors")
        for age, prev in enumerate(reversed(held), 1):
            hit = next((p for p, pt in prev.items() if _overlaps(span, _storage_span(pt))), None)
            if hit is not None:
                return (f"output {n!r} shares storage with output {hit!r} of the call {age} call(s) earlier, which "
                        f"the caller still holds: a reused output buffer overwrites results the caller kept")
    return None


def torch_work_failure(report: dict | None, out_elements: int, family: str | None = None) -> str | None:
    """Why a call's aten ops say torch, not the candidate's Triton kernels, did the work (None: they do not).
    `family`: the task's; the library's cuBLAS projections are glue only in BLAS_GLUE_FAMILIES."""
    if not report:
        return None
    threads = report.get("helper_thread_ops") or 0
    where = f" ({threads} of them on helper threads)" if threads else ""
    blas = report.get("library_blas") or {}
    if blas and family not in BLAS_GLUE_FAMILIES:
        return (f"torch computed outside Triton: the library's cuBLAS projection (linear(impl='cublas')) ran {blas}; "
                f"it is glue only beside an attention kernel, not in a {family} task")
    heavy = {k: v for k, v in report.get("ops", {}).items() if k.startswith(HEAVY_ATEN)}
    if heavy:
        return f"torch computed outside Triton: heavy aten ops {heavy}{where}"
    share = report.get("elements", 0) / max(1, out_elements)
    if share > TORCH_WORK_SHARE:
        return (f"torch computed outside Triton: aten ops {report.get('ops')} produced {share:.0%} of the outputs' "
                f"elements (allowed: {TORCH_WORK_SHARE:.0%} for glue){where}")
    return None


def out_meta(ref: dict[str, torch.Tensor]) -> dict[str, list]:
    return {n: [list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in ref.items()}


def meta_tensors(meta: dict[str, list]) -> dict[str, torch.Tensor]:
    return {n: torch.empty(shape, dtype=getattr(torch, dt), device="meta") for n, (shape, dt) in meta.items()}


WEIGHT_BUFFER_LIMIT = 64 << 20  # weight buffers larger than this are checked in the worker, not sent back


class CandidateSession:
    """Worker side: one candidate, its draws (inputs only), calls on the parent's request."""

    def __init__(self, task_dir: str, source: str, device: str, draws: int, seed: int, canary_seed: int,
                 timing: bool = True, decode_timing: DecodeTiming | str = DecodeTiming.LAUNCH, **_: Any):
        self.dev = torch.device(device)
        self.task = load_task(Path(task_dir))
        self.source, self.timing, self.decode_timing = source, timing, decode_timing
        self.draws = make_draws(self.task, self.dev, draws, seed, home=draws_home(self.task, self.dev, draws))
        self.by_key = {d.key: d for d in self.draws}
        self.canary = Canary(canary_seed)
        self.name = f"llm4llm_candidate_{source_hash(source)[:16]}"
        self.entry: Callable | None = None
        self.held: list[dict[str, torch.Tensor]] = []  # the last HELD_CALLS calls' outputs, kept alive

    def _hold(self, out: Any) -> None:
        if isinstance(out, dict):
            kept = {n: t for n, t in out.items() if isinstance(t, torch.Tensor)}
            self.held = [*self.held, kept][-HELD_CALLS:]

    def load(self) -> dict:
        install_launch_hook()
        workdir = scratch_dir("cand-")  # this process's, removed at exit (the module's name is its source's hash)
        try:
            module = load_candidate(self.source, workdir, self.name)
        except BaseException as e:  # noqa: BLE001
            return {"fail": ["compile", "compile", "executing the source failed:\n"
                             + "".join(traceback.format_exception(e))[-6000:]]}
        self.entry = getattr(module, "entry", None)
        if not callable(self.entry):
            return {"fail": ["compile", "compile", "the module defines no callable `entry`"]}
        t0 = time.perf_counter()
        try:
            with resident(self.draws[0], self.dev):
                out, _ = call_candidate(self.entry, guard(self.draws[0], self.canary), self.task.spec.static,
                                        self.dev, first_call=True)
        except GateFailure as f:
            return {"fail": [f.gate, f.failure_class, f.message], "poisoned": f.poisoned}
        self._hold(out)
        return {"ok": f"first call {time.perf_counter() - t0:.2f}s"}

    def call(self, key: list[int], poison: float, meta: dict, path: str, **_: Any) -> dict:
        """One judged call of draw `key`: its aten ops counted (every thread), its outputs checked for ownership
        and written to `path` with the canary buffers, for the parent to judge."""
        d = self.by_key[tuple(key)]
        with resident(d, self.dev):
            return self._call(d, poison, meta, path)

    def _call(self, d: Draw, poison: float, meta: dict, path: str) -> dict:
        g = guard(d, self.canary)
        expected = meta_tensors(meta)
        counter = AtenCounter()
        try:
            try:
                with counter:
                    out, stream = call_candidate(self.entry, g, self.task.spec.static, self.dev, ref=expected,
                                                 poison=poison)
            except RuntimeError as e:
                raise classify_exception(e, first_call=False) from None
            if LAUNCHES.count == 0:
                raise GateFailure("launches_triton", FailureClass.NO_TRITON,
                                  "entry returned without launching a Triton kernel")
            if stream is not None and any(s != stream for s in LAUNCHES.streams):
                raise GateFailure("current_stream", FailureClass.SIDE_STREAM,
                                  "a Triton kernel was launched on a stream other than the caller's current stream")
            outs = check_shapes(out, {n: torch.empty(t.shape, dtype=t.dtype, device=self.dev)
                                       for n, t in expected.items()}, self.dev)
            shared = ownership_failure(outs, g, self.held)
            self._hold(out)
            if shared:
                raise GateFailure("output_ownership", FailureClass.OUTPUT_ALIASED, shared)
            if self.dev.type == "cuda":
                torch.cuda.synchronize(self.dev)
            from safetensors.torch import save_file

            # in-place updates go as their changed elements, the rest as host copies (answer.delta_encode: a copy
            # each, since an output may be the very state buffer the candidate updated, which safetensors refuses
            # to write twice)
            tensors = {f"out.{n}": t for n, t in outs.items()}
            for name, buf, pad, n, margins in g.buffers:
                if name.startswith("weights.") and buf.numel() * buf.element_size() > WEIGHT_BUFFER_LIMIT:
                    continue
                tensors[f"buf.{name}"] = buf
            tensors = delta_encode(tensors, answer_bases(d, self.canary))
            save_file(tensors, path)
        except GateFailure as f:
            return {"fail": [f.gate, f.failure_class, f.message], "poisoned": f.poisoned}
        big = [(name, buf, pad, n, margins) for name, buf, pad, n, margins in g.buffers
               if f"buf.{name}" not in tensors]
        if big:  # large weights: checked here (the parent gets the verdict of this check only)
            try:
                check_guards(Guarded({}, dict(g.weights), {}, big,
                                      {k: v for k, v in g.originals.items() if k.startswith("weights.")
                                       and any(b[0] == k for b in big)}))
            except GateFailure as f:
                return {"fail": [f.gate, f.failure_class, f.message]}
        return {"ok": True, "launches": LAUNCHES.count, "dispatch": counter.report()}

    def time(self, fresh_seed: int | None = None, path: str | None = None) -> dict:
        """Time the candidate (on the CPU: rehearse the timed calls, for their outputs only); with `path`, write
        the sampled timed calls' outputs there for the parent (`check_timed_samples`)."""
        v = Verdict(source_hash=source_hash(self.source), task_id=self.task.spec.task_id)
        samples: list = []
        try:
            cuda = self.dev.type == "cuda"  # a CPU rehearsal has no graphs
            time_task(v, self.task, self.entry, self.draws, self.dev, source=self.source,
                      decode_graph=cuda and self.decode_timing != DecodeTiming.LAUNCH,
                      prefill_graph=cuda and self.decode_timing == DecodeTiming.GRAPH_PREFILL, fresh_seed=fresh_seed,
                      samples=samples)
        except GateFailure as f:
            return {"fail": [f.gate, f.failure_class, f.message], "poisoned": f.poisoned}
        meta: list[dict] = []
        if path is not None:
            from safetensors.torch import save_file

            meta, tensors = samples_payload(samples)
            save_file(tensors, path)
        return {"ok": v.model_dump(mode="json"), "samples": meta}


def _load_answer(work: Path, name: str, rpc: Any, mangled: tuple[str, FailureClass, str] = (
        "output_shape_dtype", FailureClass.SHAPE_DTYPE, "the worker's outputs")) -> dict[str, torch.Tensor]:
    """The tensors of the worker's answer file `work/name`, read as llm4llm.verify.answer allows (a regular file,
    a size limit, before the candidate's deadline, which `rpc` carries). Raises GateFailure: a file that is not
    a regular one is the candidate tampering with the harness (worker_crash), a mangled one a wrong answer
    (`mangled`: its gate, class and what it held)."""
    from safetensors.torch import load

    try:
        data = read_answer(work, name, deadline=getattr(rpc, "deadline", None))
    except AnswerError as e:
        raise GateFailure("answer", FailureClass.WORKER_CRASH, str(e)) from None
    try:
        return load(data)
    except Exception as e:  # noqa: BLE001 - a mangled answer is the candidate process's doing
        raise GateFailure(mangled[0], mangled[1], f"{mangled[2]} could not be read: {e}") from None


@dataclass
class RemoteJudge(Judge):
    """Parent side: the same checks as Judge, on the tensors the worker's call wrote back."""

    rpc: Callable[[dict], dict] | None = None
    work: Path | None = None
    canary: Canary = field(default_factory=Canary)
    dispatch_ops: dict[str, int] = field(default_factory=dict)
    dispatch_note: str = ""

    def run_once(self, draw: Draw, poison: float) -> tuple[dict[str, torch.Tensor], Guarded]:
        name = f"call-{draw.key[0]}-{draw.key[1]}-{self.runs}.safetensors"
        reply = self.rpc({"op": "call", "key": list(draw.key), "poison": poison, "meta": out_meta(draw.ref),
                          "path": name})
        if "fail" in reply:
            gate, cls, msg = reply["fail"][:3]
            raise GateFailure(gate, cls, msg, poisoned=bool(reply.get("poisoned")))
        self.runs += 1
        saved = _load_answer(self.work, name, self.rpc)
        try:
            saved = delta_decode(saved, answer_bases(draw, self.canary), self.device)
        except AnswerError as e:
            raise GateFailure("output_shape_dtype", FailureClass.SHAPE_DTYPE, str(e)) from None
        # every judged call: a candidate that hands the work to torch only from its Nth call is caught on that call
        out_elems = sum(r.numel() for r in draw.ref.values())
        why = torch_work_failure(reply.get("dispatch"), out_elems, self.task.spec.family)
        if why:
            raise GateFailure("does_the_work", FailureClass.TORCH_COMPUTE, f"{why} (judged call {self.runs})")
        ops = (reply.get("dispatch") or {}).get("ops") or {}
        for op, k in ops.items():
            self.dispatch_ops[op] = self.dispatch_ops.get(op, 0) + k
        self.dispatch_note = (f"aten ops outside Triton over {self.runs} judged calls: {self.dispatch_ops}"
                              if self.dispatch_ops else f"no compute aten ops outside Triton in {self.runs} judged "
                                                        f"calls (every thread)")
        outs = {}
        for n in draw.ref:
            if f"out.{n}" not in saved:
                raise GateFailure("output_shape_dtype", FailureClass.SHAPE_DTYPE,
                                  f"output {n!r}: missing from the worker's answer")
            outs[n] = saved[f"out.{n}"].to(self.device)
        outs = check_shapes(outs, draw.ref, self.device)
        g = self._guarded(draw, saved)
        check_guards(g)
        return outs, g

    def _guarded(self, draw: Draw, saved: dict[str, torch.Tensor]) -> Guarded:
        """The worker's canary buffers after the call, checked against this side's layout and pristine draw."""
        buffers, views, originals = [], {"inputs": {}, "weights": {}, "state": {}}, {}
        for kind in views:
            for name, t in getattr(draw, kind).items():
                key = f"{kind}.{name}"
                if f"buf.{key}" not in saved:
                    if kind == "weights":
                        continue  # large: checked in the worker
                    raise GateFailure("canaries", FailureClass.OUT_OF_BOUNDS,
                                      f"{key}: its buffer is missing from the answer")
                n, pad = t.numel(), self.canary.pad(key, t.numel())
                buf = saved[f"buf.{key}"].to(self.device)
                if buf.numel() != n + 2 * pad or buf.dtype != t.dtype:
                    raise GateFailure("canaries", FailureClass.OUT_OF_BOUNDS,
                                      f"{key}: the returned buffer has another layout")
                margins = torch.empty(2 * pad, dtype=t.dtype, device=self.device)
                canary_fill(margins, self.canary)
                buffers.append((key, buf, pad, n, margins))
                views[kind][name] = buf[pad:pad + n].view(t.shape)
                if kind != "state":
                    originals[key] = t
        return Guarded(views["inputs"], views["weights"], views["state"], buffers, originals)


def lossy_of_source(source: str, task: Task) -> dict | None:
    """A lossy candidate's declared routing, its module-level `LOSSY = {...}`, read from the source without running
    it, where the task's workload opted in (an accuracy budget); None otherwise. The in-process path reads the loaded
    module's attribute; the parent of a sandboxed worker never imports candidate code. The dict's values may be
    literals or items of an earlier module-level literal (`CONFIG["tm_coverage"]`, as the templates render it)."""
    import ast

    if not task.spec.accuracy_budget:
        return None
    try:
        tree = ast.parse(source)
    except (SyntaxError, RecursionError, MemoryError):
        return None
    known: dict[str, Any] = {}

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in known:
            return known[node.value.id][ast.literal_eval(node.slice)]
        if isinstance(node, ast.Dict):
            return {ast.literal_eval(k): value(v) for k, v in zip(node.keys, node.values)}
        return ast.literal_eval(node)

    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        try:
            v = value(node.value)
        except (ValueError, KeyError, TypeError, IndexError, RecursionError, MemoryError):
            continue
        if node.targets[0].id == "LOSSY":
            return dict(v) if isinstance(v, dict) else None
        known[node.targets[0].id] = v
    return None


def judge_remote(v: Verdict, task: Task, dev: torch.device, rpc: Callable[[dict], dict], work: Path, draws: int,
                 seed: int, canary: Canary, timing: bool = True, rehearse: bool = False, lossy: dict | None = None,
                 **_: Any) -> tuple[Verdict, bool]:
    """The parent's half of a verification: references and every comparison here, the candidate's calls in the
    worker behind `rpc`. Returns the verdict and whether the worker's CUDA context is poisoned.

    rehearse (CPU only; tests, or to screen candidates for timing-only shortcuts): run the timed calls anyway,
    on host clocks whose numbers are discarded, so that the sampled timed outputs are checked there too."""
    t = time.perf_counter()
    all_draws = make_draws(task, dev, draws, seed, home=draws_home(task, dev, draws))
    fill_reference(task, all_draws, reference_fn(task, dev), reference_fn(task, dev, upcast=True) if is_16bit(task)
                   else None, device=dev, compact=True)
    if dev.type == "cuda":  # the references' working memory, back to the driver before the worker loads its draws
        torch.cuda.empty_cache()
    t = v.lap("references", t)
    r = rpc({"op": "load"})
    t = v.lap("load", t)
    if "fail" in r:
        gate, cls, msg = r["fail"][:3]
        return v.fail(gate, cls, msg), bool(r.get("poisoned"))
    v.gates.append(GateResult(name="compile", passed=True, detail=r["ok"]))
    judge = RemoteJudge(None, task, dev, rpc=rpc, work=work, canary=canary, lossy=lossy)
    try:
        for d in all_draws:
            try:
                judge.judge(d)
            except RuntimeError as e:
                failure = classify_exception(e, first_call=False)
                if failure.failure_class not in FATAL_TO_WORKER:
                    raise
                raise failure from None
    except GateFailure as f:
        append_passed_before(v, f.gate if f.gate != "does_the_work" else "launches_triton")
        v.max_abs_err, v.max_rel_err = judge.max_abs, judge.max_rel
        v.lap("checks", t)
        return v.fail(f.gate, f.failure_class, f.message), f.poisoned
    v.lap("checks", t)
    v.max_abs_err, v.max_rel_err = judge.max_abs, judge.max_rel
    append_passed_before(v, None, runs=judge.runs, cases=len(task.cases), draws=draws, dev=dev,
                          floor=judge.floor_detail())
    v.gates.append(GateResult(name="does_the_work", passed=True, detail=judge.dispatch_note))
    if not timing or (dev.type != "cuda" and not rehearse):
        why = NO_GPU if dev.type != "cuda" else "skipped: timing off"
        v.gates += [GateResult(name="timing_cold", passed=True, detail=why),
                    GateResult(name="timing_in_context", passed=True, detail=why)]
        return v.finish(), False
    return _judge_timed(v, task, dev, rpc, work, all_draws, lossy, judge)


def _judge_after_timing(judge: "RemoteJudge", all_draws: list[Draw]) -> str:
    """Judge one draw of each case again, chosen here at random, after the timed calls: the judged calls are then
    interleaved with the timed ones, so a candidate that behaves only for its first N calls meets a judged call
    (correctness, ownership, aten counts) after it changed. Raises GateFailure."""
    import secrets

    cases = sorted({d.key[0] for d in all_draws})
    for k in cases:
        judge.judge(secrets.choice([d for d in all_draws if d.key[0] == k]))
    return f"{len(cases)} draw(s) judged again after the timed calls"


def _judge_timed(v: Verdict, task: Task, dev: torch.device, rpc: Callable[[dict], dict], work: Path,
                 all_draws: list[Draw], lossy: dict | None, judge: "RemoteJudge") -> tuple[Verdict, bool]:
    """judge_remote's timing half: the worker times the candidate (on the CPU: rehearses the timed calls) on fresh
    inputs from a seed chosen here, and sends back a random sample of the timed calls' outputs, judged here
    (`check_timed_samples`); the judged calls again (`_judge_after_timing`); then, on a GPU, the physical floor."""
    import secrets

    name = f"timed-{secrets.token_hex(4)}.safetensors"
    t = time.perf_counter()
    r = rpc({"op": "time", "fresh_seed": secrets.randbits(31), "path": name})
    t = v.lap("timing", t)
    if "fail" in r:
        gate, cls, msg = r["fail"][:3]
        return v.fail(gate, cls, msg), bool(r.get("poisoned"))
    timed = Verdict.model_validate(r["ok"])
    if dev.type == "cuda":
        for k in ("candidate_cold", "reference_cold", "candidate_in_context", "reference_in_context", "speedup_cold",
                  "speedup_in_context"):
            setattr(v, k, getattr(timed, k))
        v.gates += [g for g in timed.gates]
    else:  # a rehearsal: host-clock numbers say nothing about the GPU and never count
        v.gates += [GateResult(name=f"timing_{m}", passed=True, detail=f"{NO_GPU} (timed calls rehearsed on the CPU "
                                                                       f"for their outputs; no latency)")
                    for m in ("cold", "in_context")]
    bad = next((g for g in timed.gates if not g.passed), None)
    if bad is not None:
        return v.fail(bad.name, FailureClass.TIMEOUT if "time" in bad.name else FailureClass.RUNTIME_ERROR, bad.detail), False
    try:
        tensors = _load_answer(work, name, rpc, ("timed_outputs", FailureClass.TIMED_OUTPUT_MISMATCH,
                                                 "the sampled timed outputs")) if r.get("samples") else {}
    except GateFailure as f:
        return v.fail(f.gate, f.failure_class, f.message), False
    if os.environ.get(TIMED_CHECK_ENV, "").lower() == "off":  # the operator's debugging switch, read in the parent
        detail = f"off ({TIMED_CHECK_ENV}=off): {len(r.get('samples') or [])} sampled timed calls not judged"
        log.warning("llm4llm verify: the timed-output check is off (%s=off)", TIMED_CHECK_ENV)
    else:
        try:
            detail = check_timed_samples(task, dev, list(r.get("samples") or []), tensors, lossy=lossy)
        except GateFailure as f:
            return v.fail(f.gate, f.failure_class, f.message), False
    try:
        again = _judge_after_timing(judge, all_draws)
    except RuntimeError as e:
        f = classify_exception(e, first_call=False)
        return v.fail(f.gate, f.failure_class, f.message), f.poisoned
    except GateFailure as f:
        return v.fail(f.gate, f.failure_class, f.message), f.poisoned
    finally:
        v.lap("timed_outputs", t)
    v.gates.append(GateResult(name="timed_outputs", passed=True, detail=f"{detail}; {again}"))
    if dev.type != "cuda":
        return v.finish(), False
    floor = physical_floor_failure(v, task, all_draws, dev)
    if floor:
        return v.fail("physical_floor", FailureClass.IMPOSSIBLE_TIME, floor), False
    v.gates.append(GateResult(name="physical_floor", passed=True, detail="timed latencies above the HBM floor"))
    return v.finish(), False


def hbm_bytes_per_s(dev: torch.device) -> float:
    """Peak DRAM bandwidth of a CUDA device: LLM4LLM_HBM_GBPS, else from its memory clock and bus width (DDR), else
    the hardware table's peak for it (kernels_runtime.hardware)."""
    env = os.environ.get("LLM4LLM_HBM_GBPS")
    if env:
        return float(env) * 1e9
    props = torch.cuda.get_device_properties(dev)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2.0 * clock_khz * 1e3 * bus_bits / 8
    from kernels_runtime.hardware import lookup

    return lookup(torch.cuda.get_device_name(dev)).hbm_peak_gbps * 1e9


FLOOR_MARGIN = 1.5  # a measured time below floor / 1.5 is impossible even with a generous peak


def physical_floor_failure(v: Verdict, task: Task, draws: list[Draw], dev: torch.device) -> str | None:
    """Cold timing flushes L2, so a call must at least write its outputs and read its weights from HBM: a p50 under
    (output + weight bytes) / peak bandwidth (with a margin) is impossible and says the timing was cheated."""
    if v.candidate_cold is None or dev.type != "cuda":
        return None
    d = draws[0]
    nbytes = sum(t.numel() * t.element_size() for t in d.ref.values())
    nbytes += sum(t.numel() * t.element_size() for t in d.weights.values())
    v.floor_ms = nbytes / hbm_bytes_per_s(dev) * 1e3
    floor_ms = v.floor_ms / FLOOR_MARGIN
    if v.candidate_cold.p50 < floor_ms:
        return (f"cold p50 {v.candidate_cold.p50 * 1e3:.2f} us is below the physical floor {floor_ms * 1e3:.2f} us "
                f"({nbytes} bytes of outputs and weights at {hbm_bytes_per_s(dev) / 1e12:.2f} TB/s / {FLOOR_MARGIN})")
    return None
