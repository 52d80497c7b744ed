"""CUDA-only timing of a candidate against its reference, in the same process and the same way.

Two modes, each reported as p20/p50/p80 of per-call CUDA-event times over at least `MIN_REPS` calls and
`MIN_TIME_MS` of measurement after a warm-up:
- cold: before each call a 256 MB buffer is written (flushes L2) and the call gets the next of several fresh input
  buffers in rotation;
- in_context: right before each call a producer op (a copy) writes the inputs, as the preceding layer would, so they
  are as warm as in the model.
The reference is timed as the model calls it: the module's own forward with its own parameters bound, the cache
(state) built before the timed region (`module_call`). Timing the correctness harness instead (functional_call,
cache construction, output flattening, state copies) would add the harness's host time to host-bound decode
modules, and with it inflate every decode candidate's speedup by a gain the model never sees end to end. Latency
does not depend on weight values, so the module's own weights stand in for each draw's (same shapes and dtypes:
the instances of a task share them).

With decode graphs (`llm4llm optimize --decode-graphs`: the model's decode steps replay from CUDA graphs, so a
decode call costs the GPU only its kernels), decode tasks are timed that way too: the verifier option
`decode_timing="graph"` (VerifierPool; the optimize flow sets it when it runs with graphs) makes the in_context
mode of a decode task capture GRAPH_CALLS calls (candidate through its dispatch, reference as the
module's own forward) in one CUDA graph and time its replays; launch cost, which the graphs remove, no longer hides
a slow kernel (a candidate that wins back to back by saving launches can be slower than the reference's ops under
graph replay). The graph cycles through copies of the module with their own weights, enough for
twice the L2 (`weight_replicas`): in the model a layer's weights come from HBM, not from L2 where twenty calls of one
module keep them. Candidate and reference are captured side by side and their replays alternate, so the reference is
timed with each candidate, not once per worker: a clock or host change moves both. Where a call cannot be captured,
it is timed back to back and the gate says so. `decode_timing="graph_prefill"` times prefill tasks the same way:
the optimize flow sets it where the model's prompt forward replays from a graph too (kernels_runtime's prefill
graphs: every cache layer a Mamba/Mamba2 `LinearAttentionLayer`).
There is no CPU timing: a CPU time would say nothing about the GPU and must never count as a speedup.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

from llm4llm.outcomes import FailureClass
from llm4llm.verify.judge import classify_exception, resident
from llm4llm.verify.verdict import GateResult, Latency, Verdict

FLUSH_BYTES = 256 << 20
MIN_REPS = 50
MIN_TIME_MS = float(os.environ.get("LLM4LLM_TIMING_MIN_MS", "100"))
# Time only the most frequent captured shapes (weighted by call count): decode tasks capture several KV lengths
# whose latencies differ little, and each timed case costs two modes x (candidate + reference).
MAX_TIMED_CASES = int(os.environ.get("LLM4LLM_TIMING_MAX_CASES", "2"))
_REFERENCE_CACHE: dict[tuple, Latency] = {}  # the reference is timed once per (task, case, mode) in this worker
MAX_REPS = 2000
WARMUP = 5
ROTATION = 4  # fresh input buffers cycled through in cold mode
GRAPH_CALLS = 20  # calls captured in one graph (graph timing)
GRAPH_REPLAYS = 20  # at least; as many as MIN_TIME_MS takes
SUSPECT_RATIO = 1.2  # graph time above this x the cold back-to-back time is flagged in the gate detail
MAX_COUNTER_NUMEL = 64  # integer tensors this small that a graph reads are positions/lengths, reset per replay
STATIC_KV_ADAPTERS = ("StaticLayer", "StaticSlidingWindowLayer")  # state with a device-side length
GRAPH_WARM_MS = 25.0  # replays before the timed ones, by time (a graph right after capture runs cold: below)

Args = tuple[dict, dict, dict, dict]
Prepare = Callable[..., tuple[tuple, Callable[[], None]]]  # (*Args) -> (call arguments, cleanup after the call)


def module_runner(task, module: torch.nn.Module) -> tuple[Callable, Prepare]:
    from kernels_runtime.boundary import adapter_by_name, rebuild_call

    spec = task.spec
    state_spec = spec.recipe.get("state") if spec.recipe else None
    adapter = adapter_by_name(state_spec["adapter"]) if state_spec else None

    def prepare(inputs, weights, state, static):
        if not spec.recipe:
            return ((tuple(inputs[n] for n in spec.input_names), {}), lambda: None)
        cache, restore = adapter.build(module, state, state_spec) if adapter else (None, lambda: None)
        return rebuild_call(spec.recipe, inputs, static, cache), restore

    def run(call):
        args, kwargs = call
        with torch.inference_mode():
            return module(*args, **kwargs)

    run.held = lambda: held_tensors(module)  # what a graph captured now reads from the module (time_graphs)
    return run, prepare


def held_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Tensors the module and its submodules hold as plain attributes (module-held state such as
    RecurrentGemma's `conv1d_state`, directly or in a list/tuple/dict), not parameters or buffers."""
    out: list[torch.Tensor] = []
    for m in module.modules():
        for name, value in vars(m).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                else (value,)
            out += [t for t in items if isinstance(t, torch.Tensor)]
    return out


