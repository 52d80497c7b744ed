"""End-to-end evaluation: eager vs patched vs torch.compile (and baselines) through the user's own script, in one
process, interleaved.

Timing is wall clock around the script's `run`, synchronized on the GPU: it includes HF generate's host time, which
is what a user waits for. Prefill is a run with one new token; a decode step is the rest divided by the
remaining steps, taken round by round (the median and p20-p80 of those). `--batch-sizes/--prompt-lens` measure the
same at several (batch, prompt) points, one after another, with the decode throughput (batch x decoded tokens / decode
time) and the step's floor: the weights and the KV cache a step of that batch reads, at the measured copy bandwidth.

Every variant is set up once on its own copy of the model (the copies share the weights: only module objects are
duplicated), then the variants are timed in rounds, one run of each per round in a rotated order (A B C, B C A, ...).
Eager drifts by tens of percent between calls on one host; timed back to back, one variant after the other, such a
drift reads as a speedup or a slowdown. Each variant's ratio to eager (and to torch.compile) is taken round by round,
so both sides of a ratio saw the same drift, and is reported as the median with its p20-p80 spread.
Each timed run also records the main thread's CPU time (`time.thread_time`, which a descheduled or preempted thread
does not accrue) and the ratio to eager is taken on it too (`vs_eager_cpu`): where a host deschedules or preempts
the thread, that ratio leaves the lost time out, which the wall-clock ratio carries. On a dedicated GPU host the
two agree to the third decimal: the thread runs throughout (CUDA's synchronize spins) and eager's
spread there (up to 2.5x within a call) is the same work running slower, which only pairing the rounds removes.
Python's garbage is collected before every timed run, so a collection one variant's garbage triggers is not charged
to the next variant.
On the CPU the numbers are reported but marked, and never used to accept anything.
"""
from __future__ import annotations

import copy
import gc
import inspect
import itertools
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from llm4llm.e2e_result import E2EResult

VARIANTS = ("eager", "patched", "torch_compile")  # the compiled baseline last: its compile is the slowest
# Also measurable on request: the decode step replayed from CUDA graphs (kernels_runtime.graphs), unpatched and patched.
GRAPH_VARIANTS = ("eager_graphs", "patched_graphs")
# Baselines a user could pick instead of us: Liger-Kernel's model patch (`apply_liger_kernel_to_<model_type>`).
BASELINE_VARIANTS = ("liger",)
ALL_VARIANTS = VARIANTS + GRAPH_VARIANTS + BASELINE_VARIANTS
DEFAULT_ROUNDS = 7


TABLE_COLUMNS = ("variant", "prefill_ms", "decode_ms_per_token", "total_ms", "total_range_ms", "vs_eager",
                 "vs_eager_cpu", "vs_compile", "tokens_per_s", "gpu_step_ms", "hbm_floor_ms", "peak_mem_mb",
                 "compile_s", "notes")


def row_dicts(rows) -> list[dict]:
    """e2e rows as dicts, where a table is made of them: a typed row (llm4llm.stages.evaluate.E2ERow, what the
    evaluate stage returns) as its fields, a stored `e2e_results` row as it is."""
    return [r if isinstance(r, dict) else r.model_dump() for r in rows]


def table_rows(rows: list) -> list[dict]:
    """e2e rows (E2ERow, or `E2EResult.to_row` plus run fields) as the CLI table and the Prefect artifact show
    them: the medians, the total's min-max over the timed runs and each ratio as `median (p20-p80)`."""
    def cell(r: dict, k: str):
        if k == "total_range_ms":
            return spread(r.get("total_samples_ms"))
        if k in ("vs_eager", "vs_eager_cpu", "vs_compile"):
            return ratio_cell(r.get(k), r.get(f"{k}_p20"), r.get(f"{k}_p80"))
        return r.get(k)

    return [{k: cell(r, k) for k in TABLE_COLUMNS} for r in row_dicts(rows)]


POINT_COLUMNS = ("batch_size", "prompt_len", "variant", "ms_per_step", "tokens_per_s", "vs_compile", "vs_eager",
                 "x_floor")


