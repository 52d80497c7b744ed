"""`llm4llm` command line: profile, extract, search, inspect runs and tasks."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from llm4llm import progress

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Deployment-aware, closed-loop optimizer of GPU kernels for language-model inference.")
# Wide enough for the hotspot table when the output is not a terminal (CI logs, pipes).
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

DbOpt = typer.Option(None, "--db", help="DuckDB file (default $LLM4LLM_DB or $LLM4LLM_HOME/llm4llm.duckdb)")
DataOpt = typer.Option(None, "--data-dir", help="artifact dir (default $LLM4LLM_HOME or ./.llm4llm)")


def _quiet_prefect(verbose: bool) -> None:
    from kernels_runtime.ops._common import interpret_without_gpu

    interpret_without_gpu()
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if not verbose:  # a failed run's own error is printed once by _user_errors; Prefect's tracebacks only with -v
        import logging

        for name in ("prefect.flow_runs", "prefect.task_runs", "prefect.flow_engine", "prefect.task_engine"):
            logging.getLogger(name).addFilter(_NoTracebacks())


class _NoTracebacks:
    """Drops ERROR records and tracebacks from Prefect's run loggers (the CLI reports the error itself)."""

    def filter(self, record) -> bool:
        import logging

        return record.levelno < logging.ERROR and not record.exc_info


@contextmanager
def _user_errors():
    """Bad input gets one clear message and exit code 2; nothing else is printed."""
    from llm4llm.errors import Llm4llmError
    from storage.db import DatabaseError

    try:
        yield
    except (Llm4llmError, DatabaseError) as e:
        err_console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2)


def _db(db: Optional[Path]):
    from storage.db import Database, DatabaseError

    try:
        return Database(db)
    except DatabaseError as e:
        err_console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2) from None


def _df_table(df, title: str, columns: list[str] | None = None, floats: int = 3) -> Table:
    table = Table(title=title, show_lines=False)
    cols = columns or list(df.columns)
    for c in cols:
        table.add_column(str(c), overflow="fold")
    for _, row in df.iterrows():
        cells = []
        for c in cols:
            v = row[c]
            cells.append(f"{v:.{floats}f}" if isinstance(v, float) else str(v))
        table.add_row(*cells)
    return table


def _print_hotspots(profile_path: str, top: int) -> None:
    from llm4llm.pipeline import load_profile
    from llm4llm.profiler import format_hotspots

    payload, result = load_profile(profile_path)
    console.print(format_hotspots(result, top=top))
    for name, ph in result.phases.items():
        console.print(f"  {name}: {ph.forwards} forwards, {ph.time_ms:.2f} ms, weight {ph.weight:.3f}")


@app.command()
def profile(workload: Path = typer.Argument(..., help="workload TOML"), db: Optional[Path] = DbOpt,
            data_dir: Optional[Path] = DataOpt, top: int = typer.Option(20, help="rows of the hotspot table"),
            refresh: bool = typer.Option(False, help="ignore cached results"),
            verbose: bool = typer.Option(False, "-v", "--verbose")) -> None:
    """Profile a workload per phase and print the ranked hotspot table."""
    _quiet_prefect(verbose)
    with _user_errors():
        from flows.profile import profile_workload

        with progress.rich_progress(console):
            out = profile_workload(str(workload), db_path=str(db) if db else None,
                                   data_dir=str(data_dir) if data_dir else None, refresh=refresh)
        console.print(f"run [bold]{out['run_id']}[/]")
        _print_hotspots(out["profile_path"], top)


