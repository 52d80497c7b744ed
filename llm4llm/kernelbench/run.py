"""`llm4llm kernelbench DIR`: each problem becomes a task, searched by the existing search and judged by the existing
verifier (KernelBench's protocol on top of every gate); every trial is a `candidates` row, every problem a
`kernelbench_results` row (migration 007), written through the callables tasks/kernelbench.py passes in."""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from llm4llm.kernelbench.problem import make_task, problem_id, select
from llm4llm.taskspec import load_spec

MODES = ("episodic", "sample", "iter")


class KernelBenchProblem(BaseModel):
    """One problem of a KernelBench run in one search mode: its `kernelbench_results` row (migration 007), frozen
    (handed unchanged to the stage's caller; dumped only where storage writes it). search_id: its search (None:
    skipped, skipped_reason says why); passed: a candidate passed every gate, the best passing one (by speedup over
    eager) named by best_candidate_id with its origin, KernelBench's means (eager_ms, compile_ms, candidate_ms), its
    speedups and GPU; degenerate: the problem's output ignores its inputs (migration 017; None: not judged)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kb_run_id: str
    problem: str
    problem_id: int
    task_id: str
    mode: str
    proposer: str
    budget: int
    trials: int = 0
    passed: bool = False
    search_id: str | None = None
    best_candidate_id: str | None = None
    origin: str | None = None
    degenerate: bool | None = None
    eager_ms: float | None = None
    compile_ms: float | None = None
    candidate_ms: float | None = None
    speedup_eager: float | None = None
    speedup_compile: float | None = None
    gpu_name: str | None = None
    skipped_reason: str | None = None


def kb_proposer(kind: str, seed: int = 0, llm=None):
    """The built-in proposer over the KernelBench templates (a seeded sample over fusion scopes and tiles,
    llm4llm/kernelbench/proposer.py); llm / hybrid through the project's LLM proposer."""
    from llm4llm.kernelbench.proposer import KBProposer
    from llm4llm.kernelbench.templates import TEMPLATES

    lib = KBProposer(seed=seed, templates=TEMPLATES)
    if kind == "library":
        return lib
    from llm4llm.llm.config import LLMConfig, load_llm_config
    from llm4llm.llm.proposer import HybridProposer, LLMProposer

    cfg = llm if isinstance(llm, LLMConfig) else load_llm_config(None, flags=dict(llm or {}))
    # The LLM's seed kernel (seed_with_builtin) is a KernelBench template's ModelNew, from an instance of its own so
    # that showing it does not use up the hybrid's library candidates.
    llm_prop = LLMProposer(cfg, builtin=KBProposer(seed=seed, templates=TEMPLATES))
    return llm_prop if kind == "llm" else HybridProposer(llm_prop, lib, cfg.hybrid_share)


def run_problems(directory: str, data_dir: str, search: Callable[..., Any], trials: Callable[[str], Any],
                 record: Callable[[KernelBenchProblem], None], *, problems: str | None = None, budget: int = 4,
                 modes: list[str] | None = None, proposer: str = "library", device: str = "cpu",
                 timeout_s: float = 600.0, seed: int = 0, llm=None, kb_run_id: str | None = None,
                 on_problem=None) -> tuple[str, list[KernelBenchProblem]]:
    """Each selected problem as a task under `data_dir`, searched per mode. search(task_dir, **options): one
    task's search with its rows recorded, returning its summary; trials(search_id): that search's `candidates`
    rows (a DataFrame); record(problem): a problem's KernelBenchProblem, its `kernelbench_results` row;
    on_problem(problem): told of each as it is recorded. llm4llm/stages/kernelbench.py wires them to the
    repository."""
    modes = modes or ["episodic"]
    for m in modes:
        if m not in MODES:
            raise ValueError(f"--mode: expected one of {MODES}, got {m!r}")
    data = Path(data_dir)
    root = data / "kernelbench-tasks"
    kb_run_id = kb_run_id or f"kb-{uuid.uuid4().hex[:10]}"
    hardware = {"device": device}
    rows = []
    for f in select(Path(directory), problems):
        task_dir = make_task(f, root, hardware)
        spec = load_spec(task_dir)
        for mode in modes:
            prop = kb_proposer(proposer, seed, llm)
            reasons = prop.skipped(spec) if hasattr(prop, "skipped") else {}
            usable = prop.templates_for(spec) if hasattr(prop, "templates_for") else [None]
            row = {"kb_run_id": kb_run_id, "problem": f.name, "problem_id": problem_id(f), "task_id": spec.task_id,
                   "mode": mode, "proposer": proposer, "budget": budget, "trials": 0, "passed": False}
            if not usable:
                row["skipped_reason"] = "; ".join(f"{k}: {v}" for k, v in reasons.items())[:2000]
            else:
                summary = search(str(task_dir), mode=mode, budget=budget, proposer=proposer, device=device,
                                 timeout_s=timeout_s, seed=seed, run_id=kb_run_id, proposer_obj=prop)
                row.update(search_id=summary.search_id, trials=summary.trials)
                _fill_best(row, trials(summary.search_id))
            done = KernelBenchProblem(**row)
            record(done)
            rows.append(done)
            if on_problem:
                on_problem(done)
    return kb_run_id, rows


def _fill_best(row: dict, df) -> None:
    """The search's best passing trial (by speedup over eager) into the problem's row; `df`: its candidates."""
    import json

    ok = df[df["passed"]]
    if ok.empty:
        return
    timed = ok[ok["speedup_cold"].notna()]
    best = (timed.sort_values("speedup_cold", ascending=False) if not timed.empty else ok).iloc[0]
    means = best.get("kb_means_json")
    means = json.loads(means) if isinstance(means, str) else (means or {})
    flags = [bool(x) for x in ok["kb_degenerate"].dropna()] if "kb_degenerate" in ok else []
    row.update(passed=True, best_candidate_id=best["candidate_id"], origin=best.get("origin"),
               degenerate=any(flags) if flags else None,
               eager_ms=means.get("eager"), compile_ms=means.get("compile"), candidate_ms=means.get("candidate"),
               speedup_eager=_num(best.get("speedup_cold")), speedup_compile=_num(best.get("speedup_compile")),
               gpu_name=best.get("gpu_name"))


def _num(v):
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if f != f else f
