"""`llm4llm` command line: profile, extract, search, inspect runs and tasks. On top of every layer: it may import
flows/, tasks/, deployments/, storage/ and the core, and nothing imports it (.importlinter's `layers`)."""
from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from cli import tables as cli_tables
from llm4llm import progress
from llm4llm.scale import scale_options

# click's plain help: it wraps the help text and never cuts an option's name (rich's panels do at 80 columns)
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Deployment-aware, closed-loop optimizer of GPU kernels for language-model inference.")
# Wide enough for the hotspot table when the output is not a terminal (CI logs, pipes).
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

DbOpt = typer.Option(None, "--db", help="DuckDB file (default $LLM4LLM_DB or $LLM4LLM_HOME/llm4llm.duckdb)")
DataOpt = typer.Option(None, "--data-dir", help="artifact dir (default $LLM4LLM_HOME or ./.llm4llm)")
TaskRunnerOpt = typer.Option("local", "--task-runner",
                             help="local: searches in this process on the workload's device | ray: one search per "
                                  "Ray task, one GPU each (prefect-ray; docs/scale-out.md)")
RayAddressOpt = typer.Option(None, "--ray-address",
                             help="with --task-runner ray: 'auto' (this machine's cluster), 'ray://HEAD:10001', or "
                                  "unset for a local Ray instance")
RayGpusOpt = typer.Option(1.0, "--ray-gpus-per-eval", help="with --task-runner ray: GPUs per search (0: CPU workloads)")
RUN_HELP = "run id, whole or shortened as `llm4llm runs` shows it, or its last 6 characters (default: latest)"

# The choices of the options that take one, as their help lists them (llm4llm.config's Literals, which a test keeps
# these equal to; not imported here, so `--help` stays fast)
MODES = ("episodic", "sample", "iter")
PROPOSERS = ("library", "llm", "hybrid")
GRAPHS = ("auto", "on", "off")
METRICS = ("auto", "logits_rel_l2_floor", "logits_rel_l2", "logits_max_abs")
MODE_HELP = ("episodic: episodes that restart from the task and what earlier ones learned; sample: independent "
             "samples; iter: one refinement chain")
PROPOSER_HELP = "where candidates come from: the template library, an LLM, or both"


def _choices(names: tuple[str, ...]) -> str:
    return "[" + "|".join(names) + "]"


def _quiet_prefect(verbose: bool) -> None:
    from kernels_runtime.interp import interpret_without_gpu

    interpret_without_gpu()
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect's 20 s default for starting its ephemeral API server is missed on a busy 2-core machine
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    if not verbose:  # a failed run's own error is printed once by _user_errors; Prefect's tracebacks only with -v
        import logging

        for name in ("prefect.flow_runs", "prefect.task_runs", "prefect.flow_engine", "prefect.task_engine"):
            logging.getLogger(name).addFilter(_NoTracebacks())


def _optimize_flow():
    """The optimize flow, imported once the flags are checked (a bad one costs no flow import and starts no
    server), while Prefect's ephemeral API boots beside the import (`_boot_prefect_api`)."""
    api_ready = _boot_prefect_api()
    from flows.optimize import optimize_workload

    api_ready()
    return optimize_workload


def _boot_prefect_api():
    """Prefect's ephemeral API server (no PREFECT_API_URL set), started in a thread now, so that its boot (a uvicorn
    subprocess, several seconds) overlaps the flow's imports, which the run's time budget counts; returns the wait
    that joins it before the flow's first client call. Prefect's client finds the same server started. One that
    fails to start here is started again, and its failure reported, by that client."""
    import threading

    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return lambda: None
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()

    def boot() -> None:
        try:
            server.start()
        except Exception:  # noqa: BLE001 - start() leaves it stopped; the client's own start says why
            pass

    thread = threading.Thread(target=boot, name="llm4llm-prefect-api", daemon=True)
    thread.start()
    return thread.join


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
    except RuntimeError as e:
        if "ephemeral Prefect API server" not in str(e):
            raise
        err_console.print("[bold red]error:[/] Prefect's ephemeral API server did not start within "
                          f"{os.environ.get('PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS', '20')} s; raise "
                          "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS or set PREFECT_API_URL to a running "
                          "server (`prefect server start`)")
        raise typer.Exit(2) from None


def _db(db: Optional[Path]):
    """The database, read-only: a reader never creates a file, and lets a running flow write between its queries."""
    from storage.db import Database, DatabaseError

    try:
        return Database(db, read_only=True)
    except DatabaseError as e:
        err_console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2) from None


def _check_db_path(db: Optional[Path]) -> None:
    """Before a command that writes starts its flow: a --db whose directory cannot be created is one error line
    (inside the flow it would be a Prefect traceback)."""
    from storage.db import check_path, default_db_path

    check_path(db.resolve() if db else default_db_path())


def _check_workload(workload: Path) -> None:
    """Before a command that runs a workload starts its flow: a bad workload TOML is one error line at once, not
    after Prefect's API server has started (the flow validates it again where it runs)."""
    from llm4llm.workload import load_workload

    load_workload(workload)


def _df_table(df, title: str, columns: list[str] | None = None, floats: int = 3,
              headers: dict[str, str] | None = None, whole: tuple[str, ...] = ()) -> Table:
    return cli_tables.df_table(df, title, columns, floats, headers, whole, width=_width())