def graph_reads(obj, depth: int = 4) -> list[torch.Tensor]:
    """Every tensor a prepared call reaches: its arguments (nested in tuples, lists, dicts) and the tensors held by
    the objects among them, an HF cache's layers included (DynamicLayer `keys`/`values`, StaticLayer
    `cumulative_length`), and module-held state (`held_tensors`). A graph captured on the call reads and writes them
    outside its own memory pool; the call may replace them (DynamicLayer.update concatenates into a new tensor), so
    a capture must hold them itself (`time_graphs`)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(value, left: int) -> None:
        if id(value) in seen or left < 0:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, torch.nn.Module):
            out.extend(t for t in held_tensors(value) if id(t) not in seen)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, left)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v, left)
        elif hasattr(value, "__dict__") and not isinstance(value, type) and not callable(value):
            for v in vars(value).values():  # a cache object and its layers
                walk(v, left - 1)

    walk(obj, depth)
    return out


def capture_keep(calls: list[tuple[Callable, object, bool]]) -> list[torch.Tensor]:
    """What a graph about to be captured from `calls` (side_calls' entries) reads that nothing else may keep once
    the capture has run: each call's `graph_reads` and each replica's module-held tensors (`run.held`)."""
    keep: list[torch.Tensor] = []
    for fn in {id(c[0]): c[0] for c in calls}.values():
        keep += getattr(fn, "held", list)()
    for _, call, _ in calls:
        keep += graph_reads(call)
    return keep


def counters_of(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, its value now) for the small integer tensors among a capture's reads: device-side positions that
    a call advances in place (StaticLayer.cumulative_length). Each replay advances them again, so graph timing puts
    them back before every replay: a static cache's length would otherwise run past its end (HF's
    StaticLayer.update then fails its index_copy_ bound check with a device-side assert)."""
    return [(t, t.detach().clone()) for t in tensors
            if not t.is_floating_point() and t.dtype != torch.bool and t.numel() <= MAX_COUNTER_NUMEL]


def module_call(task, device: torch.device) -> tuple[Callable, Prepare]:
    """(run, prepare) timing the task's module as the model calls it. prepare(inputs, weights, state, static) builds
    the call outside the timed region (a fresh cache holding `state`, the original (args, kwargs)) and returns it with
    the cleanup that restores module-held state; run(call) is the forward alone."""
    return module_runner(task, task.load_module(device).eval())


def patched_call(task, source: str, device: torch.device) -> tuple[Callable, Prepare, Callable[[], int]]:
    """(run, prepare, kernel_calls): the candidate installed in a copy of the task's module through
    kernels_runtime (phase decision, guards, boundary capture, state write-back: what it costs in the model), called
    like `module_call`. kernel_calls() counts the calls the kernel took (0: every call fell back)."""
    (run, prepare), kernel_calls = patched_replicas(task, source, device, 1)
    return run[0], prepare[0], kernel_calls


def module_replicas(task, device: torch.device, copies: int) -> tuple[list[Callable], list[Prepare]]:
    """`copies` of `module_call`, each module with its own weights: ([run], [prepare])."""
    runners = [module_call(task, device) for _ in range(copies)]
    return [r for r, _ in runners], [p for _, p in runners]


def patched_replicas(task, source: str, device: torch.device, copies: int
                     ) -> tuple[tuple[list[Callable], list[Prepare]], Callable[[], int]]:
    """`copies` modules of the task, each with its own weights, the candidate installed in all of them: ([run],
    [prepare]) and kernel_calls() over all of them."""
    import kernels_runtime
    from kernels_runtime.bundle import PatchBundle
    from kernels_runtime.patch import report_of
    from llm4llm.patchspec import task_patch_spec

    holder = torch.nn.Module()
    modules = [task.load_module(device).eval() for _ in range(copies)]
    for i, module in enumerate(modules):
        holder.add_module(f"m{i}", module)
    pspec = task_patch_spec(task.spec, "timing", 1.0, device.type)
    bundle = PatchBundle(name="verifier-timing")
    bundle.add_patch(pspec.model_copy(update={"instances": [f"m{i}" for i in range(copies)]}), source=source)
    kernels_runtime.apply(holder, bundle, strict=True)
    runners = [module_runner(task, module) for module in modules]

    def kernel_calls() -> int:
        return sum(sum(c["kernel"].values()) for c in report_of(holder).values())

    return ([r for r, _ in runners], [p for _, p in runners]), kernel_calls


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def l2_bytes(device: torch.device) -> int:
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)


def weight_replicas(nbytes: int, l2_bytes: int, calls: int = GRAPH_CALLS) -> int:
    """How many copies of a decode module the graph timing cycles through: in the model each layer's weights are
    evicted from L2 by the other layers' before its next step, so they come from HBM; the same weights called
    GRAPH_CALLS times in a row come from L2, which would time a layer faster in its task than inside the model's
    graph. Enough copies for twice the L2, at most one a call."""
    if nbytes <= 0 or l2_bytes <= 0:
        return 1
    return max(1, min(calls, math.ceil(2 * l2_bytes / nbytes)))


def latency(times_ms: list[float]) -> Latency:
    t = torch.tensor(times_ms, dtype=torch.float64)
    p20, p50, p80 = (float(x) for x in torch.quantile(t, torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)))
    return Latency(p20=p20, p50=p50, p80=p80, reps=len(times_ms))


