"""KernelBench's protocol inside the verifier worker (llm4llm/verify/gates.py hands kernelbench tasks here).

Correctness (src/kernelbench/eval.py there): fp32; both models built under seed 42 (identical weights), left in
training mode; 5 trials whose seeds come from torch.manual_seed(42) + randint, `get_inputs()` under each trial's
seed, the seed set again right before each model's forward (so dropout draws the same mask); allclose with
atol = rtol = 1e-4, all trials must pass. We add the seed-42 inputs (the timed ones) as a sixth check, and every
gate of our verifier on each call: the candidate runs on a non-default stream with every Triton launch checked to
be on it, its inputs and weights sit in canary buffers and must come back bit-identical, its outputs are primed with
poison, and a wrong output equal to an earlier one is a cached result. TF32 is off for the reference and the
candidate (matmul and cuDNN), and a candidate that changes any precision setting is rejected outright (its change
would reach the reference in this process); a candidate that computes in bf16/fp16 inside must still meet 1e-4.

Timing (src/kernelbench/timing.py, "cuda_event"): warm-up calls, then `trials` calls each after a synchronize and an
L2 flush (a 256 MB fill), CUDA events around the forward, synchronize; the mean is KernelBench's runtime, and
p20/p50/p80 are kept beside it. Eager and torch.compile (inductor, default mode) are timed in the same worker on
the same inputs; the speedups are reference mean / candidate mean.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

import torch

from llm4llm.kernelbench.problem import SEED, build_model, inputs_for, load_module, set_seed, trial_seeds
from llm4llm.outcomes import FATAL_TO_WORKER, FailureClass
from llm4llm.verify.judge import (CHECK_GATES, Draw, GateFailure, Judge, append_passed_before, call_candidate,
                                  check_rewritten, classify_exception, guard, nonfinite_where_ref_finite, same_bits)
from llm4llm.verify.verdict import NO_GPU, GateResult, Latency, Verdict

ATOL = RTOL = 1e-4
TRIALS = 5
WARMUP = 3
PERF_TRIALS = int(os.environ.get("LLM4LLM_KB_TRIALS", "100"))
FLUSH_BYTES = 256 << 20
BUDGET_MS = float(os.environ.get("LLM4LLM_KB_TIME_MS", "4000"))  # trials are cut where 100 would take longer
LOCK_PATH = os.environ.get("LLM4LLM_KB_GPU_LOCK")  # set when several runs share one GPU: timed work is exclusive
_BASELINES: dict[tuple[str, str], dict[str, Any]] = {}  # (task, device) -> eager/compiled models, inputs, trials
# The candidate is timed interleaved with eager and torch.compile: ROUNDS rounds of (its trials / ROUNDS) each, the
# order rotated round by round, the speedups the median of the rounds' ratios (eager drifts within a call by more
# than the margins compared; a baseline timed once, minutes before the candidate, carries that drift into the ratio)
ROUNDS = int(os.environ.get("LLM4LLM_KB_ROUNDS", "3"))


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


LOCK_FD_ENV = "LLM4LLM_KB_GPU_LOCK_FD"  # the lock file opened by the parent, inherited by a sandboxed worker


def open_gpu_lock():
    """The lock file opened for a sandboxed child (its own open file description, so its flock excludes the other
    shards' workers), or None when no lock is set. The sandbox keeps the child away from the lock's path."""
    return open(LOCK_PATH, "a+") if LOCK_PATH else None


class gpu_lock:
    """An exclusive file lock around GPU-timed work when LLM4LLM_KB_GPU_LOCK names a lock file: shards of one
    KernelBench run may share a GPU for their CPU-bound work (imports, compiles, tracing, model init), never for
    timings or the judged calls, so no measurement overlaps another process's kernels. A sandboxed worker locks
    the descriptor its parent handed over (LLM4LLM_KB_GPU_LOCK_FD); an unsandboxed process opens the path."""

    def __enter__(self):
        import fcntl

        self.f, self.fd = None, None
        inherited = os.environ.get(LOCK_FD_ENV)
        if inherited:
            self.fd = int(inherited)
        elif LOCK_PATH:
            self.f = open(LOCK_PATH, "a+")
            self.fd = self.f.fileno()
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            _sync()
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            import fcntl

            _sync()
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        if self.f is not None:
            self.f.close()


def precision_flags() -> tuple:
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)


def strict_fp32() -> tuple:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return precision_flags()


class _Seed:
    value = SEED


def make_entry(model_new: torch.nn.Module, input_names: list[str], functional: bool) -> Callable:
    """The candidate contract's `entry` over a ModelNew: the seed set before the forward (as KernelBench does), the
    verifier's weights bound through functional_call when ModelNew's parameters and buffers carry the reference's
    names and shapes (so the canary and unmodified-weight gates see the tensors it reads), else its own seeded ones."""
    def entry(inputs, weights, state, static):
        args = [inputs[n] for n in input_names]
        set_seed(_Seed.value)
        with torch.no_grad():
            if functional:
                out = torch.func.functional_call(model_new, weights, tuple(args))
            else:
                out = model_new(*args)
        return {"out": out}
    return entry


def _same_layout(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return set(sa) == set(sb) and all(sa[k].shape == sb[k].shape and sa[k].dtype == sb[k].dtype for k in sa)


class KBJudge(Judge):
    """The verifier's Judge with KernelBench's comparison done on the device (Level 2 outputs reach GBs)."""

    def judge(self, draw: Draw) -> None:
        outs, _ = self.run_once(draw, float("nan"))
        bad, worst = [], 0.0
        for n, r in draw.ref.items():
            o = outs[n]
            if o.shape != r.shape or o.dtype != r.dtype:
                bad.append(f"{n}: expected {tuple(r.shape)} {r.dtype}, got {tuple(o.shape)} {o.dtype}")
                continue
            diff = (o.double() - r.double()).abs() if o.numel() < (1 << 26) else (o - r).abs()
            worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
            finite = bool(torch.isfinite(o).all())
            ok = finite and bool(torch.allclose(o, r, atol=ATOL, rtol=RTOL))
            if not ok:
                bad.append(f"{n}: max abs err {float(diff.max()):.3g} over atol=rtol={ATOL} (allclose)"
                           + ("" if finite else ", non-finite values"))
            del diff
        self.max_abs = max(self.max_abs, worst)
        if bad:
            again, _ = self.run_once(draw, 3.0)
            check_rewritten(outs, again)
            nonfinite = nonfinite_where_ref_finite(outs, draw.ref)
            if nonfinite:
                raise GateFailure("poisoned_outputs", FailureClass.NAN_INF,
                                  f"NaN/Inf where the reference is finite: {nonfinite}")
            for key, prev in self.history:
                if key != draw.key and all(same_bits(outs[n], prev[n].to(outs[n].device)) for n in outs):
                    raise GateFailure("no_cached_output", FailureClass.CACHED_OUTPUT,
                                      f"trial {draw.key}: outputs are bit-identical to those of trial {key} "
                                      f"(different inputs)")
            raise GateFailure("correctness", FailureClass.WRONG_OUTPUT, "; ".join(bad) + f" (trial {draw.key[1]})")
        # earlier outputs, for the cached-result check: small ones whole, large ones on the host
        self.history.append((draw.key, {n: t if t.numel() < (1 << 24) else t.cpu() for n, t in outs.items()}))


def run_kb(v: Verdict, task, module, dev: torch.device, timing: bool = True,
           perf_trials: int | None = None) -> tuple[Verdict, bool]:
    """Judge a loaded ModelNew candidate against its KernelBench task. Returns (verdict, context poisoned)."""
    try:
        return _run_kb(v, task, module, dev, timing, perf_trials)
    finally:
        if dev.type == "cuda":  # give cached blocks back: shards of a run share the GPU's memory
            import gc

            gc.collect()
            torch.cuda.empty_cache()


def _run_kb(v: Verdict, task, module, dev: torch.device, timing: bool, perf_trials: int | None):
    spec = task.spec
    flags = strict_fp32()
    problem = load_module(spec.static["source"], f"kb_ref_{spec.task_id.replace('-', '_')}")
    if not isinstance(getattr(module, "ModelNew", None), type):
        return v.fail("compile", FailureClass.COMPILE, "the module defines no class `ModelNew`"), False
    t0 = time.perf_counter()
    try:
        ref_model, new_model = _build_models(problem, module, dev, flags)
    except GateFailure as f:
        return v.fail(f.gate, f.failure_class, f.message), f.poisoned
    weights = {k: t.detach().clone() for k, t in ref_model.state_dict().items()}
    functional = _same_layout(ref_model, new_model)
    if functional:  # identical weights by construction: the reference's, as the verifier guards them
        new_model.load_state_dict(weights)
    entry = make_entry(new_model, spec.input_names, functional)
    trials = _Trials(problem, spec.input_names, ref_model, weights, dev)
    try:
        _Seed.value = trials.seeds[0]
        first = trials.draw(0)
        call_candidate(entry, guard(first), spec.static, dev, first_call=True)  # compiles: outside the GPU lock
        del first
    except GateFailure as f:
        return v.fail(f.gate, f.failure_class, f.message), f.poisoned
    v.gates.append(GateResult(name="compile", passed=True, detail=f"ModelNew built and first call "
                                                                  f"{time.perf_counter() - t0:.2f}s; weights "
                                                                  f"{'bound by name' if functional else 'seeded'}"))
    judge = KBJudge(entry, task, dev)
    try:
        _judge_trials(judge, trials, flags)
    except GateFailure as f:
        append_passed_before(v, f.gate if f.gate in CHECK_GATES else None)
        v.max_abs_err = judge.max_abs
        return v.fail(f.gate, f.failure_class, f.message), f.poisoned
    v.max_abs_err = judge.max_abs
    v.kb_degenerate = trials.constant
    append_passed_before(v, None, runs=judge.runs, cases=1, draws=TRIALS, dev=dev)
    v.gates[-1] = GateResult(name="correctness", passed=True,
                             detail=f"KernelBench: {TRIALS} trials (seeds from {SEED}) + the seed-{SEED} inputs, "
                                    f"allclose atol=rtol={ATOL}, fp32, TF32 off; {judge.runs} calls")
    v.gates.append(GateResult(name="precision", passed=True, detail="TF32 and reduced-precision settings unchanged"))
    del judge
    return _timing_gates(v, spec, problem, ref_model, new_model, dev, timing, perf_trials)


def _build_models(problem, module, dev: torch.device, flags: tuple):
    """(reference, ModelNew), both built as KernelBench builds them; a GateFailure when ModelNew cannot be built
    or building it changed the fp32 precision settings."""
    try:
        ref_model = build_model(problem, dev)
        new_model = build_model(problem, dev, cls=module.ModelNew)
    except BaseException as e:  # noqa: BLE001
        f = classify_exception(e, first_call=True)
        raise GateFailure(f.gate, f.failure_class, f"building ModelNew(*get_init_inputs()) failed: {f.message}",
                          f.poisoned) from None
    if precision_flags() != flags:
        raise GateFailure("precision", FailureClass.PRECISION_CHANGED,
                          f"importing or building the candidate changed the fp32 "
                          f"precision settings {flags} -> {precision_flags()} (TF32 or reduced-precision matmul)")
    return ref_model, new_model


class _Trials:
    """KernelBench's trials: the seed-42 inputs, then TRIALS seeded draws, each made when judged (Level 2 tensors
    reach GBs: one trial at a time)."""

    def __init__(self, problem, input_names: list[str], ref_model, weights: dict, dev: torch.device):
        self.problem, self.input_names, self.ref_model, self.weights, self.dev = (problem, input_names, ref_model,
                                                                                   weights, dev)
        self.seeds = [SEED, *trial_seeds(TRIALS)]
        # the problem's output does not depend on its inputs (every trial's reference the first's, within 1e-6):
        # KernelBench's degenerate problems, whose speedups measure how fast a constant is written, reported apart
        self.constant: bool | None = None
        self._first: torch.Tensor | None = None

    def note_reference(self, ref: torch.Tensor) -> None:
        """Track whether every trial's reference output equals the first trial's."""
        if self._first is None and self.constant is None:
            self._first, self.constant = (ref if ref.numel() < (1 << 24) else ref.cpu()), True
        elif self.constant:
            first = self._first.to(ref.device)
            self.constant = first.shape == ref.shape and bool(torch.allclose(ref, first, atol=1e-6, rtol=1e-6))
            if not self.constant:
                self._first = None

    def draw(self, i: int) -> Draw:
        """Trial i's inputs (drawn on the device: KernelBench draws them on the CPU, other values of the same law)
        and the reference's output for them."""
        with torch.device(self.dev):
            inputs = inputs_for(self.problem, self.seeds[i], self.dev)
        d = Draw((0, i), dict(zip(self.input_names, inputs)), self.weights, {})
        with torch.no_grad():
            set_seed(self.seeds[i])
            d.ref = {"out": self.ref_model(*inputs).detach()}
        self.note_reference(d.ref["out"])
        return d