@app.command()
def optimize(workload: Path = typer.Argument(..., help="workload TOML"), db: Optional[Path] = DbOpt,
             data_dir: Optional[Path] = DataOpt,
             stages: str = typer.Option("profile,extract,search,accept,evaluate", help="comma-separated stages"),
             budget: int = typer.Option(15, help="trials per task"), mode: str = typer.Option("episodic"),
             proposer: str = typer.Option("library", help="library | llm | hybrid"),
             top: int = typer.Option(6, help="search the top-N tasks by hotspot score"),
             family: Optional[list[str]] = typer.Option(
                 None, help="search only tasks of this family (repeatable; before --top), e.g. norm, ssm_mixer"),
             delta: float = typer.Option(0.02, help="minimum end-to-end gain to accept a patch"),
             accept_metric: str = typer.Option(
                 "auto", help="in-model correctness metric: auto (logits_rel_l2_floor for 16-bit models, "
                              "logits_rel_l2 for fp32) | logits_rel_l2_floor | logits_rel_l2 | logits_max_abs"),
             accept_tol_factor: float = typer.Option(3.0, help="fixed rel-L2 limit = factor x the dtype's rtol"),
             accept_floor_factor: float = typer.Option(
                 2.0, help="logits_rel_l2_floor: per-step limit = max(fixed limit, factor x the model's own "
                           "16-bit-vs-fp32 noise floor)"),
             accept_min_task_speedup: float = typer.Option(
                 1.0, help="on the GPU, a candidate no faster than this in its task is rejected without an "
                           "in-model trial (0: try every candidate)"),
             accept_noisy_rounds: int = typer.Option(
                 2, help="when the baseline drifts by more than delta around a trial, measure this many more "
                         "(trial, baseline) pairs alternately and decide on the median bracketed gain (0: the drift "
                         "itself is the bar)"),
             decode_graphs: str = typer.Option(
                 "auto", help="auto | on | off. GPU: the one-token decode steps replay from CUDA graphs "
                              "(kernels_runtime.graphs): decode candidates timed by GPU time under graph replay, "
                              "acceptance gates them like a patch (logits, then delta), the bundle ships with them. "
                              "auto: on when all decode state sits in a static-address cache (Mamba, Mamba2), a KV "
                              "cache swapped for the static cache (Llama, Qwen3, RecurrentGemma's attention) or on "
                              "modules with a state adapter (RecurrentGemma's recurrent blocks)"),
             min_score: float = typer.Option(0.0, help="skip colder modules at extraction"),
             llm_model: Optional[str] = typer.Option(None, help="litellm model string (proposer llm/hybrid)"),
             llm_api_base: Optional[str] = typer.Option(None),
             e2e_variants: Optional[str] = typer.Option(
                 None, help="variants the evaluate stage runs, in order (default: eager,patched,torch_compile; with "
                            "decode graphs eager,patched_graphs,eager_graphs,patched,torch_compile)"),
             rounds: int = typer.Option(1, help="search+accept rounds: rejected tasks are searched again"),
             refresh: bool = typer.Option(False, help="ignore cached results"),
             verbose: bool = typer.Option(False, "-v", "--verbose")) -> None:
    """Run the closed loop on a workload: profile -> extract -> search -> accept -> evaluate."""
    _quiet_prefect(verbose)
    with _user_errors():
        from flows.optimize import optimize_workload

        _check_proposer(proposer)
        _check_accept(accept_metric, accept_tol_factor, accept_floor_factor, accept_min_task_speedup,
                      accept_noisy_rounds)
        _check_graphs(decode_graphs, e2e_variants)
        _check_families(family)
        llm = _llm_options(workload, llm_model, llm_api_base) if proposer != "library" else None
        with progress.rich_progress(console):
            out = optimize_workload(str(workload), db_path=str(db) if db else None,
                                    data_dir=str(data_dir) if data_dir else None, min_score=min_score,
                                    refresh=refresh, stages=tuple(s.strip() for s in stages.split(",")),
                                    mode=mode, budget=budget, proposer=proposer, top=top,
                                    families=list(family) if family else None, delta=delta, llm=llm,
                                    accept_metric=accept_metric, accept_tol_factor=accept_tol_factor,
                                    accept_floor_factor=accept_floor_factor,
                                    accept_min_task_speedup=accept_min_task_speedup,
                                    accept_noisy_rounds=accept_noisy_rounds, decode_graphs=decode_graphs,
                                    e2e_variants=tuple(v.strip() for v in e2e_variants.split(",")) if e2e_variants else None,
                                    rounds=rounds)
        console.print(f"run [bold]{out['run_id']}[/]")
        if out.get("decode_graphs"):
            console.print(f"decode graphs: {out['decode_graphs']}")
        _print_hotspots(out["profile_path"], 15)
        if "tasks" in out:
            _print_tasks(db, out["run_id"])
        for r in out.get("searches", []):
            console.print(f"search {r['task_id']}: {r['trials']} trials, pass rate {r['pass_rate']:.0%}, "
                          f"best utility {r['best_utility']}")
        if "acceptance" in out:
            a = out["acceptance"]
            console.print(f"acceptance ({a['timing']}, {a.get('metric', '')}): {a['accepted']} accepted, "
                          f"{a['rejected']} rejected; bundle {a['bundle']}")
            if a.get("floor"):
                console.print(f"  noise {a['floor']}")
        if "e2e" in out:
            _print_e2e(out["e2e"]["rows"])