def _width() -> int:
    """The columns a table may use: $COLUMNS where set (also when the output is not a terminal), else the
    console's width (the terminal's, or 160 for CI logs and pipes)."""
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else console.width


def _print_table(table: Table) -> None:
    console.print(table, width=_width())


def _print_hotspots(profile_path: str, top: int) -> None:
    from llm4llm.profiler import format_hotspots
    from llm4llm.stages.profile import load_profile

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
        _check_db_path(db)
        _check_workload(workload)
        from flows.profiling import profile_workload

        with progress.rich_progress(console):
            out = profile_workload(str(workload), db_path=str(db) if db else None,
                                   data_dir=str(data_dir) if data_dir else None, refresh=refresh)
        console.print(f"run [bold]{out.run_id}[/]")
        _print_hotspots(out.profile_path, top)


GRAPHS_HELP = ("GPU: the one-token decode steps replay from CUDA graphs (kernels_runtime.graphs): decode candidates "
               "timed by GPU time under graph replay, acceptance gates them like a patch (logits, then delta), the "
               "bundle ships with them. auto: on when all decode state sits in a static-address cache (Mamba, "
               "Mamba2), a KV cache swapped for the static cache (Llama, Qwen3, RecurrentGemma's attention) or on "
               "modules with a state adapter (RecurrentGemma's recurrent blocks)")


def _default(path: str):
    """A run setting's default, as llm4llm/config.py's OptimizeConfig declares it (the flags do not restate it)."""
    from llm4llm.config import setting_default

    return setting_default(path)


@app.command()
def optimize(workload: Path = typer.Argument(..., help="workload TOML"), db: Optional[Path] = DbOpt,
             data_dir: Optional[Path] = DataOpt,
             stages: str = typer.Option("profile,extract,search,accept,evaluate", help="comma-separated stages"),
             time_budget: str = typer.Option(
                 "8m", "--time-budget",
                 help="wall-clock budget of the whole run, e.g. 8m, 90s, 1h, or off: the plan ranks tasks by "
                      "expected end-to-end saving and splits the search's share over them"),
             budget: Optional[int] = typer.Option(None, help="trials per task (default: the plan's, at most the "
                                                            "planner's cap)"),
             mode: str = typer.Option(_default("search.mode"), metavar=_choices(MODES), help=MODE_HELP),
             proposer: str = typer.Option(_default("search.proposer"), metavar=_choices(PROPOSERS),
                                          help=PROPOSER_HELP),
             top: Optional[int] = typer.Option(
                 None, help="search the top-N covered tasks by hotspot score (default: the plan's targets)"),
             family: Optional[list[str]] = typer.Option(
                 None, help="search only tasks of this family (repeatable; before --top), e.g. norm, ssm_mixer"),
             phase: Optional[list[str]] = typer.Option(
                 None, help="search only tasks of this phase (repeatable; before --top): prefill | decode"),
             delta: float = typer.Option(_default("accept.delta"), help="minimum end-to-end gain to accept a patch"),
             accept_metric: str = typer.Option(
                 _default("accept.metric"), metavar=_choices(METRICS),
                 help="in-model correctness metric (auto: logits_rel_l2_floor for 16-bit models, logits_rel_l2 for "
                      "fp32)"),
             accept_tol_factor: float = typer.Option(_default("accept.tol_factor"), help="fixed rel-L2 limit = factor x the dtype's rtol"),
             accept_floor_factor: float = typer.Option(
                 _default("accept.floor_factor"), help="logits_rel_l2_floor: per-step limit = max(fixed limit, factor x the model's own "
                           "16-bit-vs-fp32 noise floor)"),
             accept_min_task_speedup: float = typer.Option(
                 _default("accept.min_task_speedup"), help="on the GPU, a candidate no faster than this in its task is rejected without an "
                           "in-model trial (0: try every candidate)"),
             accept_noisy_rounds: int = typer.Option(
                 _default("accept.noisy_rounds"), help="when the baseline drifts by more than delta around a trial, measure this many more "
                         "(trial, baseline) pairs alternately and decide on the median bracketed gain (0: the drift "
                         "itself is the bar)"),
             accept_interleave_rounds: int = typer.Option(
                 _default("accept.interleave_rounds"), help="GPU: time each trial and the current bundle alternately in this many rounds (each on its "
                         "own weight-sharing model copy) and decide on the median per-round gain (0: the bracket)"),
             decode_graphs: str = typer.Option(_default("graphs.decode_graphs"), metavar=_choices(GRAPHS),
                                               help=GRAPHS_HELP),
             min_score: float = typer.Option(_default("search.min_score"), help="skip colder modules at extraction"),
             llm_model: Optional[str] = typer.Option(None, help="litellm model string (proposer llm/hybrid)"),
             llm_api_base: Optional[str] = typer.Option(None),
             e2e_variants: Optional[str] = typer.Option(
                 None, help="variants the evaluate stage runs, in order (default: eager,patched,torch_compile; with "
                            "decode graphs eager,patched_graphs,eager_graphs,patched,torch_compile)"),
             e2e_max_s: Optional[float] = typer.Option(None, "--e2e-max-s", min=0.001,
                                                       help="time budget (s) for the evaluate stage's rounds"),
             rounds: int = typer.Option(_default("search.rounds"), help="search+accept rounds: rejected tasks are searched again"),
             task_runner: str = TaskRunnerOpt, ray_address: Optional[str] = RayAddressOpt,
             ray_gpus_per_eval: float = RayGpusOpt,
             refresh: bool = typer.Option(False, help="ignore cached results"),
             sets: Optional[list[str]] = typer.Option(
                 None, "--set", metavar="SECTION.KEY=VALUE",
                 help="any run setting by its path in llm4llm/config.py's OptimizeConfig, after the flags "
                      "(repeatable), e.g. --set search.budget=30 --set evaluate.batch_sizes=[1,8,32]"),
             verbose: bool = typer.Option(False, "-v", "--verbose")) -> None:
    """Run the closed loop on a workload: profile -> extract -> plan -> search -> accept -> evaluate."""
    started = time.time()
    _quiet_prefect(verbose)
    with _user_errors():
        _check_graphs(decode_graphs, e2e_variants)
        scale = scale_options(task_runner, ray_address, ray_gpus_per_eval)
        cfg = _config({
            "stages": [s.strip() for s in stages.split(",")], "refresh": refresh,
            "time_budget_s": _duration("--time-budget", time_budget),
            "search": {"mode": mode, "budget": budget, "proposer": proposer, "top": top,
                       "families": list(family) if family else None,
                       "phases": list(phase) if phase else None, "rounds": rounds, "min_score": min_score},
            "accept": {"delta": delta, "metric": accept_metric, "tol_factor": accept_tol_factor,
                       "floor_factor": accept_floor_factor, "min_task_speedup": accept_min_task_speedup,
                       "noisy_rounds": accept_noisy_rounds, "interleave_rounds": accept_interleave_rounds},
            "graphs": {"decode_graphs": decode_graphs},
            "scale": scale.model_dump(),
            "evaluate": {"variants": [v.strip() for v in e2e_variants.split(",")] if e2e_variants else None,
                         "max_s": e2e_max_s}}, sets or [])
        if cfg.search.proposer != "library":
            cfg.llm = _llm_options(workload, llm_model, llm_api_base)
        _print_run(_run_optimize(_optimize_flow(), workload, cfg, db, data_dir, started), db)