def _judge_trials(judge: KBJudge, trials: _Trials, flags: tuple) -> None:
    """Every trial judged under the GPU lock; a GateFailure on the first wrong one, a device fault, or a change of
    the precision settings."""
    for i, s in enumerate(trials.seeds):
        _Seed.value = s
        try:
            with gpu_lock():
                judge.judge(trials.draw(i))
        except RuntimeError as e:
            failure = classify_exception(e, first_call=False)
            if failure.failure_class not in FATAL_TO_WORKER:
                raise
            raise failure from None
        if precision_flags() != flags:
            raise GateFailure("precision", FailureClass.PRECISION_CHANGED,
                              f"the forward changed the fp32 precision settings {flags} -> {precision_flags()}")


def _timing_gates(v: Verdict, spec, problem, ref_model, new_model, dev: torch.device, timing: bool,
                  perf_trials: int | None) -> tuple[Verdict, bool]:
    """The timing gates of a correct candidate: KernelBench's timing on a GPU, passed with the reason elsewhere."""
    if dev.type != "cuda" or not timing:
        # (the CPU verifier's sm_90 compile gate, llm4llm/verify/aot.py, then compiles the launches ModelNew made)
        why = NO_GPU if dev.type != "cuda" else "skipped: timing off"
        v.gates += [GateResult(name="timing_cold", passed=True, detail=why),
                    GateResult(name="timing_in_context", passed=True, detail=why)]
        return v.finish(), False
    try:
        _time(v, spec, problem, ref_model, new_model, dev, perf_trials or PERF_TRIALS)
    except GateFailure as f:
        return v.fail(f.gate, f.failure_class, f.message), f.poisoned
    except RuntimeError as e:
        f = classify_exception(e, first_call=False)
        return v.fail("timing_cold", f.failure_class, f.message), f.poisoned
    return v.finish(), False


