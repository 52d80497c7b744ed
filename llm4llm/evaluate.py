"""End-to-end evaluation: eager vs patched vs torch.compile through the user's own script, in one process.

Timing is wall clock around the script's `run`, synchronized on the GPU: it includes HF generate's host time, which
is what a user waits for. Prefill is a run with one new token; decode per token is the rest divided by the
remaining steps. Every variant runs in the same process on the same inputs, because absolute times drift between
machines of one kind. On the CPU the numbers are reported but marked, and never used to accept anything.
"""
from __future__ import annotations

import inspect
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

VARIANTS = ("eager", "patched", "torch_compile")  # the compiled baseline last: its compile is the slowest
# Also measurable on request: the decode step replayed from CUDA graphs (kernels_runtime.graphs), unpatched and patched.
GRAPH_VARIANTS = ("eager_graphs", "patched_graphs")


@dataclass
class E2EResult:
    variant: str
    prefill_ms: float | None
    decode_ms_per_token: float | None
    total_ms: float | None
    tokens_per_s: float | None
    peak_mem_mb: float | None
    compile_s: float | None = None
    repeats: int = 0
    timer: str = "wall+cuda_sync"
    notes: str = ""
    samples_ms: list[float] = field(default_factory=list)  # every timed full run, in order (total_ms: their median)
    prefill_samples_ms: list[float] = field(default_factory=list)  # every timed one-token run (prefill_ms: median)

    def to_row(self) -> dict:
        d = asdict(self)
        d["total_samples_ms"] = d.pop("samples_ms")
        d.pop("timer")
        return d

    @property
    def total_range_ms(self) -> str:
        return spread(self.samples_ms)


TABLE_COLUMNS = ("variant", "prefill_ms", "decode_ms_per_token", "total_ms", "total_range_ms", "tokens_per_s",
                 "peak_mem_mb", "compile_s", "notes")


def table_rows(rows: list[dict]) -> list[dict]:
    """e2e rows (`E2EResult.to_row` plus run fields) as the CLI table and the Prefect artifact show them: the medians
    and the total's min-max over the timed runs."""
    return [{k: spread(r.get("total_samples_ms")) if k == "total_range_ms" else r.get(k) for k in TABLE_COLUMNS}
            for r in rows]


def spread(samples: list[float] | str | None) -> str:
    """`min-max` of a row's timed runs ('' without any), as tables show it beside the median. A DuckDB row holds
    them as JSON text."""
    if isinstance(samples, str):
        samples = json.loads(samples)
    return f"{min(samples):.1f}-{max(samples):.1f}" if samples else ""


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def accepts_generate_kwargs(run_fn: Callable) -> bool:
    params = inspect.signature(run_fn).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def measure(model, workload, batch, run_fn, *, repeats: int = 3, warmup: int = 1, label: str = "eager",
            split: bool = True, **gen_kwargs) -> E2EResult:
    """Median over `repeats` of the full run and of a one-token run (prefill). split=False: the full run only
    (prefill_ms and decode_ms_per_token None), warmed up with two of them instead of one full and one prefill run
    (acceptance wants the total alone: half the runs; a prefill graph is still captured before the timed runs)."""
    from llm4llm.workload import call_script

    def full():
        return call_script(run_fn, model, workload, batch, **gen_kwargs)

    one = workload.model_copy(update={"decode_len": 1})

    def prefill():
        return call_script(run_fn, model, one, batch, **gen_kwargs)

    compile_s = None
    t0 = time.perf_counter()
    for _ in range(max(warmup, 1)):
        _timed(full, workload.device)
        _timed(prefill if split else full, workload.device)
    if label == "torch_compile":
        compile_s = time.perf_counter() - t0
    if workload.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    totals = [_timed(full, workload.device) for _ in range(repeats)]
    prefills = [_timed(prefill, workload.device) for _ in range(repeats)] if split else []
    peak = torch.cuda.max_memory_allocated() / 2**20 if workload.device.startswith("cuda") else None
    total = statistics.median(totals)
    pre = statistics.median(prefills) if split else None
    steps = max(workload.decode_len - 1, 1)
    decode = max(total - pre, 0.0) / steps if split else None
    new_tokens = workload.batch_size * workload.decode_len
    return E2EResult(label, pre, decode, total, new_tokens / (total / 1e3), peak, compile_s, repeats,
                     "wall+cuda_sync" if workload.device.startswith("cuda") else "wall (cpu: not a speedup)",
                     samples_ms=totals, prefill_samples_ms=prefills)