def _run_optimize(optimize_workload, workload: Path, cfg, db: Optional[Path], data_dir: Optional[Path],
                  started: float):
    """The flow with progress on the console, its budget counted from `started`; Ctrl-C ends it with what it
    leaves (exit 130)."""
    from llm4llm.planner import RUN_STARTED

    _check_db_path(db)
    _check_workload(workload)
    token = RUN_STARTED.set(started)
    try:
        with progress.rich_progress(console):
            return optimize_workload(str(workload), cfg, db_path=str(db) if db else None,
                                     data_dir=str(data_dir) if data_dir else None, kind="cli")
    except KeyboardInterrupt:
        _print_interrupted(db, started)
        raise typer.Exit(130) from None
    finally:
        RUN_STARTED.reset(token)


def _duration(flag: str, text: str) -> float | None:
    from llm4llm.errors import Llm4llmError
    from llm4llm.planner import parse_duration

    try:
        return parse_duration(text)
    except ValueError as e:
        raise Llm4llmError(f"{flag}: {e}") from None


def _print_interrupted(db: Optional[Path], started: float) -> None:
    """Ctrl-C: what the run leaves (the bundle of its last finished acceptance step, if any) and how to use it."""
    from storage import repo

    try:
        with _db(db) as d:
            path = repo.newest_bundle_since(d, started)
    except Exception:  # noqa: BLE001 - the database may be mid-write: say so rather than fail again
        path = None
    err_console.print(f"stopped after {time.time() - started:.0f} s.")
    if path:
        err_console.print(f"bundle accepted so far: {path}\ninstall: kernels_runtime.apply(model, {path!r})",
                          highlight=False)
    else:
        err_console.print("no bundle was accepted before the stop.")


def _print_run(out, db: Optional[Path]) -> None:
    """What an optimize run did (its OptimizeResult, llm4llm.outcome): its id, graphs, hotspots, tasks, searches,
    acceptance decisions and e2e table."""
    console.print(f"run [bold]{out.run_id}[/]")
    if out.decode_graphs:
        console.print(f"decode graphs: {out.decode_graphs}")
    _print_hotspots(out.profile_path, 15)
    if out.tasks is not None:
        _print_tasks(db, out.run_id)
    for r in out.searches:
        console.print(f"search {r.task_id}: {r.trials} trials, pass rate {r.pass_rate:.0%}, "
                      f"best utility {r.best_utility}")
    if out.acceptance is not None:
        a = out.acceptance
        console.print(f"acceptance ({a.timing}, {a.metric}): {a.accepted} accepted, "
                      f"{a.rejected} rejected; bundle {out.bundle}")
        if a.floor:
            console.print(f"  noise {a.floor}")
        _print_decisions(db, out.run_id)
    if out.e2e is not None:  # the server owner's view: ms a step, tokens/s, the ratios, the step over its floor
        _print_points(out.e2e.rows)
    for line in out.summary:
        console.print(line, highlight=False, soft_wrap=True)


# OptimizeConfig fields whose CLI flag is not --<field> (an error names the flag the user typed)
_FLAGS = {("time_budget_s",): "--time-budget", ("search", "families"): "--family", ("search", "phases"): "--phase", ("search", "min_score"): "--min-score",
          ("graphs", "decode_graphs"): "--decode-graphs", ("evaluate", "variants"): "--e2e-variants",
          ("evaluate", "max_s"): "--e2e-max-s",
          ("stages",): "--stages"}