def _clone_args(a: Args) -> Args:
    inputs, weights, state, static = a
    return ({n: t.clone() for n, t in inputs.items()}, weights, {n: t.clone() for n, t in state.items()},
            copy.deepcopy(static))


def time_call(fn: Callable, args: list[Args], mode: str, device: torch.device,
              prepare: Prepare | None = None, fresh_seed: int | None = None,
              sampler: "TimedSample | None" = None) -> Latency:
    """Time `fn(*args)` on the current stream; `args` are the case's draws, the captured one first (cold mode
    rotates over ROTATION buffers). With `prepare`, each call is `fn(call)` where `call, cleanup = prepare(*args)`
    ran before the timed region (cleanup after it).

    With `fresh_seed`, every call (warm-up included) gets fresh inputs and state, written into its buffers before
    the timed region by `fill_fresh` from seed `fresh_seed + i` (in_context: this is the producer op that warms
    them; cold: written before the L2 flush): no two calls see the same data, so a result cached from an earlier
    call is wrong. With `sampler`, each timed call's outputs are offered to it after its end event
    (`TimedSample.offer`), with the seed that reproduces its inputs. Off the GPU (a rehearsal of the timed calls
    for their outputs, `CandidateSession.time`) host clocks stand in for CUDA events: that latency means nothing."""
    pending: list = []  # with `prepare`: the prepared call of the next timed call, and its cleanup
    cuda = device.type == "cuda"
    template = args[0]
    stds = fresh_stds(template[0], template[2]) if fresh_seed is not None else None
    seeds = iter(range(fresh_seed or 0, (fresh_seed or 0) + MAX_REPS + WARMUP + 1))

    def refill(a: Args) -> int | None:
        if stds is None:
            return None
        seed = next(seeds)
        fill_fresh(a[0], a[2], template[0], template[2], stds, seed)
        return seed

    def before(a: Args) -> None:
        if prepare is not None:
            pending.append(prepare(*a))

    def call(a: Args):
        return fn(pending[-1][0]) if prepare is not None else fn(*a)

    def after() -> None:
        if prepare is not None:
            pending.pop()[1]()

    stream = torch.cuda.current_stream(device) if cuda else None
    if mode == "cold":
        sets = [_clone_args(args[i % len(args)]) for i in range(ROTATION)]
        flush = torch.empty(FLUSH_BYTES if cuda else 1 << 20, dtype=torch.uint8, device=device)
    else:
        sets = [_clone_args(args[0])]
        sources = _clone_args(args[0])
    with torch.no_grad():
        for i in range(WARMUP):
            refill(sets[i % len(sets)])
            before(sets[i % len(sets)])
            call(sets[i % len(sets)])
            after()
        _sync(device)
        times, events, spent, i = [], [], 0.0, 0
        while (i < MIN_REPS or spent < MIN_TIME_MS) and i < MAX_REPS:
            a = sets[i % len(sets)]
            seed = refill(a)  # in_context: the producer op; cold: before the flush evicts it
            if mode == "cold":
                flush.zero_()
            elif seed is None:
                for n, t in a[0].items():
                    t.copy_(sources[0][n])
            before(a)
            start, end = _event(cuda), _event(cuda)
            start.record(stream)
            out = call(a)
            end.record(stream)
            if sampler is not None:
                sampler.offer(seed, out)  # decided now, after the call returned
            del out
            after()
            events.append((start, end))
            i += 1
            if i % 10 == 0:
                end.synchronize()
                times += [s.elapsed_time(e) for s, e in events]
                spent, events = sum(times), []
        _sync(device)
        times += [s.elapsed_time(e) for s, e in events]
    return latency(times)


class _HostEvent:
    """torch.cuda.Event's interface on the host clock (the CPU rehearsal of the timed calls)."""

    def __init__(self):
        self.t = 0.0

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1e3


def _event(cuda: bool):
    return torch.cuda.Event(enable_timing=True) if cuda else _HostEvent()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------- fresh inputs, sampled outputs

SAMPLES_PER_RUN = 6  # timed calls whose outputs the parent checks, per timed (mode, case) of the candidate
RUN_SEEDS = 1 << 20  # seeds set aside per timing run (time_task); below 2**64 with a 31-bit fresh_seed << 32
SAMPLE_BYTES = 64 << 20  # at most this much output kept per run (at least one call): large prefill outputs
KEEP_AS_CAPTURED = ("mask", "position_ids", "cache_position")  # as gates.KEEP_AS_CAPTURED: not random data


def fresh_stds(inputs: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, float | None]:
    """Per tensor of the captured draw, the std of its fresh values (computed on the host, so the worker and the
    parent get the same float), or None where it is kept as captured (integers, bools, masks, positions,
    non-finite)."""
    out: dict[str, float | None] = {}
    for kind, d in (("inputs", inputs), ("state", state)):
        for name, t in d.items():
            if not t.is_floating_point() or any(k in name for k in KEEP_AS_CAPTURED):
                out[f"{kind}.{name}"] = None
                continue
            c = t.detach().float().cpu()
            if not bool(torch.isfinite(c).all()):
                out[f"{kind}.{name}"] = None
                continue
            std = float(c.std()) if c.numel() > 1 else 1.0
            out[f"{kind}.{name}"] = std if math.isfinite(std) and std > 0 else 1.0
    return out