PROPOSERS = ("library", "llm", "hybrid")


def _check_graphs(decode_graphs: str, e2e_variants: str | None) -> None:
    """--decode-graphs and --e2e-variants: one error line (exit 2) before any flow starts."""
    from llm4llm.errors import Llm4llmError
    from llm4llm.pipeline import GRAPH_CHOICES

    if decode_graphs not in GRAPH_CHOICES:
        raise Llm4llmError(f"--decode-graphs: expected one of {', '.join(GRAPH_CHOICES)}, got {decode_graphs!r}")
    _check_variants("--e2e-variants", e2e_variants)


def _check_families(families: list[str] | None) -> None:
    """--family: one error line (exit 2) before any flow starts."""
    from llm4llm.errors import Llm4llmError
    from llm4llm.extract import TARGET_FAMILIES

    bad = [f for f in families or [] if f not in TARGET_FAMILIES]
    if bad:
        raise Llm4llmError(f"--family: expected one of {', '.join(TARGET_FAMILIES)}, got {', '.join(bad)}")


def _check_variants(option: str, variants: str | None) -> None:
    """An evaluate variant list: one error line (exit 2) before anything is built or measured."""
    from llm4llm.errors import Llm4llmError
    from llm4llm.evaluate import GRAPH_VARIANTS, VARIANTS

    bad = [v.strip() for v in (variants or "").split(",") if v.strip() and v.strip() not in VARIANTS + GRAPH_VARIANTS]
    if bad:
        raise Llm4llmError(f"{option}: expected names from {', '.join(VARIANTS + GRAPH_VARIANTS)}, got {bad}")


def _check_accept(metric: str, tol_factor: float, floor_factor: float, min_task_speedup: float = 1.0,
                  noisy_rounds: int = 2) -> None:
    """--accept-*: one error line (exit 2) before any flow starts."""
    from llm4llm.accept import AcceptConfig
    from llm4llm.errors import Llm4llmError

    try:
        AcceptConfig(metric=metric, tol_factor=tol_factor, floor_factor=floor_factor,
                     min_task_speedup=min_task_speedup, noisy_rounds=noisy_rounds)
    except ValueError as e:
        raise Llm4llmError(f"--accept-{str(e).split(':')[0].replace('_', '-')}: {str(e).split(':', 1)[1].strip()}")


def _check_proposer(proposer: str) -> None:
    from llm4llm.errors import Llm4llmError

    if proposer not in PROPOSERS:
        raise Llm4llmError(f"--proposer: expected one of {', '.join(PROPOSERS)}, got {proposer!r}")