def _config(values: dict, sets: list[str] = ()):
    """The run's OptimizeConfig from the flags, then the `--set` overrides; a value it refuses is one error line
    naming the flag (exit 2)."""
    from pydantic import ValidationError

    from llm4llm.config import OptimizeConfig, apply_sets
    from llm4llm.errors import Llm4llmError

    try:
        values = apply_sets(values, list(sets))
    except ValueError as e:
        raise Llm4llmError(str(e)) from None
    try:
        return OptimizeConfig.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(str(x) for x in err["loc"] if not isinstance(x, int))
        flag = _FLAGS.get(loc[:2]) or _FLAGS.get(loc[:1]) or (
            "--accept-" + loc[1].replace("_", "-") if loc[0] == "accept" else "--" + loc[-1].replace("_", "-"))
        raise Llm4llmError(f"{flag}: {err['msg']}, got {err.get('input')!r}") from None


def _print_decisions(db: Optional[Path], run_id: str) -> None:
    """Why each patch (and the decode-graphs gate) was accepted or rejected, in the order tried."""
    from storage import report_queries

    with _db(db) as d:
        df = report_queries.acceptances(d, run_id)
    for r in df.itertuples():
        gain = f" {r.gain:+.1%}" if r.gain is not None and r.gain == r.gain else ""
        console.print(f"  {r.decision} {r.task_id} {r.candidate_id}{gain}: {r.reason}", highlight=False)


def _check_graphs(decode_graphs: str, e2e_variants: str | None) -> None:
    """--decode-graphs and --e2e-variants: one error line (exit 2) that lists the choices, before any flow starts."""
    from llm4llm.errors import Llm4llmError
    from llm4llm.graph_plan import GRAPH_CHOICES

    if decode_graphs not in GRAPH_CHOICES:
        raise Llm4llmError(f"--decode-graphs: expected one of {', '.join(GRAPH_CHOICES)}, got {decode_graphs!r}")
    _check_variants("--e2e-variants", e2e_variants)


def _check_variants(option: str, variants: str | None) -> None:
    """An evaluate variant list: one error line (exit 2) before anything is built or measured."""
    from llm4llm.errors import Llm4llmError
    from llm4llm.evaluate import ALL_VARIANTS

    bad = [v.strip() for v in (variants or "").split(",") if v.strip() and v.strip() not in ALL_VARIANTS]
    if bad:
        raise Llm4llmError(f"{option}: expected names from {', '.join(ALL_VARIANTS)}, got {bad}")


def _check_kb_device(device: str) -> None:
    """KernelBench times on a GPU by default: on a host without one that is one line, before any flow starts."""
    import re

    from llm4llm.errors import DeviceError
    from llm4llm.workload import device_problem

    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise DeviceError(f"--device: expected cuda, cuda:N or cpu, got {device!r}")
    problem = device_problem(device)
    if problem:
        raise DeviceError(f"kernelbench --device {device}: {problem}; pass --device cpu to check correctness only "
                          "(Triton's interpreter, nothing timed)")


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
    from storage import repo

    path = repo.run_workload_path(d, run_id)
    return Path(path) if path else None


def _print_e2e(rows: list) -> None:
    """The e2e rows (E2ERow, or dicts of their fields) as a table, as many columns as the terminal holds, an empty
    value as '-'."""
    import pandas as pd

    from llm4llm.evaluate import table_rows

    df = pd.DataFrame(table_rows(rows))
    cols, headers = cli_tables.e2e_view(df, _width())
    _print_table(_df_table(df, "end to end", cols, headers=headers, whole=("variant", *cli_tables.RATIOS)))
    for line in cli_tables.e2e_notes(df, cols):
        console.print(f"  {line}", highlight=False)


def _sizes(option: str, text: Optional[str]) -> Optional[tuple[int, ...]]:
    """A comma-separated list of sizes >= 1; one error line (exit 2) otherwise."""
    from llm4llm.errors import Llm4llmError

    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or not all(t.isdigit() and int(t) > 0 for t in items):
        raise Llm4llmError(f"{option}: expected comma-separated whole numbers >= 1, got {text!r}")
    return tuple(int(t) for t in items)


def _points(workload: Path, batch_sizes: Optional[str], prompt_lens: Optional[str]) -> tuple:
    """--batch-sizes and --prompt-lens as sizes (`regime`: the workload regime's batch buckets), checked against the
    workload: one error line (exit 2) before anything is built."""
    from llm4llm.errors import Llm4llmError
    from llm4llm.evaluate import too_long
    from llm4llm.workload import load_workload

    if batch_sizes is None and prompt_lens is None:
        return None, None
    wl = load_workload(workload)
    if batch_sizes is not None and batch_sizes.strip() == "regime":
        if wl.regime is None:
            raise Llm4llmError(f"--batch-sizes regime: expected a workload that declares a regime, got none in "
                               f"{workload}")
        sizes = wl.regime.batch_buckets()
    else:
        sizes = _sizes("--batch-sizes", batch_sizes)
    prompts = _sizes("--prompt-lens", prompt_lens)
    long = too_long(wl, prompts or ())
    if long:
        raise Llm4llmError(f"--prompt-lens: expected prompt lengths + decode_len ({wl.decode_len}) within the model's "
                           f"positions, got {long}")
    return sizes, prompts