# ------------------------------------------------------------------------------------------------------ timing

def _flush(dev: torch.device) -> None:
    dummy = torch.empty(FLUSH_BYTES // 8, dtype=torch.int64, device=dev)
    dummy.fill_(42)
    del dummy


def time_cuda_events(fn: Callable, args: list, dev: torch.device, trials: int, warmup: int = WARMUP) -> list[float]:
    """KernelBench's time_execution_with_cuda_event: warm-up, then per trial synchronize, flush L2, events around
    the call, synchronize (all streams). Milliseconds."""
    with torch.no_grad():
        for _ in range(warmup):
            fn(*args)
            torch.cuda.synchronize(dev)
        times = []
        for _ in range(trials + 1):  # the first trial is discarded, as KernelBench's discard_first=1
            torch.cuda.synchronize(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _flush(dev)
            start.record()
            fn(*args)
            end.record()
            torch.cuda.synchronize(dev)
            times.append(start.elapsed_time(end))
    return times[1:]


def _latency(times: list[float]) -> Latency:
    s = sorted(times)

    def q(p):
        return s[min(len(s) - 1, max(0, int(round(p * (len(s) - 1)))))]
    return Latency(p20=q(0.2), p50=q(0.5), p80=q(0.8), reps=len(s))


def _mean(times: list[float]) -> float:
    return sum(times) / len(times)


def _trials_for(ms: float, trials: int) -> int:
    """KernelBench's 100 trials, fewer only where one call is so long that 100 would exceed ~4 s (noted in the
    gate detail): Level 2 calls range from well under a millisecond to tens of milliseconds."""
    return max(10, min(trials, int(BUDGET_MS / max(ms, 1e-3))))


def baselines(spec, problem, ref_model, dev, trials: int) -> dict[str, Any]:
    """The problem's inputs, its trial count (KernelBench's 100, fewer for a long call: `_trials_for`) and its
    torch.compile'd model (None, with the error, where compile fails), once per task in this worker."""
    key = (spec.task_id, str(dev))
    if key in _BASELINES:
        return _BASELINES[key]
    set_seed(SEED)
    with torch.device(dev):
        inputs = inputs_for(problem, SEED, dev)
    with gpu_lock():
        probe = time_cuda_events(ref_model, inputs, dev, 3, warmup=1)
    out: dict[str, Any] = {"trials": _trials_for(_mean(probe), trials), "inputs": inputs, "compiled": None}
    t0 = time.perf_counter()
    try:
        from torch import _dynamo

        _dynamo.reset()
        compiled = torch.compile(ref_model)  # inductor, default mode
        with torch.no_grad():  # the compile itself (CPU work) outside the GPU lock
            compiled(*inputs)
        torch.cuda.synchronize(dev)
        out["compile_s"], out["compiled"] = time.perf_counter() - t0, compiled
    except Exception as e:  # noqa: BLE001 - a problem torch.compile cannot take has no compile baseline
        out["compile_error"] = f"{type(e).__name__}: {e}"[:300]
    _BASELINES[key] = out
    return out


def interleaved_times(fns: dict[str, Callable], inputs: list, dev, trials: int, rounds: int = ROUNDS
                      ) -> tuple[dict[str, list[float]], list[dict[str, float]]]:
    """Each fn's trials over `rounds` rounds (trials // rounds each, at least 10), the order rotated every round
    (A B C, B C A, ...): (all times per fn, each round's mean per fn)."""
    names = list(fns)
    per = max(10, trials // max(1, rounds))
    times: dict[str, list[float]] = {k: [] for k in names}
    means: list[dict[str, float]] = []
    for r in range(max(1, rounds)):
        got = {}
        for k in names[r % len(names):] + names[:r % len(names)]:
            got[k] = time_cuda_events(fns[k], inputs, dev, per)
            times[k] += got[k]
        means.append({k: _mean(v) for k, v in got.items()})
    return times, means


def round_ratios(means: list[dict[str, float]], base: str) -> list[float]:
    """Per round: base's mean over the candidate's (a speedup over `base`)."""
    return [m[base] / m["candidate"] for m in means]


def _time(v: Verdict, spec, problem, ref_model, new_model, dev, trials: int) -> None:
    base = baselines(spec, problem, ref_model, dev, trials)
    inputs, n = base["inputs"], base["trials"]
    with torch.no_grad():  # Triton autotuning and first launches outside the lock
        new_model(*inputs)
    torch.cuda.synchronize(dev)
    fns = {"candidate": new_model, "eager": ref_model}
    if base["compiled"] is not None:
        fns["compile"] = base["compiled"]
    with gpu_lock():
        times, means = interleaved_times(fns, inputs, dev, n)
    cand, eager, comp = times["candidate"], times["eager"], times.get("compile")
    v.candidate_cold = v.candidate_in_context = _latency(cand)
    v.reference_cold = v.reference_in_context = _latency(eager)
    by_eager = round_ratios(means, "eager")
    v.speedup_cold = v.speedup_in_context = statistics.median(by_eager)
    v.kb_means_ms = {"candidate": _mean(cand), "eager": _mean(eager), "compile": _mean(comp) if comp else None,
                     "rounds": float(len(means)), "speedup_eager_min": min(by_eager),
                     "speedup_eager_max": max(by_eager)}
    if comp:
        by_compile = round_ratios(means, "compile")
        v.reference_compile = _latency(comp)
        v.speedup_compile = statistics.median(by_compile)
        v.kb_means_ms.update(speedup_compile_min=min(by_compile), speedup_compile_max=max(by_compile))
    n = len(cand)
    detail = (f"KernelBench cuda_event: {WARMUP} warm-up, {n} trials in {len(means)} interleaved rounds, L2 flushed "
              f"({FLUSH_BYTES >> 20} MB) before each; mean candidate {_mean(cand):.4g} ms, eager {_mean(eager):.4g} "
              f"ms (x{v.speedup_cold:.3g}, rounds {min(by_eager):.3g}-{max(by_eager):.3g}), torch.compile "
              + (f"{_mean(comp):.4g} ms (x{v.speedup_compile:.3g})" if comp
                 else f"failed: {base.get('compile_error')}"))
    v.gates.append(GateResult(name="timing_cold", passed=True, detail=detail))
    v.gates.append(GateResult(name="timing_in_context", passed=True,
                              detail="KernelBench has one timing mode: the cold timing above"))