def point_rows(rows: list) -> list[dict]:
    """e2e rows (E2ERow, or stored rows) at several (batch, prompt) points as `evaluate --batch-sizes/--prompt-lens`
    prints them, point by point: the decode step's ms as `median (p20-p80)` over the rounds, the decode throughput
    (batch x decoded tokens / decode time), each ratio as `median (p20-p80)`, and the step's GPU time over its floor."""
    def cell(r: dict, k: str):
        if k == "ms_per_step":
            m, lo, hi = (r.get(c) for c in ("decode_ms_per_token", "decode_ms_p20", "decode_ms_p80"))
            return "" if m is None else _num(m) + (f" ({_num(lo)}-{_num(hi)})" if lo is not None and hi is not None
                                                  else "")
        if k == "tokens_per_s":
            return "" if r.get("decode_tokens_per_s") is None else f"{r['decode_tokens_per_s']:.0f}"
        if k in ("vs_eager", "vs_compile"):
            return ratio_cell(r.get(k), r.get(f"{k}_p20"), r.get(f"{k}_p80"))
        if k == "x_floor":
            step, floor = r.get("gpu_step_ms"), r.get("hbm_floor_ms")
            return f"{step / floor:.2f}x" if step and floor else ""
        return r.get(k)

    rows = row_dicts(rows)
    order = sorted(range(len(rows)), key=lambda i: (rows[i].get("prompt_len") or 0, rows[i].get("batch_size") or 0))
    return [{k: cell(rows[i], k) for k in POINT_COLUMNS} for i in order]


def _num(ms: float) -> str:
    """A time in 3 to 4 digits whatever its scale (a CPU step takes seconds, a GPU step milliseconds)."""
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def ratio_cell(median: float | None, p20: float | None, p80: float | None) -> str:
    if median is None:
        return ""
    return f"{median:.2f}x" + (f" ({p20:.2f}-{p80:.2f})" if p20 is not None and p80 is not None else "")


def spread(samples: list[float] | str | None) -> str:
    """`min-max` of a row's timed runs ('' without any), as tables show it beside the median. A DuckDB row holds
    them as JSON text."""
    if isinstance(samples, str):
        samples = json.loads(samples)
    return f"{min(samples):.1f}-{max(samples):.1f}" if samples else ""


def quantile(xs: list[float], q: float) -> float:
    """Linear-interpolated quantile (q in [0, 1]) of a non-empty list."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def paired_ratios(base: list[float], other: list[float]) -> tuple[float, float, float] | None:
    """Median, p20 and p80 of base[i] / other[i] over the rounds both measured."""
    rs = [b / o for b, o in zip(base, other) if b and o]
    if not rs:
        return None
    return statistics.median(rs), quantile(rs, 0.2), quantile(rs, 0.8)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], device: str) -> tuple[float, float]:
    """Wall ms and the calling thread's CPU ms of fn(), synchronized on the GPU, after a garbage collection."""
    gc.collect()
    _sync(device)
    t0, c0 = time.perf_counter(), time.thread_time()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3


def accepts_generate_kwargs(run_fn: Callable) -> bool:
    params = inspect.signature(run_fn).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def measure(model, workload, batch, run_fn, *, repeats: int = 3, warmup: int = 1, label: str = "eager",
            split: bool = True, **gen_kwargs) -> E2EResult:
    """Median over `repeats` of the full run and of a one-token run (prefill), one variant alone. split=False: the
    full run only (prefill_ms and decode_ms_per_token None), warmed up with two of them instead of one full and one
    prefill run (acceptance wants the total alone: half the runs; a prefill graph is still captured before the timed
    runs)."""
    slot = _Slot(label, model, gen_kwargs)
    t0 = time.perf_counter()
    for _ in range(max(warmup, 1)):
        slot.run_full(run_fn, workload, batch)
        slot.run_prefill(run_fn, workload, batch) if split else slot.run_full(run_fn, workload, batch)
    compile_s = time.perf_counter() - t0 if label == "torch_compile" else None
    if workload.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    totals = [slot.run_full(run_fn, workload, batch) for _ in range(repeats)]
    prefills = [slot.run_prefill(run_fn, workload, batch) for _ in range(repeats)] if split else []
    return _result(label, workload, totals, prefills, compile_s, _peak(workload.device))