def _print_points(rows: list) -> None:
    """The e2e rows (E2ERow, or dicts of their fields) of several (batch, prompt) points as one table, point by
    point; notes under it."""
    import pandas as pd

    from llm4llm.evaluate import point_rows, row_dicts

    rows = row_dicts(rows)

    headers = {"batch_size": "batch", "prompt_len": "prompt", "ms_per_step": "ms/step", "tokens_per_s": "tok/s",
               "vs_compile": "vs compile", "vs_eager": "vs eager", "x_floor": "x floor"}
    df = pd.DataFrame(point_rows(rows))
    _print_table(_df_table(df, "end to end per point", headers=headers,
                           whole=("variant", "ms_per_step", "vs_compile", "vs_eager")))
    console.print("  ms/step: a decode step, median (p20-p80) over the rounds; tok/s: batch x decoded tokens / decode "
                  "time; x floor: the step's GPU time (graph variants) over weights + KV cache read at the measured "
                  "copy bandwidth", highlight=False)
    for r in sorted(rows, key=lambda r: (r.get("prompt_len") or 0, r.get("batch_size") or 0)):
        if r.get("notes"):
            console.print(f"  {r.get('batch_size')}x{r.get('prompt_len')} {r['variant']}: {r['notes']}",
                          highlight=False)


@app.command()
def search(task: Optional[list[str]] = typer.Option(None, "--task", help="task id (repeatable; default: all)"),
           run: Optional[str] = typer.Option(None, "--run", help=RUN_HELP),
           budget: Optional[int] = typer.Option(None, help="trials per task (default: the planner's cap)"),
           mode: str = typer.Option(_default("search.mode"), metavar=_choices(MODES), help=MODE_HELP),
           proposer: str = typer.Option(_default("search.proposer"), metavar=_choices(PROPOSERS),
                                        help=PROPOSER_HELP),
           device: Optional[str] = typer.Option(None, help="default: the run's device"),
           top: Optional[int] = typer.Option(None, help="only the top-N tasks by score"),
           timeout_s: float = typer.Option(_default("search.timeout_s"), help="per-candidate wall-clock limit"),
           decode_timing: str = typer.Option(
               _default("search.decode_timing"), help="launch: decode candidates timed back to back | graph: by GPU time under CUDA-graph "
                              "replay (what `optimize` uses when the model's decode steps run from graphs) | "
                              "graph_prefill: prefill candidates too (Mamba, Mamba2: their prompt forward is "
                              "graphed as well)"),
           llm_model: Optional[str] = typer.Option(None), llm_api_base: Optional[str] = typer.Option(None),
           task_runner: str = TaskRunnerOpt, ray_address: Optional[str] = RayAddressOpt,
           ray_gpus_per_eval: float = RayGpusOpt,
           db: Optional[Path] = DbOpt, data_dir: Optional[Path] = DataOpt,
           verbose: bool = typer.Option(False, "-v", "--verbose")) -> None:
    """Search Triton candidates for the tasks of a run (episodic with restart by default)."""
    _quiet_prefect(verbose)
    with _user_errors():
        from flows.search import search_flow
        from llm4llm.errors import Llm4llmError, TaskError
        from llm4llm.verify.worker import DECODE_TIMINGS
        from storage import repo

        _check_proposer(proposer)
        if decode_timing not in DECODE_TIMINGS:
            raise Llm4llmError(f"--decode-timing: expected one of {', '.join(DECODE_TIMINGS)}, got {decode_timing!r}")
        settings = _config({"search": {"mode": mode, "budget": budget, "proposer": proposer, "top": top,
                                       "timeout_s": timeout_s, "decode_timing": decode_timing}}).search
        scale = scale_options(task_runner, ray_address, ray_gpus_per_eval)
        with _db(db) as d:
            run = _resolve_run(d, run)
            info = repo.get_run(d, run) if run else None
            workload_path = _run_workload_path(d, run) if info is not None else None
        if info is None:
            raise TaskError(f"run: expected an existing run id (see `llm4llm runs`), got {run!r}")
        # The run's workload file supplies the [llm] table when it is still where it was profiled from.
        llm = _llm_options(workload_path, llm_model, llm_api_base) if proposer != "library" else None
        with progress.rich_progress(console):
            results = search_flow(scale)(run, settings=settings, db_path=str(db) if db else None,
                                   data_dir=str(data_dir) if data_dir else None,
                                   device=device or ("cuda" if info["device"] == "cuda" else "cpu"),
                                   task_ids=task or None, llm=llm, scale=scale)
        for r in results:
            console.print(f"{r.task_id}: {r.trials} trials, pass rate {r.pass_rate:.0%}, best utility "
                          f"{r.best_utility}, best {r.best_candidate}")
            if r.llm_backed:
                cost = f", ${r.llm_cost_usd:.4f}" if r.llm_cost_usd else ""
                console.print(f"  llm: {r.llm_calls} calls, {r.llm_tokens} tokens{cost}"
                              + (f"; stopped: {r.llm_exhausted}" if r.llm_exhausted else ""))


