"""The tiny workloads end to end through the Prefect flows (one test harness per session), into DuckDB."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llm4llm.config import OptimizeConfig
from llm4llm.errors import ScriptError, WorkloadError
from llm4llm.taskspec import load_task
from storage import repo
from storage.db import Database

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "workloads"


@pytest.fixture(scope="module")
def optimized(prefect_harness, tmp_path_factory):
    """tiny-llama and tiny-mamba through optimize_workload, once for the module."""
    from flows.optimize import optimize_workload

    root = tmp_path_factory.mktemp("flows")
    db_path = str(root / "l4l.duckdb")
    out = {}
    for name in ("tiny-llama", "tiny-mamba"):
        out[name] = optimize_workload(str(EXAMPLES / f"{name}.toml"), OptimizeConfig(stages=["profile", "extract"]),
                                      db_path=db_path, data_dir=str(root / "data"))
    return root, db_path, out


def test_runs_and_profiles_in_duckdb(optimized):
    _, db_path, out = optimized
    with Database(db_path) as db:
        runs = repo.list_runs(db)
        assert set(runs["workload_name"]) == {"tiny-llama", "tiny-mamba"}
        for name, res in out.items():
            run = repo.get_run(db, res.run_id)
            assert run["status"] == "ok" and run["prefill_forwards"] == 1 and run["decode_forwards"] == 3
            assert run["kind"] == "cli" and run["finished_at"] is not None
            prof = repo.profile_rows(db, res.run_id)
            assert set(prof["phase"]) == {"prefill", "decode"}
            top_level = prof[prof["depth"] == 0]
            assert (top_level["share"].round(6) == 1.0).all()


def test_hotspot_ranking_families(optimized):
    _, db_path, out = optimized
    with Database(db_path) as db:
        llama = repo.profile_rows(db, out["tiny-llama"].run_id)
        mamba = repo.profile_rows(db, out["tiny-mamba"].run_id)
    leafish = {"attention", "mlp", "norm", "ssm_mixer"}
    llama_top = [f for f in llama["family"] if f in leafish][:3]
    assert "attention" in llama_top or "mlp" in llama_top
    mamba_families = [f for f in mamba["family"] if f in leafish]
    assert mamba_families[0] == "ssm_mixer"


def test_tasks_extracted_and_round_trip(optimized):
    _, db_path, out = optimized
    with Database(db_path) as db:
        tasks = repo.task_rows(db, out["tiny-llama"].run_id)
        mtasks = repo.task_rows(db, out["tiny-mamba"].run_id)
    dep = tasks[tasks["deployable"]]
    assert {"prefill", "decode"} <= set(dep["phase"])
    assert {"attention", "mlp", "norm"} <= set(dep["family"])
    attn = dep[(dep["family"] == "attention") & (dep["phase"] == "prefill")].iloc[0]
    assert attn["instances"] == 2  # both layers grouped into one task
    task = load_task(Path(attn["artifact_path"]))
    assert task.spec.dispatch is not None and task.spec.dispatch.sibling_tasks
    assert task.cases and task.cases[0].ref
    assert "ssm_mixer" in set(mtasks[mtasks["deployable"]]["family"])
    index = json.loads(Path(out["tiny-llama"].index_path).read_text())
    assert len(index) == len(tasks)


def test_a_cached_rerun_is_a_run_of_its_own_that_links_the_profile_it_reused(prefect_harness, optimized,
                                                                             monkeypatch):
    """Runs of an unchanged workload, each started another way, reuse the cached profile and never write into the
    run that measured it: each has its own run id, kind, status and profile rows."""
    from flows.profiling import profile_workload

    root, db_path, out = optimized
    first = out["tiny-llama"].run_id
    again = {}
    for deployment, kind in ((None, "cli"), ("manual", "manual"), ("on-change-gpu-cuda-0", "on-change")):
        if deployment:  # as a run that this deployment started sees it (prefect.runtime reads this override)
            monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__NAME", deployment)
        again[kind] = profile_workload(str(EXAMPLES / "tiny-llama.toml"), db_path=db_path,
                                       data_dir=str(root / "data"))
        assert again[kind].profile_path == out["tiny-llama"].profile_path  # served from the cache
    ids = [first] + [a.run_id for a in again.values()]
    assert len(set(ids)) == 4
    with Database(db_path, read_only=True) as db:
        for kind, a in again.items():
            run = repo.get_run(db, a.run_id)
            assert (run["kind"], run["profile_of"], run["status"]) == (kind, first, "ok"), run
            assert run["finished_at"] is not None
            assert len(repo.profile_rows(db, a.run_id)) == len(repo.profile_rows(db, first))
        assert repo.get_run(db, first)["kind"] == "cli" and len(repo.task_rows(db, first)) > 0
    fresh = profile_workload(str(EXAMPLES / "tiny-llama.toml"), db_path=db_path, data_dir=str(root / "data"),
                             refresh=True)
    assert fresh.run_id not in ids


def _bad_workload(tmp_path: Path, script_body: str | None, **overrides) -> Path:
    text = (EXAMPLES / "tiny-llama.toml").read_text()
    if script_body is not None:
        (tmp_path / "bad_script.py").write_text(script_body)
        text = text.replace('script = "../scripts/hf_generate.py"', 'script = "bad_script.py"')
    for k, v in overrides.items():
        text = text.replace(k, v)
    p = tmp_path / "bad.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("case", ["raises", "missing_field", "unknown_model"])
def test_bad_input_leaves_no_run(prefect_harness, tmp_path, case):
    from flows.profiling import profile_workload

    if case == "raises":
        path = _bad_workload(tmp_path, "def build(w):\n    raise RuntimeError('boom in user code')\n"
                                       "def inputs(w):\n    return {}\ndef run(m, w, i):\n    return None\n")
        expected = ScriptError
    elif case == "missing_field":
        path = _bad_workload(tmp_path, None, **{"decode_len = 4\n": ""})
        expected = WorkloadError
    else:
        path = _bad_workload(tmp_path, None, **{'model_type = "llama"': 'model_type = "lama"'})
        expected = WorkloadError
    db_path = str(tmp_path / "db.duckdb")
    with pytest.raises(expected) as info:
        profile_workload(str(path), db_path=db_path, data_dir=str(tmp_path / "data"))
    if case == "raises":
        assert "boom in user code" in str(info.value)
    with Database(db_path) as db:
        assert repo.list_runs(db).empty
        assert db.query("select count(*) from profiles")[0][0] == 0
    shutil.rmtree(tmp_path / "data", ignore_errors=True)


def test_cli_reports_bad_input_in_one_line(prefect_harness, tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    path = _bad_workload(tmp_path, None, **{"decode_len = 4\n": ""})
    res = CliRunner().invoke(app, ["profile", str(path), "--db", str(tmp_path / "db.duckdb")])
    assert res.exit_code == 2
    assert "decode_len" in res.output and "Traceback" not in res.output


def test_whole_loop_on_cpu_checks_in_model_but_never_accepts(prefect_harness, tmp_path):
    """profile -> extract -> search -> accept -> evaluate on tiny-llama: candidates are verified and checked inside
    the model, and the CPU latency gate rejects every one (no CPU timing may accept a patch)."""
    from flows.optimize import optimize_workload

    db_path = str(tmp_path / "loop.duckdb")
    # the loop's stages are under test, not a kernel: the two hottest MLP tasks (the hottest of all, the fused
    # decoder layer, costs ~25 s of interpreter in applicability, search and the in-model check; it is installed in
    # a model in tests/test_bundle_reproduces.py)
    cfg = OptimizeConfig(search={"budget": 1, "top": 2, "rounds": 2, "families": ["mlp"]},
                         evaluate={"variants": ["eager", "patched"], "repeats": 1})  # rows asserted, not timings
    out = optimize_workload(str(EXAMPLES / "tiny-llama.toml"), cfg, db_path=db_path, data_dir=str(tmp_path / "data"))
    assert len(out.searches) == 2 and out.acceptance.accepted == 0 and out.acceptance.bundle is None
    assert out.bundle is None and len(out.acceptances) == 2  # the first target accepted alone, then the other
    assert out.acceptance.retry_tasks == ()  # CPU rejections are not the candidates' fault: no second round
    with Database(db_path) as db:
        acc = repo.table_df(db, "acceptances")
        e2e = repo.table_df(db, "e2e_results")
        cands = repo.candidate_rows(db)
    assert len(cands) == 2 and cands["passed"].all()
    assert len(acc) == 2 and (acc["decision"] == "rejected").all()
    assert acc["reason"].str.contains("no CPU timing may accept a patch").all()
    assert acc["reason"].str.contains("in-model correctness ok").all()
    assert set(e2e["variant"]) == {"eager", "patched"}
    assert e2e.set_index("variant").loc["patched", "notes"] == "skipped: no bundle"
    # each step's decisions were journalled as made (what a stopped step keeps: tests/test_accept_journal.py)
    journalled = [json.loads(line)["candidate_id"] for f in sorted((tmp_path / "data" / "accept").glob("*.jsonl"))
                  for line in f.read_text().splitlines()]
    assert sorted(journalled) == sorted(acc["candidate_id"])


def test_evaluate_with_a_missing_bundle_fails_loudly(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    res = CliRunner().invoke(app, ["evaluate", str(EXAMPLES / "tiny-llama.toml"), "--bundle", str(tmp_path / "nope"),
                                   "--db", str(tmp_path / "db.duckdb")])
    assert res.exit_code == 2 and "expected a readable patch bundle" in res.output and "Traceback" not in res.output
    with Database(str(tmp_path / "db.duckdb")) as db:
        assert db.query("select count(*) from e2e_results")[0][0] == 0


def test_evaluate_keeps_the_variants_it_finished_when_the_process_dies(tmp_path):
    """Each variant's row lands in DuckDB as it is measured: a run stopped midway (on the H200 a time limit killed
    two optimize runs in their last variant, and every row of their evaluate was lost) keeps what it finished."""
    from llm4llm.config import EvaluateSettings
    from llm4llm.stages.evaluate import evaluate_recorded
    from storage.store import Store

    root = EXAMPLES.parent
    (tmp_path / "script.py").write_text((root / "scripts" / "hf_generate.py").read_text() + '''

_real_run = run


def run(model, workload, inputs, **generate_kwargs):  # the compiled variant's first call kills the process
    if generate_kwargs:
        import os
        os._exit(3)
    return _real_run(model, workload, inputs)
''')
    toml = (EXAMPLES / "tiny-llama.toml").read_text().replace('"../scripts/hf_generate.py"', '"script.py"')
    (tmp_path / "wl.toml").write_text(toml)
    db_path = str(tmp_path / "db.duckdb")
    with pytest.raises(RuntimeError, match="died"):
        evaluate_recorded(str(tmp_path / "wl.toml"), Store(db_path),
                          EvaluateSettings(repeats=1, variants=["eager", "torch_compile"]), run_id="r-killed")
    with Database(db_path) as db:
        e2e = repo.table_df(db, "e2e_results")
    assert list(e2e["variant"]) == ["eager"] and list(e2e["run_id"]) == ["r-killed"]
    assert e2e["total_ms"].iloc[0] > 0 and e2e["workload_hash"].iloc[0]
    out = evaluate_recorded(str(EXAMPLES / "tiny-llama.toml"), Store(db_path),
                            EvaluateSettings(repeats=2, variants=["eager", "patched"]), run_id="r-whole")
    assert [r.variant for r in out.rows] == ["eager", "patched"]
    with Database(db_path) as db:
        assert db.query("select count(*) from e2e_results where run_id = 'r-whole'")[0][0] == 2
        eager = repo.table_df(db, "e2e_results", "run_id = 'r-whole' and variant = 'eager'").iloc[0]
    # every timed run is on record beside the medians (the old row, from before the column existed, needs none)
    totals, prefills = json.loads(eager["total_samples_ms"]), json.loads(eager["prefill_samples_ms"])
    assert len(totals) == 2 and len(prefills) == 2 and min(totals) > 0
    assert eager["total_ms"] == pytest.approx(sum(totals) / 2) and eager["prefill_ms"] == pytest.approx(sum(prefills) / 2)
    from llm4llm.evaluate import TABLE_COLUMNS, spread, table_rows
    assert spread(eager["total_samples_ms"]) == f"{min(totals):.1f}-{max(totals):.1f}" and spread(None) == ""
    shown = table_rows(out.rows)  # the CLI table and the Prefect artifact
    assert [list(r) for r in shown] == [list(TABLE_COLUMNS)] * 2 and shown[1]["total_range_ms"] == ""
    assert shown[0]["total_range_ms"] == spread(out.rows[0].total_samples_ms) != ""


@pytest.mark.parametrize("flag,value", [("--accept-min-task-speedup", "-1"), ("--accept-floor-factor", "0"),
                                        ("--accept-noisy-rounds", "-1"),
                                        ("--family", "normz"), ("--task-runner", "dask")])
def test_cli_rejects_bad_acceptance_options_before_any_run(tmp_path, flag, value):
    from typer.testing import CliRunner

    from cli.main import app

    res = CliRunner().invoke(app, ["optimize", str(EXAMPLES / "tiny-llama.toml"), flag, value,
                                   "--db", str(tmp_path / "db.duckdb")])
    assert res.exit_code == 2 and flag in res.output and "Traceback" not in res.output
    assert not (tmp_path / "db.duckdb").exists()


def test_cli_family_restricts_the_search_to_that_family(prefect_harness, tmp_path):
    """`optimize --family norm`: only the norm tasks are searched, the top N counted among them (on the GPU the
    norm decode tasks ranked below attention and MLP, whose kernels lose to cuBLAS/SDPA under graph replay)."""
    from typer.testing import CliRunner

    from cli.main import app

    db = tmp_path / "db.duckdb"
    res = CliRunner().invoke(app, ["optimize", str(EXAMPLES / "tiny-llama.toml"), "--db", str(db), "--data-dir",
                                   str(tmp_path / "data"), "--stages", "profile,extract,search", "--budget", "1",
                                   "--top", "1", "--family", "norm"])
    assert res.exit_code == 0, res.output
    with Database(str(db)) as d:
        searched = d.query("select s.task_id, t.family, t.score from searches s join tasks t using (task_id)")
        best_norm = d.query("select max(score) from tasks where family = 'norm' and deployable")[0][0]
        others = d.query("select count(*) from tasks where family <> 'norm' and deployable and score > ?",
                         [best_norm])[0][0]
    assert [r[1] for r in searched] == ["norm"] and searched[0][2] == best_norm
    assert others > 0  # without --family, --top 1 would have taken another family's task


def test_in_subprocess_polls_without_masking_the_childs_own_error():
    """poll (what streams the child's rows into DuckDB) failing: retried while the child runs, raised after a
    child that succeeded, and never in place of the child's own error."""
    from llm4llm.isolation import in_subprocess

    calls = []

    def bad_poll():
        calls.append(1)
        raise OSError("database locked")

    with pytest.raises(ValueError, match="invalid literal"):
        in_subprocess(int, "x", poll=bad_poll, poll_every_s=0.05)
    assert calls  # polled (and failed) at least at the end
    with pytest.raises(OSError, match="database locked"):
        in_subprocess(int, "7", poll=bad_poll, poll_every_s=0.05)
    assert in_subprocess(int, "7", poll=lambda: None, poll_every_s=0.05) == 7


def test_library_searches_skip_tasks_no_template_applies_to(optimized, capsys):
    """With the library proposer alone, tasks no built-in template applies to (tiny-llama's rotary tasks) are left
    out before --top is taken, and named; the LLM proposers keep them (they can write for any task)."""
    from llm4llm.taskspec import load_spec
    from llm4llm.config import SearchSettings
    from llm4llm.stages.search import searchable_of_run
    from storage.store import Store

    _, db_path, out = optimized
    run = out["tiny-llama"].run_id
    rotary = searchable_of_run(run, Store(db_path), SearchSettings(families=["rotary"], proposer="llm"))
    assert rotary and all(load_spec(Path(d)).family == "rotary" for d in rotary)
    assert searchable_of_run(run, Store(db_path), SearchSettings(families=["rotary"], proposer="library")) == []
    assert "left out, no built-in template applies" in capsys.readouterr().out
    everything = searchable_of_run(run, Store(db_path), SearchSettings(proposer="llm"))
    library = searchable_of_run(run, Store(db_path), SearchSettings(proposer="library"))
    assert library == [d for d in everything if d not in rotary]  # same order, hottest first
    assert searchable_of_run(run, Store(db_path), SearchSettings(top=2, proposer="library")) == library[:2]


def test_phase_filter_keeps_only_that_phases_tasks_before_top(optimized):
    """`--phase decode` searches the decode tasks alone (the top N taken among them): a decode-bound deployment
    spends no search time on prefill tasks."""
    from llm4llm.taskspec import load_spec
    from llm4llm.config import SearchSettings
    from llm4llm.stages.search import searchable_of_run
    from storage.store import Store

    _, db_path, out = optimized
    run = out["tiny-llama"].run_id
    everything = searchable_of_run(run, Store(db_path), SearchSettings(proposer="llm"))
    decode = searchable_of_run(run, Store(db_path), SearchSettings(proposer="llm", phases=["decode"]))
    assert decode and {load_spec(Path(d)).phase for d in decode} == {"decode"}
    assert decode == [d for d in everything if load_spec(Path(d)).phase == "decode"]  # same order
    first = SearchSettings(top=1, proposer="llm", phases=["decode"])
    assert searchable_of_run(run, Store(db_path), first) == decode[:1]