def _llm_options(workload: Optional[Path], model: Optional[str], api_base: Optional[str]) -> dict:
    """The LLM proposer's settings: the workload's `[llm]` table < LLM4LLM_LLM_* env < flags. Checked here (a
    missing model is one error line, exit 2, before any flow starts). No API key: litellm reads the provider's
    env variable in the process that sends the requests."""
    from llm4llm.llm.config import load_llm_config

    cfg = load_llm_config(workload if workload and Path(workload).is_file() else None,
                          flags={"model": model, "api_base": api_base})
    cfg.require_model()
    return cfg.model_dump()


def _run_workload_path(d, run_id: str) -> Optional[Path]:
    rows = d.query("SELECT w.path FROM runs r JOIN workloads w USING (workload_hash) WHERE r.run_id = ?", [run_id])
    return Path(rows[0][0]) if rows and rows[0][0] else None


def _print_e2e(rows: list[dict]) -> None:
    import pandas as pd

    from llm4llm.evaluate import table_rows

    console.print(_df_table(pd.DataFrame(table_rows(rows)), "end to end"))


@app.command()
def search(task: Optional[list[str]] = typer.Option(None, "--task", help="task id (repeatable; default: all)"),
           run: Optional[str] = typer.Option(None, "--run", help="run id (default: latest)"),
           budget: int = typer.Option(15), mode: str = typer.Option("episodic", help="episodic | sample | iter"),
           proposer: str = typer.Option("library", help="library | llm | hybrid"),
           device: Optional[str] = typer.Option(None, help="default: the run's device"),
           top: Optional[int] = typer.Option(None, help="only the top-N tasks by score"),
           timeout_s: float = typer.Option(120.0, help="per-candidate wall-clock limit"),
           decode_timing: str = typer.Option(
               "launch", help="launch: decode candidates timed back to back | graph: by GPU time under CUDA-graph "
                              "replay (what `optimize` uses when the model's decode steps run from graphs) | "
                              "graph_prefill: prefill candidates too (Mamba, Mamba2: their prompt forward is "
                              "graphed as well)"),
           llm_model: Optional[str] = typer.Option(None), llm_api_base: Optional[str] = typer.Option(None),
           db: Optional[Path] = DbOpt, data_dir: Optional[Path] = DataOpt,
           verbose: bool = typer.Option(False, "-v", "--verbose")) -> None:
    """Search Triton candidates for the tasks of a run (episodic with restart by default)."""
    _quiet_prefect(verbose)
    with _user_errors():
        from flows.search import search_tasks
        from llm4llm.errors import Llm4llmError, TaskError
        from llm4llm.verify.worker import DECODE_TIMINGS
        from storage import repo

        _check_proposer(proposer)
        if decode_timing not in DECODE_TIMINGS:
            raise Llm4llmError(f"--decode-timing: expected one of {', '.join(DECODE_TIMINGS)}, got {decode_timing!r}")
        with _db(db) as d:
            run = run or repo.latest_run_id(d)
            info = repo.get_run(d, run) if run else None
            workload_path = _run_workload_path(d, run) if info is not None else None
        if info is None:
            raise TaskError(f"run: expected an existing run id (see `llm4llm runs`), got {run!r}")
        # The run's workload file supplies the [llm] table when it is still where it was profiled from.
        llm = _llm_options(workload_path, llm_model, llm_api_base) if proposer != "library" else None
        with progress.rich_progress(console):
            results = search_tasks(run, db_path=str(db) if db else None, data_dir=str(data_dir) if data_dir else None,
                                   mode=mode, budget=budget, proposer=proposer,
                                   device=device or ("cuda" if info["device"] == "cuda" else "cpu"),
                                   timeout_s=timeout_s, task_ids=task or None, top=top, llm=llm,
                                   decode_timing=decode_timing)
        for r in results:
            console.print(f"{r['task_id']}: {r['trials']} trials, pass rate {r['pass_rate']:.0%}, best utility "
                          f"{r['best_utility']}, best {r['best_candidate']}")
            if "llm_calls" in r:
                cost = f", ${r['llm_cost_usd']:.4f}" if r.get("llm_cost_usd") else ""
                console.print(f"  llm: {r['llm_calls']} calls, {r['llm_tokens']} tokens{cost}"
                              + (f"; stopped: {r['llm_exhausted']}" if r.get("llm_exhausted") else ""))