@app.command()
def evaluate(workload: Path = typer.Argument(..., help="workload TOML"),
             bundle: Optional[Path] = typer.Option(None, help="patch bundle dir for the patched variant"),
             repeats: int = typer.Option(7, help="interleaved rounds: one timed run of every variant per round"),
             max_s: Optional[float] = typer.Option(None, "--max-s", min=0.001,
                                                   help="time budget (s) for the rounds: fewer rounds on a slow host, "
                                                        "the decode step still measured"),
             db: Optional[Path] = DbOpt,
             variants: str = typer.Option(
                 "eager,patched,torch_compile",
                 help="comma-separated: eager, patched (kernels only), torch_compile; on a GPU also "
                      "eager_graphs, patched_graphs (decode steps replayed from CUDA graphs); liger "
                      "(Liger-Kernel's patch of the architecture, where installed and supported)"),
             batch_sizes: Optional[str] = typer.Option(
                 None, "--batch-sizes", help="comma-separated batch sizes to measure at (e.g. 1,8,32), or `regime`: "
                                             "the batch buckets of the workload's [regime] (default: its batch_size)"),
             prompt_lens: Optional[str] = typer.Option(
                 None, "--prompt-lens", help="comma-separated prompt lengths (default: the workload's prompt_len); "
                                             "each batch is padded as the workload's [regime] says"),
             verbose: bool = typer.Option(False, "-v", "--verbose")) -> None:
    """End to end, in one process, interleaved: eager vs torch.compile (HF static-cache compiled generate) vs patched;
    each ratio is taken round by round and shown as median (p20-p80). With --batch-sizes / --prompt-lens, at each
    (batch, prompt) point: ms per decode step, decode tokens/s and the step's GPU time over its HBM floor too."""
    _quiet_prefect(verbose)
    with _user_errors():
        _check_db_path(db)
        from llm4llm.config import EvaluateSettings
        from llm4llm.stages.evaluate import evaluate_recorded
        from storage.store import Store

        _check_variants("--variants", variants)
        if bundle is not None:  # an explicitly requested bundle fails loudly, before anything is built
            from kernels_runtime.bundle import BundleError, load_bundle
            from llm4llm.errors import TaskError

            try:
                load_bundle(bundle)
            except (BundleError, OSError) as e:
                raise TaskError(f"bundle {bundle}: expected a readable patch bundle, got {e}") from e

        sizes, prompts = _points(workload, batch_sizes, prompt_lens)
        with console.status(f"evaluating {workload} ..."):
            settings = EvaluateSettings(repeats=repeats, variants=[v.strip() for v in variants.split(",") if v.strip()],
                                        max_s=max_s, batch_sizes=list(sizes) if sizes else None,
                                        prompt_lens=list(prompts) if prompts else None)
            out = evaluate_recorded(str(workload), Store(str(db) if db else None), settings,
                                    bundle=str(bundle) if bundle else None)
        if sizes or prompts:
            _print_points(out.rows)
        else:
            _print_e2e(out.rows)


@app.command()
def watch(paths: list[Path] = typer.Argument(..., help="workload files or directories"),
          state: Optional[Path] = typer.Option(None, help="the last content hash seen per workload (default "
                                                          "$LLM4LLM_HOME/watch-state.json)"),
          debounce_ms: int = typer.Option(1600, help="a burst of writes within this many ms is one change"),
          initial: bool = typer.Option(False, help="also emit for workloads the state has never seen"),
          dry_run: bool = typer.Option(False, "--dry-run", help="print the changes, emit nothing (no Prefect "
                                                                "server needed)")) -> None:
    """Emit a Prefect event (llm4llm.workload.changed) whenever a workload's config or inference script really
    changes (the hash of the parsed TOML and of the script: a touch or a comment-only edit emits nothing). The
    `optimize-workload/on-change` deployment (python -m deployments.serve) runs on it; set PREFECT_API_URL."""
    with _user_errors():
        from deployments.triggers import api_url, emit, start_line, watch as _watch
        from llm4llm.errors import Llm4llmError
        from storage.db import data_home

        target = None if dry_run else api_url()
        if not dry_run and target is None:
            raise Llm4llmError("watch: expected PREFECT_API_URL (the server the on-change deployment listens on), "
                               "got none: run `prefect server start` and export PREFECT_API_URL=http://127.0.0.1:"
                               "4200/api, or pass --dry-run")
        state = state or data_home() / "watch-state.json"
        console.print(start_line(paths, state, target), highlight=False, soft_wrap=True)

        def on_change(fields: dict) -> None:
            p = fields["payload"]
            what = f"{p['path']} changed ({p['previous_hash']} -> {p['content_hash']})"
            if dry_run:
                console.print(f"{what}: not emitted (--dry-run)", highlight=False, soft_wrap=True)
                return
            try:
                emit(fields)
            except Exception as e:  # noqa: BLE001 - a server that went away: say so, keep watching
                console.print(f"{what}: NOT emitted ({type(e).__name__}: {' '.join(str(e).split())[:200]})",
                              highlight=False, soft_wrap=True)
                return
            console.print(f"{what}: emitted {fields['event']}", highlight=False, soft_wrap=True)

        _watch([str(p) for p in paths], state, on_change, debounce_ms, initial)


def _resolve_run(d, run: Optional[str]) -> Optional[str]:
    """The run `--run` names: a full id, a shortened one as `llm4llm runs` prints it, or the id's unique tail; the
    latest run when none is given. One that names no single run is one error line (exit 2)."""
    from llm4llm.errors import TaskError
    from storage import repo

    if run is None:
        return repo.latest_run_id(d)
    found = repo.resolve_run_id(d, run, cli_tables.id_pattern(run))
    if found is None:
        raise TaskError(f"run: expected an existing run id (see `llm4llm runs`), got {run!r}")
    return found


