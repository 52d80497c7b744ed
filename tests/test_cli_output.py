"""Output sized for a person (issue 40, item 4): `llm4llm runs` and `tasks` fit 80 and 120 columns with every id on
one line, an empty value prints as `-` (never nan, None or <NA>), a shortened run id works as `--run`, and
`optimize --help` at 80 columns lists the choices of its options and cuts no option's name."""
from __future__ import annotations

import re
import typing
from datetime import datetime

import pytest
from typer.testing import CliRunner

from cli.main import app
from storage import repo
from storage.db import Database

WL = {"workload_hash": "h1", "name": "recurrentgemma-2b-it", "path": "/w/recurrentgemma-2b-it.toml",
      "config": {"dtype": "bfloat16"}}
RUNS = ["recurrentgemma-2b-it-20261206T062825-a1b2c3", "recurrentgemma-2b-it-eval-20261206T071500-d4e5f6"]
TASKS = ["recurrent_block-prefill-0123456789ab", "recurrent_block-decode-0123456789ab-2", "norm-decode-ba9876543210"]
EMPTY_WORDS = re.compile(r"\b(nan|NaN|None|NaT)\b|<NA>")


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """Two runs, the second with no GPU, timings or forwards (NULLs), and three tasks, one with no reason."""
    path = tmp_path_factory.mktemp("cli_output") / "db.duckdb"
    with Database(path) as d:
        for i, run_id in enumerate(RUNS):
            full = i == 0
            repo.record_profile_run(d, {
                "run_id": run_id, "workload_hash": WL["workload_hash"], "workload_name": WL["name"],
                "kind": "optimize" if full else "evaluate", "status": "ok", "started_at": datetime(2026, 12, 6, 6 + i),
                "device": "cuda" if full else None, "gpu_name": "NVIDIA H100 80GB HBM3" if full else None,
                "prefill_ms": 31.25 if full else None, "decode_ms": 1650.5 if full else None,
                "prefill_forwards": 1 if full else None, "decode_forwards": 63 if full else None}, WL, [])
        repo.record_tasks(d, RUNS[0], [
            {"task_id": t, "family": t.split("-")[0], "module_class": "transformers.RecurrentGemmaRecurrentBlock",
             "phase": t.split("-")[1], "instances": 26, "shapes": [[1, 1, 2560]], "dtype": "bfloat16",
             "score": 0.5 / (k + 1), "time_ms": None, "deployable": k != 2,
             "reason": None if k != 2 else "no call captured in this phase"} for k, t in enumerate(TASKS)])
    return path


def _invoke(args: list[str], columns: int):
    res = CliRunner().invoke(app, args, env={"COLUMNS": str(columns)})
    assert res.exit_code == 0, res.output
    return res.output


def _check_fits(out: str, columns: int, ids: list[str]) -> None:
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= columns, "\n" + out
    assert not EMPTY_WORDS.search(out), "\n" + out
    for i in ids:  # each id, or its shortened form, whole on some line: never folded over two
        assert any(i in ln for ln in lines), f"{i} not on one line:\n{out}"


@pytest.mark.parametrize("columns", [80, 120])
def test_runs_fit_the_terminal_with_ids_on_one_line(db, columns):
    out = _invoke(["runs", "--db", str(db)], columns)
    shown = ([f"recurrentgemma…{r[-6:]}" for r in RUNS] if columns < 100 else
             ["recurrentgemma-2b-it…a1b2c3", "recurrentgemma-2b-it-eval…d4e5f6"])
    _check_fits(out, columns, shown)
    assert "-" in out.split(shown[1])[1].splitlines()[0]  # the run without timings shows its empties as '-'
    assert RUNS[0] in _invoke(["runs", "--db", str(db)], 160)  # wide enough: whole ids


@pytest.mark.parametrize("columns", [80, 120])
def test_tasks_fit_the_terminal_with_ids_on_one_line(db, columns):
    out = _invoke(["tasks", "--run", RUNS[0], "--db", str(db)], columns)
    _check_fits(out, columns, TASKS + [RUNS[0]])  # the title names the run


def test_a_shortened_run_id_names_its_run(db):
    """The id as `runs` prints it at 80 columns (or with three dots, or just its tail) works as `--run`."""
    short = re.search(r"recurrentgemma…a1b2c3", _invoke(["runs", "--db", str(db)], 80)).group(0)
    for run in (short, short.replace("…", "..."), "a1b2c3"):
        assert TASKS[0] in _invoke(["tasks", "--run", run, "--db", str(db)], 80)


def test_an_unknown_run_is_one_error_and_a_run_without_tasks_says_so(db):
    res = CliRunner().invoke(app, ["tasks", "--run", "nope", "--db", str(db)], env={"COLUMNS": "80"})
    assert res.exit_code == 2 and "expected an existing run id" in res.output, res.output
    out = _invoke(["tasks", "--run", RUNS[1], "--db", str(db)], 80)
    assert f"run {RUNS[1]} has no tasks" in out, out