def evaluate_workload(workload_path: str, *, bundle: str | None = None, variants: tuple[str, ...] = VARIANTS,
                      repeats: int = 3, results_path: str | None = None) -> list[E2EResult]:
    """Build the model once through the script and measure each variant in turn, in this process. results_path:
    each variant's row (with the GPU and library versions) is appended there as a JSON line as soon as it is
    measured, so a run stopped midway (a time limit, a crash) keeps the variants it finished."""
    from llm4llm.workload import call_script, load_script, load_workload

    unknown = [v for v in variants if v not in VARIANTS + GRAPH_VARIANTS]
    if unknown:  # before anything is built or measured
        raise ValueError(f"variant: expected one of {VARIANTS + GRAPH_VARIANTS}, got {unknown}")
    wl = load_workload(workload_path)
    script = load_script(wl)
    model = call_script(script.build, wl)
    batch = call_script(script.inputs, wl)
    results: list[E2EResult] = []
    for variant in variants:
        try:
            results.append(_variant(variant, model, wl, batch, script, bundle, repeats))
        except Exception as e:  # one variant failing (e.g. a static cache the architecture lacks) is a row too
            results.append(E2EResult(variant, None, None, None, None, None, notes=f"failed: {_first_line(e, 700)}"))
            if wl.device.startswith("cuda"):
                torch.cuda.empty_cache()
        if results_path:
            _append_row(results_path, results[-1], wl.device)
    return results


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


def _variant(variant, model, wl, batch, script, bundle, repeats) -> E2EResult:
    if variant == "eager":
        return measure(model, wl, batch, script.run, repeats=repeats, label="eager")
    if variant == "torch_compile":
        if not accepts_generate_kwargs(script.run):
            return E2EResult("torch_compile", None, None, None, None, None,
                             notes="skipped: the script's run() takes no generate kwargs")
        try:
            return measure(model, wl, batch, script.run, repeats=repeats, label="torch_compile",
                           cache_implementation="static")
        except Exception as e:
            first = _first_line(e)
        # HF compiles the static-cache decode step with mode="reduce-overhead" (CUDA graph trees); a model that keeps
        # per-step state on its modules reads a graph output a later replay overwrote (RecurrentGemma on the H200:
        # "accessing tensor output of CUDAGraphs that has been overwritten"). Inductor without CUDA graphs is what a
        # user tries next; the row says which mode it is. The failed run left graph outputs as the state modules keep
        # on themselves, and reading one raises the same error (the H200, 2026-11-30: the retry failed so before any
        # compiling): the state is dropped first, the next prefill builds it afresh.
        from transformers import CompileConfig

        from kernels_runtime.boundary import clear_module_state

        torch._dynamo.reset()
        clear_module_state(model)
        try:
            r = measure(model, wl, batch, script.run, repeats=repeats, label="torch_compile",
                        cache_implementation="static", compile_config=CompileConfig(mode="default"))
        except Exception as e:  # the mode=default error first: it is the new one
            raise RuntimeError(f"mode=default: {_first_line(e)}; mode=reduce-overhead: {first}") from e
        r.notes = f"compile mode=default (reduce-overhead failed: {first})"
        return r
    import kernels_runtime

    graphs = variant.endswith("_graphs")
    if graphs and not wl.device.startswith("cuda"):
        return E2EResult(variant, None, None, None, None, None, notes="skipped: CUDA graphs need a CUDA device")
    # A graph needs the cache at static addresses: the graph variants generate with transformers' static KV cache
    # (its auto-compile off, so the graph is ours); Mamba/Mamba2 keep their LinearAttentionLayer either way.
    how = "static cache, compile off; " if graphs else ""
    if variant == "eager_graphs":
        g = kernels_runtime.enable_decode_graphs(model, static_cache=True)
        try:
            r = measure(model, wl, batch, script.run, repeats=repeats, label=variant)
            r.notes = f"{how}decode graphs: {g.stats()}"[:500]
            return r
        finally:
            kernels_runtime.disable_decode_graphs(model)
    if bundle is None:
        return E2EResult(variant, None, None, None, None, None, notes="skipped: no bundle")
    report = kernels_runtime.apply(model, bundle, decode_graphs=graphs, static_cache=graphs)
    try:
        r = measure(model, wl, batch, script.run, repeats=repeats, label=variant)
        g = kernels_runtime.decode_graphs_of(model)
        r.notes = (how + str(report).replace("\n", "; ") + (f"; graphs {g.stats()}" if g is not None else ""))[:500]
        return r
    finally:
        kernels_runtime.revert(model)