def _print_tasks(db: Optional[Path], run_id: Optional[str]) -> None:
    """The run's tasks, with as many columns as the terminal holds; a task id is never folded."""
    from storage import repo

    with _db(db) as d:
        run_id = _resolve_run(d, run_id)
        if run_id is None:
            console.print("no runs yet: run `llm4llm profile WORKLOAD` first")
            return
        df = repo.task_rows(d, run_id)
    if df.empty:
        console.print(f"run {run_id} has no tasks: its extract stage has not run", highlight=False)
        return
    cols, headers = cli_tables.tasks_view(df, _width())
    dtypes = sorted(set(df["dtype"])) if "dtype" not in cols else []
    title = f"tasks of run {run_id}" + (f" ({', '.join(dtypes)})" if dtypes else "")
    _print_table(_df_table(df, title, cols, headers=headers))
    _print_coverage(db, run_id)


def _print_coverage(db: Optional[Path], run_id: str) -> None:
    """Which built-in templates cover each task (decided by running them on its captured calls), which were found
    inapplicable and why, what was tried and accepted, and the share of each phase an accepted patch covers."""
    import pandas as pd

    from llm4llm.coverage import coverage_of_run
    from storage.store import Store

    cov = coverage_of_run(run_id, Store(str(db) if db else None))
    rows = [r for r in cov["tasks"] if r["status"] != "not checked"]  # tasks no search reached are not listed
    if not rows:
        return
    _print_table(_df_table(pd.DataFrame(rows), f"template coverage of run {run_id}"))
    for phase, share in cov["phases"].items():
        console.print(f"  {phase}: {100 * share:.1f}% of the phase's time is covered by accepted patches")


@app.command("tasks")
def tasks_cmd(run: Optional[str] = typer.Option(None, "--run", help=RUN_HELP),
              db: Optional[Path] = DbOpt) -> None:
    """List the extracted tasks of a run."""
    with _user_errors():
        _print_tasks(db, run)


@app.command()
def runs(db: Optional[Path] = DbOpt, limit: int = typer.Option(20)) -> None:
    """List recent runs, as many columns as the terminal holds. A run id too long for it is shortened in the middle
    (`--run` takes it as shown); at 140 columns and up every id is whole."""
    from storage import repo

    with _db(db) as d:
        df = repo.list_runs(d, limit)
    df, cols, headers = cli_tables.runs_view(df, _width())
    _print_table(_df_table(df, "runs", cols, floats=1, headers=headers, whole=("started",)))


def _write_report(db_path: str | Path | None, run: str | None = None, workload: str | None = None,
                 out: str | Path | None = None) -> tuple[Path, str]:
    """Render the report of `run` (or of `workload`'s latest optimized run) to `out` (default
    `<data home>/reports/<run>.html`); returns (path, run_id). Opens the database read-only."""
    from llm4llm.report import render_report
    from storage import report_queries
    from storage.db import Database, data_home

    with Database(db_path, read_only=True) as db:
        run_id = report_queries.resolve_run(db, run, workload)
        if run_id is None:
            what = f"run {run!r}" if run else (f"workload {workload!r}" if workload else "any run")
            raise LookupError(f"{what}: nothing in {db.path} (see `llm4llm runs`)")
        page = render_report(report_queries.ReportReader(db), run_id)
    path = Path(out) if out else data_home() / "reports" / f"{run_id}.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path, run_id


@app.command()
def report(run: Optional[str] = typer.Argument(None, help="run id or KernelBench run id (default: the latest "
                                                           "optimized run)"),
           workload: Optional[str] = typer.Option(
               None, "--workload", help="workload name or TOML file: its latest optimized run, with its history"),
           out: Optional[Path] = typer.Option(None, "--out", help="HTML file (default $LLM4LLM_HOME/reports/RUN.html)"),
           db: Optional[Path] = DbOpt) -> None:
    """Write a self-contained HTML report of a run: hotspots, speedups, search curves, acceptance, e2e, history; of
    a KernelBench run: its geo-means with their spread, the degenerate problems apart and the search-mode ablation."""
    with _user_errors():
        from llm4llm.errors import Llm4llmError

        if workload and workload.endswith(".toml") and Path(workload).is_file():
            from llm4llm.workload import load_workload

            workload = load_workload(workload, check_device=False).name
        try:
            path, run_id = _write_report(db, run=run, workload=workload, out=out)
        except (LookupError, RuntimeError) as e:  # no such run; a database that cannot be opened
            raise Llm4llmError(str(e)) from e
        console.print(f"report of run [bold]{run_id}[/]: {path}")


@app.command()
def sql(query: str = typer.Argument(..., help="a SQL query over the tables (storage/migrations/)"),
        db: Optional[Path] = DbOpt, limit: int = typer.Option(200, help="rows shown at most")) -> None:
    """Run a read-only SQL query on the DuckDB file and print the result."""
    import duckdb

    from storage import repo
    from storage.db import Database

    with _user_errors():
        from llm4llm.errors import Llm4llmError

        try:
            with Database(db, read_only=True) as d:
                df = repo.run_sql(d, query)
        except (duckdb.Error, RuntimeError) as e:
            raise Llm4llmError(f"sql: {e}") from e
        _print_table(_df_table(df.head(limit), f"{len(df)} rows" + (f" (first {limit})" if len(df) > limit else "")))