@pytest.mark.parametrize("columns", [80, 160])
def test_e2e_table_prints_empty_values_as_a_dash(capsys, monkeypatch, columns):
    from cli import main as cli

    monkeypatch.setenv("COLUMNS", str(columns))
    cli._print_e2e([{"variant": "patched_graphs", "prefill_ms": 31.0, "decode_ms_per_token": float("nan"),
                     "total_ms": 80.0, "total_samples_ms": None, "vs_eager": 1.5, "vs_eager_p20": 1.4,
                     "vs_eager_p80": 1.6, "vs_compile": 1.1, "vs_compile_p20": 1.05, "vs_compile_p80": 1.15,
                     "notes": None}])
    out = capsys.readouterr().out
    _check_fits(out, columns, ["patched_graphs", "1.50x (1.40-1.60)", "1.10x (1.05-1.15)"])


def test_optimize_help_lists_choices_and_cuts_no_option_name():
    res = CliRunner().invoke(app, ["optimize", "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    out = res.output
    assert res.exit_code == 0 and max(len(ln) for ln in out.splitlines()) <= 80, out
    assert "…" not in out, out
    for choices in ("[episodic|sample|iter]", "[library|llm|hybrid]", "[auto|on|off]",
                    "[auto|logits_rel_l2_floor|logits_rel_l2|logits_max_abs]"):
        assert choices in out, out
    for name in ("--accept-tol-factor", "--accept-floor-factor", "--accept-min-task-speedup",
                 "--accept-noisy-rounds", "--accept-interleave-rounds", "--ray-gpus-per-eval", "--decode-graphs"):
        assert re.search(rf"(^|\s){re.escape(name)}(\s|$)", out, re.M), f"{name} cut:\n{out}"


def test_the_help_choices_are_the_configs():
    """The choices the help lists are the ones OptimizeConfig accepts."""
    from cli import main as cli
    from llm4llm import config

    assert cli.MODES == typing.get_args(config.SearchMode)
    assert cli.PROPOSERS == typing.get_args(config.ProposerKind)
    assert cli.GRAPHS == typing.get_args(config.GraphChoice)
    assert cli.METRICS == typing.get_args(config.Metric)


def _full_row(variant: str, notes: str) -> dict:
    """An e2e row with every column filled, as a serving evaluation writes it (the notes a patch report)."""
    return {"variant": variant, "prefill_ms": 107.4917, "decode_ms_per_token": 5.0903, "total_ms": 428.1812,
            "total_samples_ms": [422.04, 428.18, 449.10], "vs_eager": 8.25, "vs_eager_p20": 7.795,
            "vs_eager_p80": 8.705, "vs_eager_cpu": 8.258, "vs_eager_cpu_p20": 7.804, "vs_eager_cpu_p80": 8.713,
            "vs_compile": 1.699, "vs_compile_p20": 1.666, "vs_compile_p80": 1.732, "tokens_per_s": 1195.755,
            "gpu_step_ms": 4.2957, "hbm_floor_ms": 2.8457, "peak_mem_mb": 11104.889, "compile_s": 66.658,
            "batch_size": 8, "prompt_len": 512, "decode_ms_p20": 5.05, "decode_ms_p80": 5.24,
            "decode_tokens_per_s": 1257.3, "notes": notes}


@pytest.mark.parametrize("columns", [80, 120, 160, 240])
def test_a_full_e2e_row_keeps_its_numbers_whole(capsys, monkeypatch, columns):
    """Every column filled and a long note (a README run's log at 160 columns once folded each number into
    five-character slivers and a row over thirty lines): the table fits, each shown number is whole on its line,
    and the notes come under the table, one line each."""
    from cli import main as cli

    note = "static cache, compile off; llm4llm patch report (bundle qwen3-4b-serving): 1 applied, 0 skipped; " * 3
    monkeypatch.setenv("COLUMNS", str(columns))
    cli._print_e2e([_full_row("patched_graphs", note), _full_row("torch_compile", None)])
    out = capsys.readouterr().out
    _check_fits(out.split("\n  patched_graphs: ")[0], columns, ["patched_graphs", "5.090", "428.181",
                                                                "1.70x (1.67-1.73)"])
    assert out.count("\n  patched_graphs: static cache") == 1, out
    body = [ln for ln in out.splitlines() if ln.startswith("│")]
    assert len(body) == 2, out  # one line a row
    if columns >= 160:
        assert "8.25x (7.79-8.71)" in out or "8.25x (7.80-8.71)" in out, out


def test_optimize_prints_the_per_point_view(capsys, monkeypatch):
    """optimize's closing table (`_print_run`, an OptimizeResult's e2e rows) is the one `evaluate --batch-sizes`
    prints: batch, prompt, ms a step, tokens/s, the ratios and the step over its floor."""
    from types import SimpleNamespace

    from cli import main as cli

    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.setattr(cli, "_print_hotspots", lambda path, top: None)  # no profile file here
    rows = [_full_row("patched_graphs", "a note"), _full_row("torch_compile", None)]
    cli._print_run(SimpleNamespace(run_id="r", decode_graphs=None, profile_path=None, tasks=None, searches=[],
                                   acceptance=None, e2e=SimpleNamespace(rows=rows), summary=["result: ..."]), None)
    out = capsys.readouterr().out
    assert "end to end per point" in out, out
    _check_fits(out.split("\n  ms/step")[0], 160, ["patched_graphs", "5.09 (5.05-5.24)", "1.70x (1.67-1.73)",
                                                    "1.51x"])
    assert "8x512 patched_graphs: a note" in out, out