def _peak(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None


def _result(label, workload, totals, prefills, compile_s, peak, notes: str = "") -> E2EResult:
    total = statistics.median(totals)
    pre = statistics.median(prefills) if prefills else None
    steps = max(workload.decode_len - 1, 1)
    # a decode step per round (a full run less the prefill run beside it), so a noisy host's median and its spread
    # come from the same pairs
    per_round = [max(t - p, 0.0) / steps for t, p in zip(totals, prefills)]
    decode = statistics.median(per_round) if per_round else None
    new_tokens = workload.batch_size * workload.decode_len
    res = E2EResult(variant=label, prefill_ms=pre, decode_ms_per_token=decode, total_ms=total,
                    tokens_per_s=new_tokens / (total / 1e3), peak_mem_mb=peak, compile_s=compile_s,
                    repeats=len(totals), notes=notes, total_samples_ms=totals, prefill_samples_ms=prefills,
                    batch_size=workload.batch_size, prompt_len=workload.prompt_len)
    if per_round:
        res.decode_ms_p20, res.decode_ms_p80 = quantile(per_round, 0.2), quantile(per_round, 0.8)
    if decode:
        res.decode_tokens_per_s = workload.batch_size / (decode / 1e3)
    return res


# ------------------------------------------------------------------------------------------------- variant slots
@dataclass
class _Slot:
    """One variant, set up on its own model copy: how to run it, and the state it swaps in around each run."""

    variant: str
    model: Any
    kwargs: dict = field(default_factory=dict)
    enter: Callable[[], None] = lambda: None
    exit: Callable[[], None] = lambda: None
    teardown: Callable[[], None] = lambda: None
    notes: Callable[[], str] = lambda: ""
    compile_s: float | None = None
    totals: list[float] = field(default_factory=list)
    prefills: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # CPU ms of the main thread, one per entry of totals
    last_cpu_ms: float = 0.0

    def _run(self, run_fn, workload, batch) -> float:
        from llm4llm.workload import call_script

        self.enter()
        try:
            wall, self.last_cpu_ms = _timed(lambda: call_script(run_fn, self.model, workload, batch, **self.kwargs),
                                            workload.device)
            return wall
        finally:
            self.exit()

    def run_full(self, run_fn, workload, batch) -> float:
        return self._run(run_fn, workload, batch)

    def time_full(self, run_fn, workload, batch) -> None:
        """One timed full run, kept: its wall time in totals, its CPU time in cpu."""
        self.totals.append(self.run_full(run_fn, workload, batch))
        self.cpu.append(self.last_cpu_ms)

    def run_prefill(self, run_fn, workload, batch) -> float:
        return self._run(run_fn, workload.model_copy(update={"decode_len": 1}), batch)

    def new_point(self) -> None:
        """Forget the measurements of the previous point; the set-up variant (its copy, patches, graphs, compile
        mode) carries over."""
        self.totals, self.prefills, self.cpu, self.compile_s = [], [], [], None


def clone_sharing_weights(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters and buffers are the original's tensors (no weight memory is added):
    patches, decode graphs and compiled calls installed on the copy leave the original as it was."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


class _Skip(Exception):
    """A variant that cannot run here (no GPU for graphs, no bundle, no Liger): its row says why."""


def _setup(variant: str, model, clean, wl, script, bundle) -> _Slot:
    """The slot of `variant`. `model` is the base model (eager and torch.compile share it: compiling is a generate
    argument); `clean()` returns a fresh weight-sharing copy for the variants that change modules."""
    import kernels_runtime

    if variant == "eager":
        return _Slot("eager", model)
    if variant == "torch_compile":
        if not accepts_generate_kwargs(script.run):
            raise _Skip("skipped: the script's run() takes no generate kwargs")
        return _Slot("torch_compile", model, {"cache_implementation": "static"})
    if variant == "liger":
        return _liger_slot(clean(), wl)
    graphs = variant.endswith("_graphs")
    if graphs and not wl.device.startswith("cuda"):
        raise _Skip("skipped: CUDA graphs need a CUDA device")
    # A graph needs the cache at static addresses: the graph variants generate with transformers' static KV cache
    # (its auto-compile off, so the graph is ours); Mamba/Mamba2 keep their LinearAttentionLayer either way.
    how = "static cache, compile off; " if graphs else ""
    m = clean()
    if variant == "eager_graphs":
        g = kernels_runtime.enable_decode_graphs(m, static_cache=True)
        return _Slot(variant, m, teardown=lambda: kernels_runtime.disable_decode_graphs(m),
                     notes=lambda: f"{how}decode graphs: {g.stats()}")
    if bundle is None:
        raise _Skip("skipped: no bundle")
    report = kernels_runtime.apply(m, bundle, decode_graphs=graphs, static_cache=graphs)

    def notes() -> str:
        g = kernels_runtime.decode_graphs_of(m)
        return how + str(report).replace("\n", "; ") + (f"; graphs {g.stats()}" if g is not None else "")

    return _Slot(variant, m, teardown=lambda: kernels_runtime.revert(m), notes=notes)


def _liger_slot(m, wl) -> _Slot:
    """Liger-Kernel's patch of this architecture on a copy. Liger patches the instance's modules and also rebinds
    names in transformers' modeling module (the rotary function, module classes): those are swapped in around each
    of this variant's runs only, so every other variant runs transformers as shipped."""
    try:
        from liger_kernel.transformers import monkey_patch
    except ImportError as e:
        raise _Skip(f"skipped: liger-kernel is not installed ({e})") from e
    fn = monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN.get(m.config.model_type)
    if fn is None:
        raise _Skip(f"skipped: liger-kernel has no patch for model_type {m.config.model_type!r}")
    import importlib

    mod = importlib.import_module(type(m).__module__)
    before = _namespace(mod)
    # inference: no loss to fuse (the cross-entropy patches replace the CausalLM forward for training)
    kwargs = {k: False for k in ("cross_entropy", "fused_linear_cross_entropy")
              if k in inspect.signature(fn).parameters}
    fn(model=m, **kwargs)
    after = _namespace(mod)
    _restore(mod, before)
    changed = [k for k in after if after[k] is not before.get(k)]
    return _Slot("liger", m, enter=lambda: _restore(mod, after), exit=lambda: _restore(mod, before),
                 notes=lambda: f"liger-kernel {_version('liger-kernel')} ({fn.__name__}); swapped per run: "
                               f"{', '.join(sorted(changed)) or 'nothing'}")


def _namespace(mod) -> dict:
    """The module's globals and the attributes of the classes it defines (what a monkey patch rebinds)."""
    out = {}
    for name, v in vars(mod).items():
        out[name] = v
        if isinstance(v, type) and v.__module__ == mod.__name__:
            for attr, a in list(vars(v).items()):
                out[(name, attr)] = a
    return out


def _restore(mod, ns: dict) -> None:
    for key, v in ns.items():
        if isinstance(key, tuple):
            cls = ns.get(key[0])
            if getattr(cls, "__dict__", {}).get(key[1], _MISSING) is not v:
                setattr(cls, key[1], v)
        elif vars(mod).get(key, _MISSING) is not v:
            setattr(mod, key, v)


_MISSING = object()


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


# ---------------------------------------------------------------------------------------------------- evaluation
def evaluate_workload(workload_path: str, *, bundle: str | None = None, variants: tuple[str, ...] = VARIANTS,
                      repeats: int = DEFAULT_ROUNDS, results_path: str | None = None,
                      max_s: float | None = None, deadline: float | None = None,
                      batch_sizes: tuple[int, ...] | None = None,
                      prompt_lens: tuple[int, ...] | None = None) -> list[E2EResult]:
    """Build the model once through the script, set each variant up on its own weight-sharing copy, and time the
    variants in `repeats` interleaved rounds, in this process, at each point of batch_sizes x prompt_lens (default:
    the workload's own batch_size and prompt_len; the script builds each point's inputs, padded as the workload's
    regime says). Returns one row per variant per point, point by point.

    Round 0 of a point runs each variant right after its warm-up at that point (so a variant that dies in its
    warm-up still leaves the rows of those before it); rounds 1.. rotate the order. Each variant is set up once, at
    the first point; one that cannot be set up has a row saying why at every point. results_path: after every round
    each variant's row (with the GPU and library versions) is appended there as a JSON line, the newest line of a
    (variant, batch_size, prompt_len) replacing its earlier ones, so a run stopped midway keeps what it measured.

    max_s: a time budget for the interleaved rounds of all points (from the end of round 0), shared evenly by the
    points still to run: a round starts only if one more like the slowest so far still fits, and the last one taken
    records the decode step's GPU time, so a run on a slow host ends with fewer rounds instead of being killed before
    its floor and step time (as a qwen3-4b optimize once was). At least one interleaved round runs per point when
    repeats > 1. deadline: Unix time by which the rounds end (the run's time budget): it shortens max_s to what is
    left, and a point after the first is not started when one as long as the longest so far would end past it (its
    rows say so; a qwen3-4b run's second point, batch 32 with its own compile, once overran an 8-minute budget by
    77 s): a run overruns its budget by at most the first point's warm-ups."""
    from llm4llm.workload import call_script, load_script, load_workload

    unknown = [v for v in variants if v not in ALL_VARIANTS]
    if unknown:  # before anything is built or measured
        raise ValueError(f"variant: expected one of {ALL_VARIANTS}, got {unknown}")
    if repeats < 1:
        raise ValueError(f"repeats: expected at least 1 round, got {repeats}")
    wl = load_workload(workload_path)
    points = at_points(wl, batch_sizes, prompt_lens)
    script = load_script(wl)
    model = call_script(script.build, wl)
    copies = iter([clone_sharing_weights(model) for v in variants if v not in ("eager", "torch_compile")])
    emit = (lambda r: _append_row(results_path, r, wl.device)) if results_path else (lambda r: None)
    vs = _Variants(model, lambda: next(copies), script, bundle, emit, max_s, deadline)
    results: list[E2EResult] = []
    took = 0.0  # the longest point so far, seconds: what a later one is expected to take (its warm-ups recompile)
    try:
        for k, point in enumerate(points):
            if k and deadline is not None and time.time() + took > deadline:
                late = [_failed_row(v, point, PAST_DEADLINE) for v in variants]
                results += [vs.emit(r) or r for r in late]
                continue
            t0 = time.time()
            results += _evaluate_point(vs, variants, point, repeats, len(points) - k)
            took = max(took, time.time() - t0)
        return results
    finally:
        for slot in vs.slots.values():
            slot.teardown()


PAST_DEADLINE = "not measured: this point would end past the run's time budget (raise --time-budget or evaluate " \
                "it with `llm4llm evaluate --batch-sizes`)"


def at_points(wl, batch_sizes: tuple[int, ...] | None = None, prompt_lens: tuple[int, ...] | None = None) -> list:
    """The workload at each (batch size, prompt length) of batch_sizes x prompt_lens, prompt length by prompt length
    (an axis not given: the workload's own value). ValueError (one line) for a size below 1 or a prompt that leaves
    the model's positions no room for decode_len tokens. A point may lie outside the workload's regime: a bundle
    falls back there, which is worth measuring too (the row says so)."""
    from llm4llm.workload import max_positions

    bs, ps = tuple(batch_sizes or (wl.batch_size,)), tuple(prompt_lens or (wl.prompt_len,))
    for name, sizes in (("batch_sizes", bs), ("prompt_lens", ps)):
        bad = [n for n in sizes if isinstance(n, bool) or not isinstance(n, int) or n < 1]
        if bad:
            raise ValueError(f"{name}: expected whole numbers >= 1, got {bad}")
    long = too_long(wl, ps)
    if long:
        raise ValueError(f"prompt_lens: expected prompt_len + decode_len ({wl.decode_len}) within the model's "
                         f"max_position_embeddings ({max_positions(wl.model)}), got {long}")
    return [wl.model_copy(update={"batch_size": b, "prompt_len": p}) for p in dict.fromkeys(ps)
            for b in dict.fromkeys(bs)]


def too_long(wl, prompt_lens: tuple[int, ...]) -> list[int]:
    """The prompt lengths that leave the model's positions no room for the workload's decode_len tokens."""
    from llm4llm.workload import max_positions

    limit = max_positions(wl.model)
    return [p for p in prompt_lens if limit is not None and p + wl.decode_len > limit]


@dataclass
class _Variants:
    """The variants of one evaluation: each set up once on its own copy, then measured point after point."""

    model: Any
    clean: Callable[[], Any]  # a fresh weight-sharing copy, one per variant that changes modules
    script: Any
    bundle: str | None
    emit: Callable[[E2EResult], Any]
    max_s: float | None
    deadline: float | None
    slots: dict[str, _Slot] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)  # a variant that could not be set up: why (its rows' notes)
    spent_s: float = 0.0  # in interleaved rounds so far
    gbps: float | None = None  # the copy bandwidth, measured once

    def start(self, variant: str, wl, batch) -> _Slot | E2EResult:
        """Round 0 of `variant` at this point (set up at its first point, warmed up, timed once), or its row
        saying why it cannot run here."""
        if variant in self.broken:
            return _failed_row(variant, wl, self.broken[variant])
        try:
            slot = self.slots.get(variant)
            if slot is None:
                slot = self.slots[variant] = _setup(variant, self.model, self.clean, wl, self.script, self.bundle)
            slot.new_point()
            _warm(slot, self.script.run, wl, batch)
            slot.time_full(self.script.run, wl, batch)
            slot.prefills.append(slot.run_prefill(self.script.run, wl, batch))
            return slot
        except _Skip as e:
            self.broken[variant] = str(e)
            return _failed_row(variant, wl, str(e))
        except Exception as e:  # one variant failing (a static cache the architecture lacks, an OOM) is a row too
            note = f"failed: {_first_line(e, 700)}"
            if variant not in self.slots:
                self.broken[variant] = note
            if wl.device.startswith("cuda"):
                torch.cuda.empty_cache()
            return _failed_row(variant, wl, note)

    def budget(self, points_left: int) -> float | None:
        """This point's share of what is left of max_s and of the deadline."""
        left = None if self.max_s is None else self.max_s - self.spent_s
        if self.deadline is not None:
            to_deadline = self.deadline - time.time()
            left = to_deadline if left is None else min(left, to_deadline)
        return None if left is None else max(left, 0.0) / points_left

    def floor(self, wl, batch) -> tuple[float, float] | None:
        try:
            if wl.device.startswith("cuda") and self.gbps is None:
                self.gbps = copy_bandwidth_gbps(wl.device)
            return _hbm_floor(self.model, wl.device, decode_kv_tokens(batch, wl), self.gbps)
        except Exception as e:  # noqa: BLE001 - the rounds are measured: a failing extra loses only the extra
            print(f"evaluate: no HBM floor ({_first_line(e)})")
            return None


def _failed_row(variant: str, wl, notes: str) -> E2EResult:
    return E2EResult(variant=variant, notes=notes, batch_size=wl.batch_size, prompt_len=wl.prompt_len)


def _evaluate_point(vs: _Variants, variants: tuple[str, ...], wl, repeats: int, points_left: int) -> list[E2EResult]:
    """Every variant at the point `wl` describes: round 0, the interleaved rounds, then each variant's row."""
    from llm4llm.workload import call_script

    batch = call_script(vs.script.inputs, wl)
    live: dict[str, _Slot] = {}
    failed: dict[str, E2EResult] = {}
    for variant in variants:
        out = vs.start(variant, wl, batch)
        if isinstance(out, E2EResult):
            failed[variant] = out
            vs.emit(out)
        else:
            live[variant] = out
            vs.emit(_slot_result(out, wl, live))
    if wl.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    _rounds(list(live.values()), repeats, vs.budget(points_left), vs.script.run, wl, batch,
            lambda: [vs.emit(_slot_result(slot, wl, live)) for slot in live.values()])
    vs.spent_s += time.perf_counter() - t0
    floor = vs.floor(wl, batch) if live else None
    outside = wl.regime.contains(wl.batch_size, wl.prompt_len) if wl.regime is not None else None
    results = []
    for variant in variants:
        res = failed.get(variant) or _slot_result(live[variant], wl, live, _peak(wl.device), floor)
        if outside:
            res.notes = f"outside the regime ({outside}); {res.notes}"[:500]
        results.append(res)
        if variant in live:
            vs.emit(res)
    return results


def _rounds(order: list[_Slot], repeats: int, max_s: float | None, run_fn, wl, batch,
            emit_all: Callable[[], Any]) -> None:
    """Interleaved rounds 1..repeats-1 (the order rotated each round; prefills in reverse), every variant's row
    emitted after each round but the last; the last records the decode steps' GPU time (_record_steps). With max_s,
    the round that would be the last to fit the budget (at the slowest round's pace so far) is made the last."""
    # the pace before any interleaved round: round 0's timed runs (a full run and a prefill of each variant)
    t0, slowest = time.perf_counter(), sum(s.totals[-1] + s.prefills[-1] for s in order if s.totals) / 1e3
    for r in range(1, repeats):
        last = r == repeats - 1
        if max_s is not None:
            last = last or time.perf_counter() - t0 + 2 * slowest > max_s
        if last:
            _record_steps(order)
        started = time.perf_counter()
        k = r % len(order) if order else 0
        turn = order[k:] + order[:k]
        for slot in turn:
            slot.time_full(run_fn, wl, batch)
        for slot in reversed(turn):
            slot.prefills.append(slot.run_prefill(run_fn, wl, batch))
        slowest = max(slowest, time.perf_counter() - started)
        if last:
            return
        emit_all()


def _warm(slot: _Slot, run_fn, wl, batch) -> None:
    """Two full runs (the second captures a prompt graph) and a prefill; torch.compile's compile is timed here. A
    compile that fails in HF's default mode is retried without CUDA graphs (see _compile_fallback)."""
    t0 = time.perf_counter()
    try:
        for _ in range(2):
            slot.run_full(run_fn, wl, batch)
        slot.run_prefill(run_fn, wl, batch)
    except Exception as e:
        if slot.variant != "torch_compile":
            raise
        first = _compile_fallback(slot, e)
        t0 = time.perf_counter()
        try:
            for _ in range(2):
                slot.run_full(run_fn, wl, batch)
            slot.run_prefill(run_fn, wl, batch)
        except Exception as e2:  # the mode=default error first: it is the new one
            raise RuntimeError(f"mode=default: {_first_line(e2)}; mode=reduce-overhead: {first}") from e2
    if slot.variant == "torch_compile":
        slot.compile_s = time.perf_counter() - t0


def _compile_fallback(slot: _Slot, first_error: Exception) -> str:
    # HF compiles the static-cache decode step with mode="reduce-overhead" (CUDA graph trees); a model that keeps
    # per-step state on its modules reads a graph output a later replay overwrote ("accessing tensor output of
    # CUDAGraphs that has been overwritten", RecurrentGemma). Inductor without CUDA graphs is what a user tries next;
    # the row says which mode it is. The failed run left graph outputs as the state modules keep on themselves, so
    # the state is dropped first and the next prefill builds it afresh.
    from transformers import CompileConfig

    from kernels_runtime.boundary import clear_module_state

    first = _first_line(first_error)
    torch._dynamo.reset()
    clear_module_state(slot.model)
    slot.kwargs = {"cache_implementation": "static", "compile_config": CompileConfig(mode="default")}
    slot.notes = lambda: f"compile mode=default (reduce-overhead failed: {first})"
    return first


def _variant(variant, model, wl, batch, script, bundle, repeats) -> E2EResult:
    """One variant alone on `model` (set up, warmed up, `repeats` timed runs), not interleaved."""
    slot = _setup(variant, model, lambda: clone_sharing_weights(model), wl, script, bundle)
    try:
        _warm(slot, script.run, wl, batch)
        for _ in range(repeats):
            slot.time_full(script.run, wl, batch)
            slot.prefills.append(slot.run_prefill(script.run, wl, batch))
        return _slot_result(slot, wl, {})
    finally:
        slot.teardown()


def _slot_result(slot: _Slot, wl, slots: dict[str, _Slot], peak: float | None = None,
                 floor: tuple[float, float] | None = None) -> E2EResult:
    res = _result(slot.variant, wl, slot.totals, slot.prefills, slot.compile_s, peak, slot.notes()[:500])
    res.cpu_samples_ms = slot.cpu
    eager, compiled = slots.get("eager"), slots.get("torch_compile")
    for name, base, of in (("vs_eager", eager, "totals"), ("vs_eager_cpu", eager, "cpu"),
                           ("vs_compile", compiled, "totals")):
        if base is not None and base is not slot:
            a, b = getattr(base, of), getattr(slot, of)
            # round 0 ran each variant right after its own warm-up, not interleaved: ratios pair rounds 1.. only
            skip = 1 if min(len(a), len(b)) > 1 else 0
            pr = paired_ratios(a[skip:], b[skip:])
            if pr is not None:
                setattr(res, name, pr[0]), setattr(res, f"{name}_p20", pr[1]), setattr(res, f"{name}_p80", pr[2])
    if floor is not None:
        res.hbm_floor_ms, res.copy_gbps = floor
        try:
            step = _graph_step_ms(slot.model)
        except Exception as e:  # noqa: BLE001 - as above
            step, res.notes = None, f"{res.notes}; no GPU step time ({_first_line(e)})"[:500]
        if step is not None:
            res.gpu_step_ms = step
            if res.decode_ms_per_token is not None:
                res.host_overhead_ms = max(res.decode_ms_per_token - step, 0.0)
    return res


def copy_bandwidth_gbps(device: str = "cuda", nbytes: int = 2**30) -> float:
    """GB/s of a device-to-device copy of `nbytes` (bytes read + written over its CUDA-event time), the median of
    ten after two warm-ups: the bandwidth a weight-streaming kernel is held to."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del src, dst
    return 2 * nbytes / (statistics.median(times[2:]) * 1e-3) / 1e9


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of K and V one cached position holds over all of the model's attention layers, in the model's dtype
    (0 for a model without attention heads in its config: Mamba's state is not a cache that grows). Layers a config
    marks as other than attention (`layer_types`) hold none; a sliding window's cap is not counted."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(cfg, "num_attention_heads", None)
    if not heads:
        return 0
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    types = getattr(cfg, "layer_types", None)
    layers = sum("attention" in str(t) for t in types) if types else cfg.num_hidden_layers
    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def decode_kv_tokens(inputs: Any, wl) -> float:
    """Cached positions a mean decode step reads over the batch: each row's prompt (its unpadded length where the
    inputs carry an attention mask [batch, prompt]) plus, on average over the decode_len - 1 steps, decode_len / 2
    tokens written since."""
    mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == wl.batch_size:
        prompt = float(mask.sum())
    else:
        prompt = float(wl.batch_size * wl.prompt_len)
    return prompt + wl.batch_size * wl.decode_len / 2


def decode_floor_bytes(model: torch.nn.Module, kv_tokens: float) -> float:
    """Bytes a decode step must read at least: every weight once, and the KV cache of `kv_tokens` positions."""
    weights = sum(t.numel() * t.element_size() for t in {id(p): p for p in model.parameters()}.values())
    return weights + kv_tokens * kv_bytes_per_token(model)


def _hbm_floor(model: torch.nn.Module, device: str, kv_tokens: float = 0.0,
               gbps: float | None = None) -> tuple[float, float] | None:
    """(ms per decode step, GB/s): decode_floor_bytes at the copy bandwidth measured here (`gbps` where already
    measured). None off the GPU."""
    if not device.startswith("cuda"):
        return None
    gbps = gbps or copy_bandwidth_gbps(device)
    return decode_floor_bytes(model, kv_tokens) / (gbps * 1e9) * 1e3, gbps


def _graph_step_ms(model: torch.nn.Module) -> float | None:
    """GPU time of one decode step of `model`'s decode graphs, from the events its last timed round recorded."""
    import kernels_runtime

    g = kernels_runtime.decode_graphs_of(model)
    return g.gpu_step_ms() if g is not None else None