@app.command()
def export(bundle: Path = typer.Argument(..., help="bundle directory (manifest.json + kernels/)"),
           out_dir: Path = typer.Argument(..., help="where to write the kernels package (new, empty, or an earlier "
                                                    "export)"),
           name: Optional[str] = typer.Option(None, help="kernel name: lowercase letters, digits, dashes (default "
                                                        "llm4llm-<bundle name>)")) -> None:
    """Write a bundle as a Hugging Face `kernels` package (kernelize / LocalLayerRepository load it): its norm, MLP
    and activation patches become layers; the others stay on kernels_runtime.apply, one line each says why."""
    with _user_errors():
        from kernels_runtime.bundle import BundleError
        from kernels_runtime.hub_export import ExportError, Outcome, export_bundle
        from llm4llm.errors import Llm4llmError

        try:
            result = export_bundle(bundle, out_dir, name=name)
        except (BundleError, ExportError) as e:
            raise Llm4llmError(str(e)) from None
        except ImportError as e:
            raise Llm4llmError(f"export: expected the `kernels` package (pip install -e \".[hub]\"), got {e}") from None
        for p in result.patches:
            if p.outcome is Outcome.EXPORTED:
                console.print(f"{p.patch_id}: layer {p.layer}", highlight=False)
            else:
                console.print(f"{p.patch_id}: not exported, {p.reason}", highlight=False)
        console.print(f"kernels package {result.name} ({len(result.layers)} layer(s)): {result.path}", highlight=False)


@app.command()
def kernelbench(directory: Path = typer.Argument(..., help="a folder of KernelBench-format problems"),
                problems: Optional[str] = typer.Option(None, "--problems", help="ids and ranges, e.g. 12,40-60"),
                budget: int = typer.Option(4, help="trials per problem and mode"),
                mode: list[str] = typer.Option(["episodic"], "--mode", help="episodic | sample | iter (repeatable: "
                                                                           "the ablation at equal budget)"),
                proposer: str = typer.Option("library", help="library | llm | hybrid"),
                device: str = typer.Option("cuda", help="cuda | cuda:N | cpu (cpu: correctness only)"),
                timeout_s: float = typer.Option(600.0, help="per-candidate wall-clock limit"),
                run_id: Optional[str] = typer.Option(None, "--run-id", help="kernelbench run id (shards of one run "
                                                                           "share it; default: a new one)"),
                db: Optional[Path] = DbOpt, data_dir: Optional[Path] = DataOpt,
                verbose: bool = typer.Option(False, "-v", "--verbose")) -> None:
    """Run KernelBench problems through the search and the verifier (KernelBench's protocol on top of every gate)."""
    _quiet_prefect(verbose)
    with _user_errors():
        _check_db_path(db)
        import pandas as pd

        from llm4llm.stages.kernelbench import run_kernelbench
        from storage import repo
        from storage.db import data_home
        from storage.store import Store

        _check_proposer(proposer)
        _check_kb_device(device)

        def show(p):  # a llm4llm.kernelbench.run.KernelBenchProblem, as each is recorded
            sp = f"{p.speedup_eager:.3f}x eager" if p.speedup_eager else "untimed"
            sc = f", {p.speedup_compile:.3f}x compile" if p.speedup_compile else ""
            console.print(f"{p.problem} [{p.mode}]: {'pass' if p.passed else 'FAIL'} {sp}{sc} "
                          f"({p.trials} trials{', ' + p.origin if p.origin else ''})"
                          + (f" skipped: {p.skipped_reason}" if p.skipped_reason else ""))

        kb_run_id = run_kernelbench(str(directory), Store(str(db) if db else None), str(data_dir or data_home()),
                                    problems=problems, budget=budget, modes=list(mode), proposer=proposer,
                                    device=device, timeout_s=timeout_s, kb_run_id=run_id, on_problem=show).run_id
        with _db(db) as d:
            summary = repo.kb_summary(d, kb_run_id)
        _print_table(_df_table(pd.DataFrame(summary), f"kernelbench {kb_run_id}"))
        console.print(f"curves and spread: llm4llm report {kb_run_id}" + (f" --db {db}" if db else ""),
                      highlight=False)


def _end_children() -> None:
    """Kill every process below this one (Prefect's ephemeral API server, the script's children, sandboxed
    workers); only descendants, so a Prefect worker that started this command is not touched."""
    from llm4llm.verify.sandbox import descendants

    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _stopped(signum: int, _frame) -> None:
    sys.stderr.write(f"error: stopped by {signal.Signals(signum).name}; ended every process this command started\n")
    sys.stderr.flush()
    _end_children()
    os._exit(128 + signum)


def _install_stop_handlers() -> None:
    """SIGTERM (a scheduler, `kill`) ends the command and everything it started at once: Python's default would
    exit without any cleanup, orphaning Prefect's uvicorn server. Ctrl-C keeps its KeyboardInterrupt (commands
    report what a stopped run kept), and whatever is still running below this process at exit is ended."""
    import atexit

    signal.signal(signal.SIGTERM, _stopped)
    atexit.register(_end_children)


def main() -> None:  # pragma: no cover - `python -m cli` and `python -m llm4llm.cli`
    _install_stop_handlers()
    app(prog_name="llm4llm")  # usage lines name the command, not the module path
