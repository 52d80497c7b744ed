"""The LLM proposer through the product's real entry points: `llm4llm.stages.search.search_recorded` (the search stage with its rows written to DuckDB through storage.store.Store) and the `llm4llm search`
CLI (through the Prefect flow) on a real task extracted from examples/workloads/tiny-llama.toml, against a scripted
local OpenAI-compatible server (tests/llm_server.py). Every trial is a `candidates` row, every request attempt an
`llm_calls` row, the LLM's transcripts sit under the search's archive dir, budgets end the search cleanly, and the
API key (in the environment, where litellm reads it) appears in nothing persisted."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price-table fetch from GitHub on import

sys.path.insert(0, str(Path(__file__).parent))
import llm_server as srv  # noqa: E402

from llm4llm import isolation  # noqa: E402
from llm4llm.config import SearchSettings  # noqa: E402
from llm4llm.stages.common import describe_workload  # noqa: E402
from llm4llm.stages.extract import run_extract  # noqa: E402
from llm4llm.stages.profile import record_run, run_profile  # noqa: E402
from llm4llm.stages.search import make_proposer, search_recorded  # noqa: E402
from storage.db import Database  # noqa: E402
from storage.store import Store  # noqa: E402

WORKLOAD = Path(__file__).resolve().parent.parent / "examples" / "workloads" / "tiny-llama.toml"
KEY = "sk-test-SECRET123"
MODEL = "openai/test-model"


@pytest.fixture(autouse=True)
def _env(monkeypatch, tiny_run):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("LLM4LLM_HOME", str(tiny_run["root"] / "home"))
    for name in list(os.environ):
        if name.startswith("LLM4LLM_LLM_") or name == "LLM4LLM_CORRECTIONS":
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """tiny-llama profiled and extracted (plain stage functions, ~4 s on a CPU) into a tmp data dir and DuckDB."""
    root = tmp_path_factory.mktemp("llmflow")
    data_dir, db_path = root / "data", str(root / "l4l.duckdb")
    profile_path = run_profile(str(WORKLOAD), str(data_dir))
    index_path = run_extract(str(WORKLOAD), profile_path, str(data_dir))
    run_id = record_run(profile_path, describe_workload(str(WORKLOAD)), Store(db_path))
    assert Store(db_path).record_task_index(index_path, run_id) > 0
    index = json.loads(Path(index_path).read_text())
    [norm] = [t for t in index if t["family"] == "norm" and t["phase"] == "prefill" and t["deployable"]]
    # The boundary the scripted kernel is written against (tests/llm_server.py RMSNORM_KERNEL).
    assert (norm["input_names"], norm["weight_names"], norm["output_names"]) == (["hidden_states"], ["weight"],
                                                                                  ["out"])
    assert "variance_epsilon" in norm["static"]
    yield {"root": root, "data_dir": str(data_dir), "db": db_path, "run_id": run_id, "task_id": norm["task_id"],
           "task_dir": norm["artifact_path"]}
    isolation.close_pools()


def llm_options(server: srv.ScriptedLLM, **kw) -> dict:
    opts = dict(model=MODEL, api_base=server.base_url, samples_per_step=1, concurrency=1, timeout_s=20,
                max_retries=2, backoff_s=0.01, backoff_max_s=0.05)
    opts.update(kw)
    return opts


def rows(db_path: str, sql: str, params: list | None = None) -> list[dict]:
    with Database(db_path) as db:
        df = db.query_df(sql, params)
    return df.to_dict("records")


def dump_everything(db_path: str, data_dir: str) -> str:
    """Every table of the DuckDB file and every file under the data dir, as one text."""
    parts = []
    with Database(db_path, read_only=True) as db:
        tables = [r[0] for r in db.query("SELECT table_name FROM information_schema.tables")]
        for t in tables:
            parts.append(f"== {t}\n" + "\n".join(repr(r) for r in db.query(f'SELECT * FROM "{t}"')))
    assert {"candidates", "llm_calls", "searches", "episodes"} <= set(tables)
    for f in Path(data_dir).rglob("*"):
        if f.is_file():
            parts.append(f"== {f}\n" + f.read_text(errors="replace"))
    return "\n".join(parts)


def assert_no_key(server: srv.ScriptedLLM, db_path: str, data_dir: str) -> None:
    # The key was really in play: litellm read it from the env and sent it ...
    assert server.requests and server.requests[0]["headers"]["authorization"] == f"Bearer {KEY}"
    # ... and nothing written anywhere holds it.
    text = dump_everything(db_path, data_dir)
    assert "SECRET123" not in text and KEY not in text


# ----------------------------------------------------------------------------------------------- the wiring

def test_make_proposer_builds_and_the_hybrid_forwards_the_call_hook():
    from llm4llm.llm import HybridProposer, LLMConfig, LLMConfigError, LLMProposer
    from llm4llm.search.builtin import LibraryProposer

    p = make_proposer("llm", 0, {"model": MODEL, "api_base": "http://127.0.0.1:9/v1", "concurrency": 2})
    assert isinstance(p, LLMProposer) and p.config.concurrency == 2 and p.config.api_base.endswith(":9/v1")
    assert isinstance(make_proposer("llm", 0, LLMConfig(model=MODEL)), LLMProposer)
    h = make_proposer("hybrid", 3, {"model": MODEL, "hybrid_share": 0.25})
    assert isinstance(h, HybridProposer) and isinstance(h.builtin, LibraryProposer) and h.share == 0.25
    hook = object()
    h.on_call = hook
    assert h.llm.on_call is hook and h.on_call is hook
    h.transcript_path = "/tmp/x-e{episode}.jsonl"
    assert h.llm.transcript_path == "/tmp/x-e{episode}.jsonl"
    assert isinstance(make_proposer("library"), LibraryProposer)
    with pytest.raises(LLMConfigError, match="litellm model string"):
        make_proposer("llm", 0, {})
    with pytest.raises(ValueError, match="library, llm or hybrid"):
        make_proposer("llama", 0, {"model": MODEL})


# ------------------------------------------------------------------------------------- search_recorded (llm)

@pytest.mark.timeout(120)
def test_llm_search_through_run_task_search(tiny_run):
    script = [srv.compile_error(), srv.rate_limited(), srv.good()]  # then the default: prose without code
    with srv.ScriptedLLM(script) as server:
        out = search_recorded(tiny_run["task_dir"], Store(tiny_run["db"]), tiny_run["data_dir"],
                              SearchSettings(budget=6, proposer="llm"), run_id=tiny_run["run_id"],
                              llm=llm_options(server, max_total_tokens=400))
    # 150 tokens per answer: compile error, (429) good, no code = 450 >= 400, so the fourth request is never sent
    # and the search ends short of its budget of 6, cleanly.
    assert len(server.requests) == 4
    assert out.trials == 3 and out.ended_by == "exhausted"
    assert out.llm_exhausted.startswith("token budget spent") and out.llm_tokens == 450
    assert out.llm_calls == 4 and out.best_candidate is not None
    sid = out.search_id

    [search] = rows(tiny_run["db"], "SELECT * FROM searches WHERE search_id = ?", [sid])
    assert (search["proposer"], search["trials"], search["passed"], search["run_id"]) == ("llm", 3, 1,
                                                                                         tiny_run["run_id"])
    assert search["finished_at"] is not None and search["best_candidate_id"] == out.best_candidate

    cands = rows(tiny_run["db"], "SELECT * FROM candidates WHERE search_id = ? ORDER BY iteration", [sid])
    assert [c["passed"] for c in cands] == [False, True, False]
    assert cands[0]["failure_class"] == "compile" and cands[2]["failure_class"]  # the code-less answer: static
    assert all(c["proposer"] == "llm" and c["template"] == "llm" and c["task_id"] == tiny_run["task_id"]
               for c in cands)
    configs = [json.loads(c["config_json"]) for c in cands]
    assert configs[2]["error_kind"] == "no_code"
    assert Path(cands[1]["source_path"]).read_text() == srv.GOOD_SOURCE
    assert cands[1]["max_abs_err"] is not None and cands[1]["max_abs_err"] < 1e-3

    calls = rows(tiny_run["db"], "SELECT * FROM llm_calls WHERE search_id = ?", [sid])
    assert len(calls) == 4 and {c["task_id"] for c in calls} == {tiny_run["task_id"]}
    assert {c["model"] for c in calls} == {MODEL}
    got = sorted((c["status"], c["attempt"], c["prompt_tokens"], c["completion_tokens"]) for c in calls)
    assert got == [("ok", 0, 100, 50), ("ok", 0, 100, 50), ("ok", 1, 100, 50), ("rate_limited", 0, 0, 0)]
    [limited] = [c for c in calls if c["status"] == "rate_limited"]
    assert "Rate limit" in limited["error"]
    assert all(c["latency_ms"] > 0 for c in calls)
    # Each candidate names the call that produced it.
    assert {cfg["llm_call"] for cfg in configs} <= {c["call_id"] for c in calls}

    # The LLM transcript: per episode, JSONL, under the search's archive dir, next to the episode JSON.
    archive = Path(tiny_run["data_dir"]) / "searches" / sid
    [jsonl] = list(archive.glob("llm-e*.jsonl"))
    assert jsonl.name == "llm-e0.jsonl"
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["kind"] for r in records].count("prompt") == 3 and [r["kind"] for r in records].count("response") == 4
    assert "hidden_states" in json.dumps(records[0]["messages"])
    [ep] = rows(tiny_run["db"], "SELECT * FROM episodes WHERE search_id = ?", [sid])
    assert Path(ep["transcript_path"]).parent == archive

    assert_no_key(server, tiny_run["db"], tiny_run["data_dir"])


def test_bad_credentials_stop_the_search_and_close_its_row(tiny_run):
    from llm4llm.llm import LLMConfigError

    reply = srv.Reply(status=401, error={"message": f"Incorrect API key provided: {KEY}", "type": "invalid_request"})
    with srv.ScriptedLLM([reply]) as server:
        with pytest.raises(LLMConfigError, match="AuthenticationError"):
            search_recorded(tiny_run["task_dir"], Store(tiny_run["db"]), tiny_run["data_dir"],
                            SearchSettings(budget=2, proposer="llm"), llm=llm_options(server))
    [search] = rows(tiny_run["db"], "SELECT * FROM searches WHERE proposer = 'llm' AND trials = 0")
    assert search["finished_at"] is not None
    [call] = rows(tiny_run["db"], "SELECT * FROM llm_calls WHERE search_id = ?", [search["search_id"]])
    assert call["status"] == "fatal" and "SECRET123" not in call["error"]
    assert_no_key(server, tiny_run["db"], tiny_run["data_dir"])


# ------------------------------------------------------------------------------------------ hybrid (shared)

@pytest.mark.timeout(120)
def test_hybrid_search_shares_the_budget(tiny_run):
    with srv.ScriptedLLM([srv.good(), srv.wrong_numerics()]) as server:
        out = search_recorded(tiny_run["task_dir"], Store(tiny_run["db"]), tiny_run["data_dir"],
                              SearchSettings(budget=4, proposer="hybrid"), run_id=tiny_run["run_id"],
                              llm=llm_options(server, hybrid_share=0.5))
    sid = out.search_id
    assert out.trials == 4 and len(server.requests) == 2 and out.llm_calls == 2
    [search] = rows(tiny_run["db"], "SELECT proposer, trials FROM searches WHERE search_id = ?", [sid])
    assert search == {"proposer": "hybrid", "trials": 4}
    cands = rows(tiny_run["db"], "SELECT proposer, passed, source_path FROM candidates WHERE search_id = ?", [sid])
    assert sorted(c["proposer"] for c in cands) == ["library", "library", "llm", "llm"]
    llm_sources = {Path(c["source_path"]).read_text() for c in cands if c["proposer"] == "llm"}
    assert llm_sources == {srv.GOOD_SOURCE, srv.WRONG_SOURCE}
    calls = rows(tiny_run["db"], "SELECT status, task_id FROM llm_calls WHERE search_id = ?", [sid])
    assert calls == [{"status": "ok", "task_id": tiny_run["task_id"]}] * 2
    assert list((Path(tiny_run["data_dir"]) / "searches" / sid).glob("llm-e*.jsonl"))
    assert_no_key(server, tiny_run["db"], tiny_run["data_dir"])


# ------------------------------------------------------------------------------------- the CLI, via Prefect

@pytest.mark.timeout(180)
def test_cli_search_with_the_llm_proposer(prefect_harness, tiny_run):
    from typer.testing import CliRunner

    from cli.main import app

    with srv.ScriptedLLM([srv.good()]) as server:
        res = CliRunner().invoke(app, ["search", "--run", tiny_run["run_id"], "--task", tiny_run["task_id"],
                                       "--budget", "3", "--proposer", "llm", "--llm-model", MODEL,
                                       "--llm-api-base", server.base_url, "--db", tiny_run["db"],
                                       "--data-dir", tiny_run["data_dir"]])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert f"{tiny_run['task_id']}: 3 trials" in res.output and "llm: 3 calls" in res.output
    # The CLI's defaults (4 samples a step) ask for up to 4; the search verifies the 3 its budget allows.
    [search] = rows(tiny_run["db"], "SELECT * FROM searches WHERE proposer = 'llm' AND budget = 3")
    assert search["trials"] == 3 and search["passed"] == 1 and search["finished_at"] is not None
    cands = rows(tiny_run["db"], "SELECT * FROM candidates WHERE search_id = ?", [search["search_id"]])
    assert len(cands) == 3 and sum(c["passed"] for c in cands) == 1
    calls = rows(tiny_run["db"], "SELECT * FROM llm_calls WHERE search_id = ?", [search["search_id"]])
    assert len(calls) >= 3 and all(c["status"] == "ok" and c["task_id"] == tiny_run["task_id"] for c in calls)
    assert_no_key(server, tiny_run["db"], tiny_run["data_dir"])


def test_cli_refuses_an_llm_search_without_a_model(tiny_run):
    from typer.testing import CliRunner

    from cli.main import app

    res = CliRunner().invoke(app, ["search", "--run", tiny_run["run_id"], "--proposer", "llm", "--db",
                                   tiny_run["db"], "--data-dir", tiny_run["data_dir"]])
    assert res.exit_code == 2 and "litellm model string" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["search", "--run", tiny_run["run_id"], "--proposer", "gpt", "--db",
                                   tiny_run["db"]])
    assert res.exit_code == 2 and "library, llm, hybrid" in res.output
    res = CliRunner().invoke(app, ["search", "--run", tiny_run["run_id"], "--decode-timing", "wallclock", "--db",
                                   tiny_run["db"]])
    assert res.exit_code == 2 and "--decode-timing: expected one of launch, graph" in res.output


def test_cli_search_passes_decode_timing(tiny_run, monkeypatch):
    from typer.testing import CliRunner

    import flows.search
    from cli.main import app

    got = {}
    monkeypatch.setattr(flows.search, "search_tasks", lambda run, **kw: got.update(kw, run=run) or [])
    res = CliRunner().invoke(app, ["search", "--run", tiny_run["run_id"], "--decode-timing", "graph", "--db",
                                   tiny_run["db"], "--data-dir", tiny_run["data_dir"]])
    assert res.exit_code == 0, res.output
    assert got["settings"].decode_timing == "graph" and got["run"] == tiny_run["run_id"]