def fill_fresh(inputs: dict[str, torch.Tensor], state: dict[str, torch.Tensor], t_inputs: dict[str, torch.Tensor],
               t_state: dict[str, torch.Tensor], stds: dict[str, float | None], seed: int) -> None:
    """Write one timed call's fresh inputs and state into `inputs`/`state` in place: floats are randn(seed) x the
    captured std, the rest copied from the captured draw (`t_inputs`/`t_state`). Deterministic in `seed` on a given
    device, so the parent rebuilds the very inputs of a sampled call (`fresh_draw`) without asking the worker."""
    tensors = [*t_inputs.values(), *t_state.values()]
    if not tensors:
        return
    gen = torch.Generator(device=tensors[0].device)
    gen.manual_seed(seed)
    for kind, dst, src in (("inputs", inputs, t_inputs), ("state", state, t_state)):
        for name in sorted(src):
            std, t = stds[f"{kind}.{name}"], src[name]
            if std is None:
                dst[name].copy_(t)
            else:
                dst[name].copy_(torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32).mul_(std))


def fresh_draw(inputs: dict[str, torch.Tensor], state: dict[str, torch.Tensor], seed: int
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The inputs and state `fill_fresh` wrote for `seed` from the captured draw (`inputs`, `state`), as new tensors."""
    new_in, new_state = {n: t.clone() for n, t in inputs.items()}, {n: t.clone() for n, t in state.items()}
    fill_fresh(new_in, new_state, inputs, state, fresh_stds(inputs, state), seed)
    return new_in, new_state


def flat_outputs(out, via: str) -> dict[str, torch.Tensor]:
    """A call's output tensors by name: the bare entry's dict as it named them; a module's forward output by its
    boundary names (kernels_runtime.boundary.flatten_outputs: the task's output names), or where that refuses the
    structure (dicts, ModelOutputs) as `module.<path>`."""
    if via == "entry":
        return {n: t for n, t in out.items() if isinstance(t, torch.Tensor)} if isinstance(out, dict) else {}
    from kernels_runtime.boundary import UnsupportedBoundary, flatten_outputs

    try:
        return flatten_outputs(out)[0]
    except UnsupportedBoundary:
        pass
    flat: dict[str, torch.Tensor] = {}

    def walk(v, path: str) -> None:
        if isinstance(v, torch.Tensor):
            flat[path] = v
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{path}.{k}")
        elif isinstance(v, (tuple, list)):
            for k, x in enumerate(v):
                walk(x, f"{path}.{k}")

    walk(out, "module")
    return flat


class TimedSample:
    """A uniform random sample (reservoir, SAMPLES_PER_RUN) of one timing run's calls: each offered call's outputs,
    copied, with the seed of its fresh inputs. Whether a call is kept, and whether a later one replaces it, is drawn
    from the OS's randomness (`secrets`) only after the call has returned, so a candidate cannot know while it runs
    whether this call will be checked; any timed call may be."""

    def __init__(self, case: int, mode: str, via: str, k: int = SAMPLES_PER_RUN):
        self.case, self.mode, self.via, self.k = case, mode, via, k
        self.seen = 0
        self.kept: list[tuple[int, int, dict[str, torch.Tensor]]] = []  # (call index, seed, outputs)

    def offer(self, seed: int | None, out) -> None:
        import secrets

        self.seen += 1
        if seed is None:
            return
        if len(self.kept) < self.k:
            slot = len(self.kept)
            self.kept.append(None)  # type: ignore[arg-type]
        else:
            slot = secrets.randbelow(self.seen)
            if slot >= self.k:
                return
        try:
            outs = {n: t.detach().clone() for n, t in flat_outputs(out, self.via).items()}
        except Exception:  # noqa: BLE001 - an output that cannot be copied is judged as missing by the parent
            outs = {}
        self.kept[slot] = (self.seen - 1, seed, outs)
        nbytes = sum(t.numel() * t.element_size() for t in outs.values())
        if nbytes and nbytes * self.k > SAMPLE_BYTES:  # fewer, still uniform over the calls offered from now on
            self.k = max(1, SAMPLE_BYTES // nbytes)
            del self.kept[self.k:]


def time_call_graph(fn: Callable, args: list[Args], device: torch.device,
                    prepare: Prepare | None = None) -> Latency:
    """GPU time per call under CUDA-graph replay: GRAPH_CALLS calls of one prepared draw captured in one graph
    (state advances call to call, as in decoding), replayed for GRAPH_WARM_MS, then timed for MIN_TIME_MS (at least
    GRAPH_REPLAYS replays), CUDA events around each replay. Raises when the call cannot be captured. The warm-up
    matters: replays right after capture run far slower than the call's steady state."""
    return time_graphs([([fn], [prepare])], args, device)[0]


def side_calls(fns: list[Callable], preps: list[Prepare | None], args: Args, fresh: bool, keep: list
               ) -> tuple[list[tuple[Callable, object, bool]], list[Callable[[], None]]]:
    """One side's calls for a graph of GRAPH_CALLS, cycling its replicas, and their cleanups: one prepared call
    per replica (decode: the state advances call to call), or with `fresh` one per call, each from its own copy of
    the draw (prefill: every prompt forward on a fresh cache). Entries are (fn, call, wrapped): wrapped calls go
    through a prepared module call, fn(call); bare entries get the draw, fn(*args). `keep` gets every copy."""
    calls, cleanups = [], []
    for i in range(GRAPH_CALLS if fresh else len(fns)):
        fn, prep = fns[i % len(fns)], preps[i % len(fns)]
        a = _clone_args(args)
        keep.append(a)
        if prep is None:
            calls.append((fn, a, False))
        else:
            call, cleanup = prep(*a)
            cleanups.append(cleanup)
            calls.append((fn, call, True))
    return calls, cleanups


def undo(cleanups: list[Callable[[], None]]) -> None:
    """Run preparations' cleanups last first: a module prepared several times (fresh calls) gets back the state it
    had before the first, not a state one of the later preparations saved."""
    for cleanup in reversed(cleanups):
        cleanup()


def time_graphs(sides: list[tuple[list[Callable], list[Prepare | None]]], args: list[Args],
                device: torch.device, fresh: bool = False, fresh_seed: int | None = None,
                samplers: list | None = None) -> list[Latency]:
    """`time_call_graph` for one or more sides (candidate, reference), each a list of replicas (fn, prepare): a
    side's graph cycles its GRAPH_CALLS calls through its replicas (`weight_replicas`), each replica's call prepared
    from its own copy of the draw. The sides' replays alternate, so a clock or host change during the measurement
    moves both (a reference timed once, minutes apart from its candidates, can be several times slower or faster
    than during theirs).

    A graph's first call reads the state its module held when the capture began. Where a call replaces
    module-held state (RecurrentGemma's blocks assign new tensors), nothing else keeps that tensor, and the next
    side's capture (torch.cuda.graph empties the allocator's cache) would hand its memory back to the driver, and
    the replay would fault with an illegal memory access (a decode candidate that writes its state back by
    assignment). The same holds for KV caches: the tensors of the one-layer cache that `KVLayerAdapter.build` makes
    live only in that cache, and the first captured call replaces them (DynamicLayer.update concatenates), so every
    attention-decode candidate would fault. `keep` holds every call's prepared arguments and, at its side's
    capture, everything the call reaches (`capture_keep`: cache layers, module-held state) until the timing is done.

    `fresh` (prefill tasks): every call of the graph gets its own freshly prepared cache (`side_calls`), prepared
    again after the warm-up, so the capture records a prompt forward on a fresh cache each time, as the model runs
    it. A capture freezes the Python path a call took: HF's Mamba/Mamba2 forwards continue from a cache that holds
    state (a second prefill on one cache gives other outputs), and that path would be the one timed.

    `fresh_seed`: before every replay (outside its events, like the counter resets) each call's inputs (not its
    state, which decoding advances) are rewritten with fresh values (`fill_fresh`), so no two replays compute the
    same thing. `samplers` (one per side, or None): after each timed replay one of its GRAPH_CALLS calls, drawn at
    random then, is offered with its outputs (the tensors the capture returned, which every replay rewrites) and the
    seed of its inputs; only meaningful for stateless tasks (time_task passes none otherwise)."""
    from kernels_runtime.graphs import CudaGraphBackend

    g = _SideGraphs(args, fresh, fresh_seed, samplers)
    try:
        for fns, preps in sides:
            g.add_side(fns, preps)
        backend = CudaGraphBackend()
        with torch.no_grad(), torch.cuda.device(device):
            for j, (fns, preps) in enumerate(sides):
                g.capture(backend, j, fns, preps)
            g.stream = torch.cuda.current_stream(device)
            lats = _time_replays(g, device)
            g.graphs.clear()
    finally:
        g.release()
    return lats


def _graph_runner(calls: list[tuple[Callable, object, bool]]) -> Callable[[], list]:
    """The function a side's graph captures: GRAPH_CALLS calls cycling through its prepared calls."""
    def run():
        outs = []
        for i in range(GRAPH_CALLS):
            fn, a, wrapped = calls[i % len(calls)]
            outs.append(fn(a) if wrapped else fn(*a))
        return outs  # the capture's outputs: each replay rewrites them
    return run


class _SideGraphs:
    """time_graphs' sides, from their prepared calls to their captured graphs, and one replay of them all: what
    each replay resets (counters), refills (fresh inputs) and samples, and everything kept alive until the end."""

    def __init__(self, args: list[Args], fresh: bool, fresh_seed: int | None, samplers: list | None):
        self.draw, self.fresh, self.samplers = args[0], fresh, samplers
        self.prepared, self.cleanups, self.keep, self.resets, self.side_args, self.captured = [], [], [], [], [], []
        self.graphs: list = []
        self.stream = None
        self.template = args[0][0]
        self.stds = fresh_stds(self.template, {}) if fresh_seed is not None else None
        self.seeds = iter(range(fresh_seed or 0, (fresh_seed or 0) + (1 << 40), GRAPH_CALLS))

    def add_side(self, fns: list[Callable], preps: list[Prepare | None]) -> None:
        n0 = len(self.keep)
        calls, side_cleanups = side_calls(fns, preps, self.draw, self.fresh, self.keep)
        self.prepared.append(calls)
        self.cleanups.append(side_cleanups)
        self.side_args.append(self.keep[n0:])

    def capture(self, backend, j: int, fns: list[Callable], preps: list[Prepare | None]) -> None:
        backend.warmup(_graph_runner(self.prepared[j]))  # GRAPH_CALLS >= WARMUP calls, every replica's among them
        if self.fresh:  # the warm-up ran every prompt forward on its cache: capture from fresh ones
            undo(self.cleanups[j])
            n0 = len(self.keep)
            self.prepared[j], self.cleanups[j] = side_calls(fns, preps, self.draw, self.fresh, self.keep)
            self.side_args[j] = self.keep[n0:]
        calls = self.prepared[j]
        reads = capture_keep(calls)  # the cache layers' tensors too: the capture replaces them
        self.keep.append(reads)
        self.resets.append(counters_of(reads))
        graph, outs = backend.record(_graph_runner(calls))
        self.graphs.append(graph)
        self.captured.append(outs)

    def replay_all(self, record: bool, sample: bool = False) -> list:
        """Every side's graph replayed once, in turn; with `record`, the (start, end) events around each replay."""
        import secrets

        marks = []
        for j, (graph, reset) in enumerate(zip(self.graphs, self.resets)):
            for t, start_value in reset:  # before the start event: not timed
                t.copy_(start_value)
            base = next(self.seeds) if self.stds is not None else None
            if base is not None:  # fresh inputs for every call of this replay, not timed either
                for n, a in enumerate(self.side_args[j]):
                    fill_fresh(a[0], {}, self.template, {}, self.stds, base + n)
            if record:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                graph.replay()
                end.record(self.stream)
                marks.append((start, end))
            else:
                graph.replay()
            sampler = self.samplers[j] if self.samplers and sample else None
            if sampler is not None and base is not None:
                i = secrets.randbelow(GRAPH_CALLS)  # which call of this replay: drawn after it ran
                sampler.offer(base + i % len(self.side_args[j]), self.captured[j][i])
        return marks

    def release(self) -> None:
        for side_cleanups in self.cleanups:
            undo(side_cleanups)
        self.keep.clear()
        self.captured.clear()


def _time_replays(g: _SideGraphs, device: torch.device) -> list[Latency]:
    """Per-call latency of each side: replays warm the GPU for GRAPH_WARM_MS, then timed rounds for MIN_TIME_MS (at
    least GRAPH_REPLAYS), both sized by one timed round."""
    g.replay_all(False)
    first = g.replay_all(True)
    torch.cuda.synchronize(device)
    one = max(sum(s.elapsed_time(e) for s, e in first), 1e-3)  # sizes warm-up and timing in time
    for _ in range(min(MAX_REPS, math.ceil(GRAPH_WARM_MS / one))):  # busy the GPU before timing it
        g.replay_all(False)
    rounds = [g.replay_all(True, sample=True)
              for _ in range(min(MAX_REPS, max(GRAPH_REPLAYS, math.ceil(MIN_TIME_MS / one))))]
    torch.cuda.synchronize(device)
    return [latency([r[j][0].elapsed_time(r[j][1]) / GRAPH_CALLS for r in rounds]) for j in range(len(g.graphs))]


def _weighted(lats: list[Latency], weights: list[float]) -> Latency:
    w = sum(weights)
    return Latency(p20=sum(x.p20 * k for x, k in zip(lats, weights)) / w,
                   p50=sum(x.p50 * k for x, k in zip(lats, weights)) / w,
                   p80=sum(x.p80 * k for x, k in zip(lats, weights)) / w,
                   reps=min(x.reps for x in lats))


def time_task(v: Verdict, task, entry: Callable, draws: list, device: torch.device, source: str | None = None,
              decode_graph: bool = False, prefill_graph: bool = False, fresh_seed: int | None = None,
              samples: list | None = None) -> None:
    """Fill `v`'s latencies and speedups: every case timed in both modes, aggregated weighted by its call count.
    The reference is the module's own forward (`module_call`), built and timed once per task in this worker (under
    graph replay: with each candidate, their replays alternating, `time_graphs`). With `source`,
    the candidate is timed as the model would run it, installed in the module through kernels_runtime
    (`patched_call`); where it cannot be installed, or every call fell back, its bare `entry` is timed and the gate
    detail says why.

    Back to back, every call (candidate's and reference's) runs on fresh inputs and state (`time_call`, seeds from
    `fresh_seed`, else from the OS); with `samples`, each candidate timing run appends its `TimedSample`, which the
    parent checks against the reference (`gates.check_timed_samples`). Under graph replay every replay's calls get
    fresh inputs, and on stateless tasks one call of each timed replay may be sampled the same way (`time_graphs`).
    """
    import secrets

    # each timing run (candidate or reference, mode, case) its own range of seeds: a graph run takes up to
    # (2 MAX_REPS + 2) replays x sides x GRAPH_CALLS of them, far below RUN_SEEDS, so no two calls share inputs
    base = (fresh_seed if fresh_seed is not None else secrets.randbits(31)) << 32
    timer = _TaskTimer(task, CandidateTimer(task, entry, source, device), draws, device, samples, base)
    # time_task runs only on a GPU (gates.run_gates). Prefill under graphs where the model replays its prompt
    # forward from a graph: timed back to back, a prefill task's time is mostly Triton's host launch cost, and the
    # search would rank prefill configs by host time the model never pays
    graph = (decode_graph and task.spec.phase == "decode") or (prefill_graph and task.spec.phase == "prefill")
    all_weights = [float(max(c.calls, 1)) for c in task.spec.cases]
    timed = sorted(range(len(task.cases)), key=lambda k: -all_weights[k])[:MAX_TIMED_CASES]
    weights = [all_weights[k] for k in timed]
    how_mode: dict[str, HowTimed] = {}
    for mode in ("cold", "in_context"):
        pairs = [timer.time_case(k, mode, graph and mode == "in_context", how_mode) for k in timed]
        _record_mode(v, mode, _weighted([c for c, _ in pairs], weights), _weighted([r for _, r in pairs], weights),
                     timer.candidate.how, how_mode.get(mode))


class CandidateTimer:
    """The candidate as time_task times it: installed in the module through kernels_runtime (`patched_call`), as
    the model would run it, or bare (its `entry`) where it cannot be installed or every patched call fell back to
    the original forward, from then on; `how` says which for the gate detail."""

    def __init__(self, task, entry: Callable, source: str | None, device: torch.device):
        self.entry, self.source = entry, source
        self.fn, self.prepare, self.kernel_calls, self.how = entry, None, None, "bare entry"
        if source is not None:
            try:
                self.fn, self.prepare, self.kernel_calls = patched_call(task, source, device)
                self.how = "through kernels_runtime's dispatch"
            except Exception as e:  # noqa: BLE001 - the bare entry is still timed
                self.how = f"bare entry (not installable in the module: {type(e).__name__}: {str(e)[:200]})"

    @property
    def installed(self) -> bool:
        return self.kernel_calls is not None

    def fall_back(self) -> None:
        """Every patched call fell back to the original forward: the bare entry is timed from now on."""
        self.fn, self.prepare, self.kernel_calls = self.entry, None, None
        self.how = "bare entry (every patched call fell back to the original forward)"

    def time(self, timer: Callable) -> Latency:
        """The candidate timed by `timer(fn, prepare, sample)`; if every patched call fell back, the original
        forward was timed: the bare entry is timed instead."""
        ran = self.kernel_calls() if self.installed else 0
        lat = timer(self.fn, self.prepare, True)
        if self.installed and self.kernel_calls() == ran:
            self.fall_back()
            lat = timer(self.entry, None, True)
        return lat


class _TaskTimer:
    """time_task's timing runs of one task: the candidate and the reference per case and mode, back to back or
    under graph replay, each run with its own range of seeds; module replicas and the reference built once."""

    def __init__(self, task, candidate: CandidateTimer, draws: list, device: torch.device, samples: list | None,
                 base: int):
        self.task, self.candidate, self.draws, self.device, self.samples = task, candidate, draws, device, samples
        self.base, self.runs = base, 0
        self.ref, self.ref_prepare = None, None
        self.replicas: dict = {}
        # under graphs only with prefill_graph: each prompt forward on a fresh cache. Decode on a static KV cache too:
        # a call advances its cache's length, and GRAPH_CALLS calls on one cache would write past a cache sized for
        # the workload's decode steps; each call on its own copy writes the captured position, as the model's step does
        adapter = ((task.spec.recipe or {}).get("state") or {}).get("adapter")
        self.fresh = task.spec.phase == "prefill" or adapter in STATIC_KV_ADAPTERS
        self.stateful = bool(((task.spec.recipe or {}).get("state")) or task.spec.state_names)

    def next_seed(self) -> int:
        self.runs += 1
        return self.base + self.runs * RUN_SEEDS

    def _keep(self, sampler: TimedSample | None) -> None:
        if sampler is not None:
            self.samples.append(sampler)

    def time_case(self, k: int, mode: str, graph: bool, how_mode: dict[str, HowTimed]) -> tuple[Latency, Latency]:
        """(candidate, reference) latencies of case k in `mode`: under graph replay where asked and capturable
        (`how_mode` records how), else back to back."""
        with contextlib.ExitStack() as on_device:  # a host-kept case's draws are on the GPU while it is timed
            mine = [on_device.enter_context(resident(d, self.device)) for d in self.draws if d.key[0] == k]
            args = [(d.inputs, d.weights, d.state, self.task.spec.static) for d in mine]
            return self._time_case(args, k, mode, graph, how_mode)

    def _time_case(self, args: list, k: int, mode: str, graph: bool,
                   how_mode: dict[str, HowTimed]) -> tuple[Latency, Latency]:
        if graph:
            try:
                c, r, detail = self.graph_pair(args, k)
                how_mode[mode] = HowTimed(True, f"GPU time under CUDA-graph replay, {detail}")
                return c, r
            except Exception as e:  # noqa: BLE001 - timed back to back instead, and said so
                failure = classify_exception(e, first_call=False)
                if failure.failure_class == FailureClass.GPU_FAULT:  # the CUDA context is gone: no fallback timing
                    failure.gate = f"timing_{mode}"
                    failure.message = f"under CUDA-graph timing: {failure.message}"
                    raise failure from None
                how_mode[mode] = HowTimed(False, f"back to back: graph capture failed: {type(e).__name__}: "
                                                 f"{str(e)[:150]}")
        timer = functools.partial(self.back_to_back, args, mode, k)
        try:
            c = self.candidate.time(timer)
        except Exception as e:  # noqa: BLE001
            failure = classify_exception(e, first_call=False)
            failure.gate = f"timing_{mode}"
            raise failure from None
        return c, self.reference(k, mode, timer)

    def back_to_back(self, args: list[Args], mode: str, k: int, fn: Callable, prep: Prepare | None,
                     sample: bool = False) -> Latency:
        sampler = TimedSample(k, mode, "module" if prep is not None else "entry") \
            if sample and self.samples is not None else None
        lat = time_call(fn, args, mode, self.device, prepare=prep, fresh_seed=self.next_seed(), sampler=sampler)
        self._keep(sampler)
        return lat

    def reference(self, k: int, label: str, timer: Callable) -> Latency:
        """The module's own forward, built once per task and timed once per (case, mode) in this worker."""
        key = (str(self.task.path), self.task.spec.task_id, k, label)
        if key not in _REFERENCE_CACHE:
            if self.ref is None:
                self.ref, self.ref_prepare = module_call(self.task, self.device)
            _REFERENCE_CACHE[key] = timer(self.ref, self.ref_prepare)
        return _REFERENCE_CACHE[key]

    def graph_sampler(self, k: int, via: str) -> TimedSample | None:
        """Graph replays are sampled on stateless tasks only: a decode step's state advances replay to replay, so
        the parent could not rebuild a sampled call's inputs from its seed."""
        if self.samples is None or self.stateful or self.task.cases[k].state:
            return None
        return TimedSample(k, "in_context (graph replay)", via)

    def _module_replicas(self, copies: int) -> tuple[list[Callable], list[Prepare]]:
        if copies not in self.replicas:  # built once per task and copy count, for every timed case
            self.replicas[copies] = module_replicas(self.task, self.device, copies)
        return self.replicas[copies]

    def graph_pair(self, args: list[Args], k: int) -> tuple[Latency, Latency, str]:
        """Candidate and reference under graph replay, their replays alternating, each cycling through as many
        copies of the module as `weight_replicas` asks (one when the bare entry is timed: it has its draw's one set
        of weights, and the reference then gets one too). Both on fresh inputs every replay; the candidate's
        replays sampled (`graph_sampler`)."""
        cand, task, device = self.candidate, self.task, self.device
        if "copies" not in self.replicas:
            self.replicas["copies"] = weight_replicas(weight_bytes(task.load_module("cpu")), l2_bytes(device))
        copies = self.replicas["copies"] if cand.installed else 1
        ref_side = self._module_replicas(copies)
        if cand.installed:
            if "candidate" not in self.replicas:
                self.replicas["candidate"] = patched_replicas(task, cand.source, device, copies)
            cand_side, calls = self.replicas["candidate"]
            ran = calls()
            sampler = self.graph_sampler(k, "module")
            c, r = time_graphs([cand_side, ref_side], args, device, fresh=self.fresh, fresh_seed=self.next_seed(),
                               samplers=[sampler, None])
            if calls() > ran:
                self._keep(sampler)
                return c, r, f"{copies} weight copies, alternating with the reference"
            cand.fall_back()
            copies = 1
            ref_side = self._module_replicas(1)
        sampler = self.graph_sampler(k, "entry" if cand.prepare is None else "module")
        c, r = time_graphs([([cand.fn], [cand.prepare]), ref_side], args, device, fresh=self.fresh,
                           fresh_seed=self.next_seed(), samplers=[sampler, None])
        self._keep(sampler)
        return c, r, f"{copies} weight copy, alternating with the reference"


@dataclass(frozen=True)
class HowTimed:
    """How a mode was timed where graph replay was asked for: `replayed` decides the suspect check, `text` is shown
    in the timing gate's detail."""

    replayed: bool
    text: str


def _record_mode(v: Verdict, mode: str, c: Latency, r: Latency, how: str, how_mode: HowTimed | None) -> None:
    """One mode's weighted latencies and speedup on `v`, and its gate; graph replay slower than the candidate's
    cold back-to-back time is flagged as suspect."""
    speedup = r.p50 / c.p50 if c.p50 > 0 else None
    setattr(v, f"candidate_{mode}", c)
    setattr(v, f"reference_{mode}", r)
    setattr(v, f"speedup_{mode}", speedup)
    ratio = f"{speedup:.3f}x" if speedup is not None else "no speedup (zero candidate time)"
    suspect = ""
    cold = v.candidate_cold
    if how_mode is not None and how_mode.replayed and cold is not None and c.p50 > SUSPECT_RATIO * cold.p50:
        # a call back to back (host gaps, L2 flushed) bounds its GPU time from above: replay should not exceed it
        suspect = f"; suspect: above the candidate's back-to-back cold p50 {cold.p50:.4f} ms"
    v.gates.append(GateResult(name=f"timing_{mode}", passed=True,
                              detail=f"p50 {c.p50:.4f} ms ({how}"
                                     + (f"; {how_mode.text}" if how_mode is not None else "")
                                     + f") vs reference {r.p50:.4f} ms: {ratio}{suspect}"))