def _record_steps(slots) -> None:
    """Have every slot with decode graphs record CUDA events around its replays (the last round only: the events
    cost the host a few microseconds a step)."""
    import kernels_runtime

    for slot in slots:
        g = kernels_runtime.decode_graphs_of(slot.model)
        if g is not None and torch.cuda.is_available():
            g.step_events = []


def _append_row(path: str, result: E2EResult, device: str) -> None:
    from llm4llm.profiler import hardware_info

    hw = hardware_info(device)
    row = {**result.to_row(), "gpu_name": hw.get("gpu_name"),
           "versions_json": {k: hw.get(k) for k in ("torch", "triton", "transformers")}}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _first_line(e: Exception, limit: int = 300) -> str:
    """`Type: first line of the message`, at most `limit` characters."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:limit]


def eval_batches(workload_path: str, settings) -> list[int] | None:
    """The batches a run's evaluation measures at (`settings`: its EvaluateSettings): the settings' own, else for a
    workload with a [regime] its representative batch (batch_size) and the regime's largest decode bucket (where a
    serving bundle's gain is decided too), else None (the workload's batch_size)."""
    from llm4llm.workload import load_workload

    if settings.batch_sizes is not None:
        return list(settings.batch_sizes)
    wl = load_workload(workload_path, check_device=False)
    if wl.regime is None:
        return None
    return list(dict.fromkeys([wl.batch_size, max(wl.regime.batch_buckets())]))
