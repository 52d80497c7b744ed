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

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Deployment-aware, closed-loop optimizer of GPU kernels for language-model inference.")
# Wide enough for the hotspot table when the output is not a terminal (CI logs, pipes).
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

DbOpt = typer.Option(None, "--db", help="DuckDB file (default $LLM4LLM_DB or $LLM4LLM_HOME/llm4llm.duckdb)")
DataOpt = typer.Option(None, "--data-dir", help="artifact dir (default $LLM4LLM_HOME or ./.llm4llm)")


def _quiet_prefect(verbose: bool) -> None:
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@contextmanager
def _user_errors():
    """Bad input gets one clear message and exit code 2; nothing else is printed."""
    from llm4llm.errors import Llm4llmError

    try:
        yield
    except Llm4llmError as e:
        err_console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2)


def _db(db: Optional[Path]):
    from storage.db import Database

    return Database(db)


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

        with console.status(f"profiling {workload} ..."):
            out = profile_workload(str(workload), db_path=str(db) if db else None,
                                   data_dir=str(data_dir) if data_dir else None, refresh=refresh)
        console.print(f"run [bold]{out['run_id']}[/]")
        _print_hotspots(out["profile_path"], top)


@app.command()
def optimize(workload: Path = typer.Argument(..., help="workload TOML"), db: Optional[Path] = DbOpt,
             data_dir: Optional[Path] = DataOpt, min_score: float = typer.Option(0.0, help="skip colder modules"),
             top: int = typer.Option(15), refresh: bool = typer.Option(False, help="ignore cached results"),
             verbose: bool = typer.Option(False, "-v", "--verbose")) -> None:
    """Run the closed loop on a workload (the stages that exist: profile -> extract)."""
    _quiet_prefect(verbose)
    with _user_errors():
        from flows.optimize import optimize_workload

        with console.status(f"optimizing {workload} ..."):
            out = optimize_workload(str(workload), db_path=str(db) if db else None,
                                    data_dir=str(data_dir) if data_dir else None, min_score=min_score,
                                    refresh=refresh)
        console.print(f"run [bold]{out['run_id']}[/]")
        _print_hotspots(out["profile_path"], top)
        _print_tasks(db, out["run_id"])


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
