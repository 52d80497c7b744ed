"""Bad input gets exactly one `error:` line, no traceback, exit code 2, and no process left behind (the CLI in a
real subprocess, as a user runs it). Cases checked before any flow starts, so each costs only the CLI's import."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "workloads" / "tiny-llama.toml"


def _workload(tmp_path: Path, old: str | None = None, new: str = "") -> Path:
    text = TINY.read_text().replace('script = "', f'script = "{TINY.parent}/')
    if old is not None:
        assert old in text, old
        text = text.replace(old, new)
    p = tmp_path / "w.toml"
    p.write_text(text)
    return p


def _children() -> set[int]:
    me = str(os.getpid())
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1] == me:
                    out.add(int(d))
            except (OSError, IndexError):
                pass
    return out


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "COLUMNS": "200"}
    before = _children()
    p = subprocess.run([sys.executable, "-m", "llm4llm.cli", *args], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=env)
    assert _children() <= before  # nothing it started is left (as our child or re-parented zombie)
    return p


def _one_error(p: subprocess.CompletedProcess, fragment: str) -> None:
    text = p.stdout + p.stderr
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2, text[-3000:]
    assert len(errors) == 1 and fragment in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.parametrize("case, fragment", [
    ("config_typo", "did you mean 'hidden_size'"),
    ("prompt_too_long", "max_position_embeddings"),
])
def test_bad_workload_is_one_error(tmp_path, case, fragment):
    if case == "config_typo":
        w = _workload(tmp_path, "hidden_size", "hiden_size")
    else:
        import re

        w = _workload(tmp_path)
        w.write_text(re.sub(r"(?m)^prompt_len = \d+", "prompt_len = 100000", w.read_text()))
    _one_error(_cli("profile", str(w), "--db", str(tmp_path / "db.duckdb"), "--data-dir", str(tmp_path / "d")),
               fragment)


@pytest.mark.parametrize("case", ["under_a_file", "a_directory", "garbage_bytes"])
def test_bad_database_path_is_one_error(tmp_path, case):
    if case == "under_a_file":
        (tmp_path / "f").write_text("x")
        db = tmp_path / "f" / "db.duckdb"
    elif case == "a_directory":
        db = tmp_path / "dir.duckdb"
        db.mkdir()
    else:
        db = tmp_path / "junk.duckdb"
        db.write_bytes(os.urandom(8192))
    _one_error(_cli("runs", "--db", str(db)), "database")


def test_an_ephemeral_server_that_does_not_start_is_one_error(capsys):
    """Prefect raises a RuntimeError when its ephemeral API server misses the startup timeout (a loaded machine);
    the CLI says what to set instead of printing Prefect's traceback. Any other RuntimeError is not swallowed."""
    import typer

    from cli import main as cli

    with pytest.raises(typer.Exit) as e, cli._user_errors():
        raise RuntimeError("Timed out while attempting to connect to ephemeral Prefect API server.")
    assert e.value.exit_code == 2
    err = capsys.readouterr()
    text = err.out + err.err
    assert text.count("error:") == 1 and "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in text, text
    with pytest.raises(RuntimeError, match="something else"), cli._user_errors():
        raise RuntimeError("something else")


def test_a_mistyped_database_is_one_error_and_creates_nothing(tmp_path):
    db = tmp_path / "typo.duckdb"
    _one_error(_cli("runs", "--db", str(db)), f"no database at {db}")
    assert not db.exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc: a directory nothing can be created in")
def test_a_database_whose_directory_cannot_be_created_is_one_error(tmp_path):
    p = _cli("profile", str(_workload(tmp_path)), "--db", "/proc/llm4llm-nope/db.duckdb", "--data-dir",
             str(tmp_path / "d"))
    _one_error(p, "cannot create its directory /proc/llm4llm-nope")


@pytest.mark.parametrize("query", ["COPY runs TO 'out.csv'", "EXPORT DATABASE 'dump'", "ATTACH 'other.duckdb'",
                                   "INSTALL httpfs", "SELECT 1; DELETE FROM runs"])
def test_sql_runs_queries_only(tmp_path, monkeypatch, query):
    from typer.testing import CliRunner

    from cli.main import app
    from storage.db import Database

    Database(tmp_path / "db.duckdb").close()
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["sql", query, "--db", str(tmp_path / "db.duckdb")])
    assert res.exit_code == 2 and res.output.count("error:") == 1, res.output
    assert "expected a read-only query" in res.output and "Traceback" not in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db.duckdb"]
    assert CliRunner().invoke(app, ["sql", "SELECT count(*) AS n FROM runs", "--db", "db.duckdb"]).exit_code == 0


def test_watch_without_a_prefect_api_is_one_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_HOME=str(tmp_path / "prefect"))
    p = subprocess.run([sys.executable, "-m", "llm4llm.cli", "watch", str(_workload(tmp_path)), "--state",
                        str(tmp_path / "s.json")], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    _one_error(p, "expected PREFECT_API_URL")
    assert "emitted" not in p.stdout + p.stderr


def test_watch_says_what_it_watches_when_it_starts(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import deployments.triggers as triggers
    from cli.main import app

    started = []
    monkeypatch.setattr(triggers, "watch", lambda paths, state, *a: started.append((paths, state)))
    res = CliRunner().invoke(app, ["watch", str(_workload(tmp_path)), "--dry-run", "--state", str(tmp_path / "s")])
    first = res.output.splitlines()[0]
    assert res.exit_code == 0 and started, res.output
    assert first.startswith("watching 1 workload(s) (tiny-llama) in ") and "dry run" in first, first
    assert str(ROOT / "examples" / "scripts") in first  # the script's directory is watched too


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the host has a GPU: the default device works")
def test_kernelbench_on_a_host_without_a_gpu_is_one_error(tmp_path):
    (tmp_path / "kb").mkdir()
    p = _cli("kernelbench", str(tmp_path / "kb"), "--db", str(tmp_path / "db.duckdb"))
    _one_error(p, "pass --device cpu")
    assert not (tmp_path / "db.duckdb").exists()


def test_a_mistyped_set_is_one_error_naming_the_setting_it_meant(tmp_path):
    """`optimize --set` takes any OptimizeConfig setting by its dotted path; a path that is not one is a single
    error line with the closest settings, a value the setting refuses the setting's own message, before any stage."""
    p = _cli("optimize", str(_workload(tmp_path)), "--set", "search.budgte=3", "--data-dir", str(tmp_path / "d"))
    _one_error(p, "did you mean search.budget")
    p = _cli("optimize", str(_workload(tmp_path)), "--set", "evaluate.batch_sizes=[0]", "--data-dir",
             str(tmp_path / "d"))
    _one_error(p, "expected positive integers")