@app.command()
def evaluate(workload: Path = typer.Argument(..., help="workload TOML"),
             bundle: Optional[Path] = typer.Option(None, help="patch bundle dir for the patched variant"),
             repeats: int = typer.Option(3), db: Optional[Path] = DbOpt,
             variants: str = typer.Option(
                 "eager,patched,torch_compile",
                 help="comma-separated, in order: eager, patched (kernels only), torch_compile; on a GPU also "
                      "eager_graphs, patched_graphs (decode steps replayed from CUDA graphs)"),
             verbose: bool = typer.Option(False, "-v", "--verbose")) -> None:
    """End to end, in one process: eager vs torch.compile (HF static-cache compiled generate) vs patched."""
    _quiet_prefect(verbose)
    with _user_errors():
        from llm4llm.pipeline import run_evaluate

        _check_variants("--variants", variants)
        if bundle is not None:  # an explicitly requested bundle fails loudly, before anything is built
            from kernels_runtime.bundle import BundleError, load_bundle
            from llm4llm.errors import TaskError

            try:
                load_bundle(bundle)
            except (BundleError, OSError) as e:
                raise TaskError(f"bundle {bundle}: expected a readable patch bundle, got {e}") from e

        with console.status(f"evaluating {workload} ..."):
            out = run_evaluate(str(workload), str(db) if db else None, bundle=str(bundle) if bundle else None,
                               repeats=repeats, variants=tuple(v.strip() for v in variants.split(",")))
        _print_e2e(out["rows"])


@app.command()
def watch(paths: list[Path] = typer.Argument(..., help="workload files or directories"), db: Optional[Path] = DbOpt,
          stages: str = typer.Option("profile,extract", help="stages to run on a changed workload")) -> None:
    """Re-profile (and re-optimize) a workload whenever its config or script changes (content hash)."""
    _quiet_prefect(False)
    from deployments.triggers import watch as _watch
    from flows.optimize import optimize_workload
    from llm4llm.errors import Llm4llmError

    def on_change(path: Path) -> None:
        console.print(f"[bold]{path}[/] changed: running {stages}")
        try:
            out = optimize_workload(str(path), db_path=str(db) if db else None,
                                    stages=tuple(s.strip() for s in stages.split(",")))
            console.print(f"run {out['run_id']}")
        except Llm4llmError as e:
            err_console.print(f"[bold red]error:[/] {e}")

    _watch([str(p) for p in paths], on_change, str(db) if db else None)


def _print_tasks(db: Optional[Path], run_id: Optional[str]) -> None:
    from storage import repo

    with _db(db) as d:
        run_id = run_id or repo.latest_run_id(d)
        if run_id is None:
            console.print("no runs yet: run `llm4llm profile WORKLOAD` first")
            return
        df = repo.task_rows(d, run_id)
    cols = ["task_id", "family", "phase", "instances", "dtype", "score", "deployable", "reason"]
    console.print(_df_table(df, f"tasks of run {run_id}", cols))


@app.command("tasks")
def tasks_cmd(run: Optional[str] = typer.Option(None, "--run", help="run id (default: latest)"),
              db: Optional[Path] = DbOpt) -> None:
    """List the extracted tasks of a run."""
    _print_tasks(db, run)


@app.command()
def runs(db: Optional[Path] = DbOpt, limit: int = typer.Option(20)) -> None:
    """List recent runs."""
    from storage import repo

    with _db(db) as d:
        df = repo.list_runs(d, limit)
    console.print(_df_table(df, "runs"))


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
