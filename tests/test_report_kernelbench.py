"""`llm4llm report KB_RUN_ID`: a KernelBench run's sections (issue 42), from a DuckDB file written through storage's
own record functions: a synthetic run of 3 search modes x 4 problems x 4 trials (one problem degenerate, one search
stopped early, one problem never solved in one mode). The results section has its figure, its per-mode table and
the degenerate problem apart; the ablation's curves and bands never go down and count every problem at every
trial; a model's run in the same file gets no KernelBench section."""
from __future__ import annotations

import math
from datetime import datetime

import pytest

pytest.importorskip("matplotlib")

from storage import repo  # noqa: E402
from storage.db import Database  # noqa: E402
from storage.report_queries import ReportReader  # noqa: E402

KB = "kb-synthetic"
MODEL_RUN = "tiny-run-0001"
F = None  # a failing trial
DEGENERATE = "80_Gemm_Max_Subtract_GELU.py"
# (mode, problem) -> each trial's speedup over eager (None: failed); iter's first problem stopped after 2 trials
TRIALS = {
    ("episodic", "1_Gemm_ReLU.py"): [F, 1.2, 1.8, 2.5],
    ("episodic", "2_Conv_Add.py"): [1.1, 0.8, 1.6, 1.6],
    ("episodic", "3_Conv_GroupNorm.py"): [F, F, 1.3, 1.4],
    ("sample", "1_Gemm_ReLU.py"): [1.1, 1.2, F, 1.2],
    ("sample", "2_Conv_Add.py"): [0.7, 0.9, 1.0, 0.9],
    ("sample", "3_Conv_GroupNorm.py"): [F, F, F, F],
    ("iter", "1_Gemm_ReLU.py"): [1.3, 1.5],
    ("iter", "2_Conv_Add.py"): [1.0, 1.2, 1.3, 1.4],
    ("iter", "3_Conv_GroupNorm.py"): [F, 1.1, 1.1, 1.2],
    **{(m, DEGENERATE): [900.0, 950.0, 990.0, 991.0] for m in ("episodic", "sample", "iter")},
}
# the best of the reference (1.0) and the passing trials so far, per mode and trial, over the 3 real problems
EXPECTED_FINAL = {"episodic": (2.5 * 1.6 * 1.4) ** (1 / 3), "sample": 1.2 ** (1 / 3),
                  "iter": (1.5 * 1.4 * 1.2) ** (1 / 3)}


def _record_kb_run(db: Database) -> None:
    for (mode, problem), speedups in TRIALS.items():
        task, sid, pid = problem[:-3].lower(), f"{KB}-{mode}-{problem}", int(problem.split("_")[0])
        deg = problem == DEGENERATE
        repo.record_search_start(db, {"search_id": sid, "task_id": task, "run_id": KB, "mode": mode,
                                      "proposer": "library", "budget": 4})
        for i, sp in enumerate(speedups):
            repo.record_candidate(db, {
                "candidate_id": f"c{i}{mode[0]}{pid}", "task_id": task, "search_id": sid,
                "episode": i // 2 if mode == "episodic" else 0, "iteration": i, "proposer": "library",
                "template": "kb.fused_tail", "origin": "template", "passed": sp is not None,
                "failure_class": None if sp is not None else "correctness", "utility": sp or 0.0,
                "speedup_cold": sp, "speedup_compile": sp and sp / 1.2, "kb_degenerate": deg if sp else None})
        ok = [s for s in speedups if s is not None]
        repo.record_search_end(db, sid, len(speedups), len(ok), None, max(ok) if ok else None)
        best = max(ok) if ok else None
        repo.record_kb_result(db, {
            "kb_run_id": KB, "problem": problem, "problem_id": pid, "task_id": task, "search_id": sid, "mode": mode,
            "proposer": "library", "budget": 4, "trials": len(speedups), "passed": bool(ok), "origin": "template",
            "eager_ms": 1.0 if ok else None, "candidate_ms": 1.0 / best if ok else None,
            "compile_ms": 1.0 / 1.2 if ok else None, "speedup_eager": best,
            "speedup_compile": best and best / 1.2, "degenerate": deg if ok else None, "gpu_name": "NVIDIA H200"})


def _record_model_run(db: Database) -> None:
    repo.record_profile_run(db, {
        "run_id": MODEL_RUN, "workload_hash": "wl1", "workload_name": "tiny", "kind": "profile", "status": "ok",
        "started_at": datetime(2026, 12, 1, 3), "device": "cpu"},
        {"workload_hash": "wl1", "name": "tiny", "path": "/w/tiny.toml", "config": {}},
        [{"phase": "decode", "module_path": "layers.0", "class_name": "Block", "family": "block", "depth": 1,
          "calls": 3, "time_ms": 2.0, "share": 0.5, "hotspot_score": 0.5, "in_shapes": [[1, 4]],
          "out_shapes": [[1, 4]]}])


@pytest.fixture(scope="module")
def kb_db(tmp_path_factory):
    path = tmp_path_factory.mktemp("kbreport") / "kb.duckdb"
    with Database(path) as db:
        _record_kb_run(db)
        _record_model_run(db)
    return path


def _report(db_path, run: str | None, out) -> tuple[str, dict]:
    from typer.testing import CliRunner

    from cli.main import app
    from test_report import _parse

    res = CliRunner().invoke(app, ["report", *([run] if run else []), "--db", str(db_path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    return res.output, _parse(out.read_text())


def test_a_kernelbench_run_s_report_has_its_results_and_ablation(kb_db, tmp_path):
    from test_report import _is_png

    output, sections = _report(kb_db, KB, tmp_path / "kb.html")
    assert KB in output
    assert list(sections) == ["kernelbench", "kb_ablation"]  # no model-run section (no profile, no e2e)
    assert all(len(s["imgs"]) == 1 and _is_png(s["imgs"][0]) for s in sections.values())
    # header + rows: 3 modes; the degenerate problem in each mode, apart; the 3 real problems x 3 modes
    assert sections["kernelbench"]["tables"] == {"summary per mode": 1 + 3, "degenerate problems": 1 + 3,
                                                 "problems": 1 + 9}
    assert sections["kb_ablation"]["tables"] == {"curves": 1 + 3 * 4, "mode contrasts": 1 + 3}


def _section(db_path, fn):
    from llm4llm.report import report_context

    with Database(db_path, read_only=True) as db:
        ctx = report_context(ReportReader(db), KB)
        return ctx, fn(ctx)


def test_degenerate_problems_are_apart_and_out_of_the_geo_means(kb_db):
    from llm4llm.report import kernelbench_results

    ctx, block = _section(kb_db, kernelbench_results)
    assert ctx.kind == "kernelbench"
    tables = dict(block.tables)
    assert set(tables["degenerate problems"]["problem"]) == {DEGENERATE}
    assert DEGENERATE not in set(tables["problems"]["problem"])
    s = tables["summary per mode"].set_index("mode")
    assert math.isclose(s.loc["episodic", "geo_eager_real"], EXPECTED_FINAL["episodic"])
    assert math.isclose(s.loc["sample", "geo_eager_real"], 1.2 ** 0.5)  # its third problem never passed
    assert math.isclose(s.loc["episodic", "geo_compile_real"], EXPECTED_FINAL["episodic"] / 1.2)
    # the geo-mean with the degenerate problem kept: what the real one leaves out
    assert s.loc["episodic", "geo_eager"] > 4 * s.loc["episodic", "geo_eager_real"]
    assert s.loc["sample", "pass_rate"] == 0.75 and s.loc["episodic", "degenerate"] == 1
    for col in ("eager", "compile"):
        assert (s[f"geo_{col}_p05"] <= s[f"geo_{col}_real"]).all() and (s[f"geo_{col}_real"] <=
                                                                        s[f"geo_{col}_p95"]).all()
    assert len(block.figures) == 1 and any("degenerate problem" in n for n in block.notes)


def test_ablation_bands_never_go_down_and_count_every_problem_at_every_trial(kb_db):
    from llm4llm.report import kernelbench_ablation

    _, block = _section(kb_db, kernelbench_ablation)
    bands, contrasts = dict(block.tables)["curves"], dict(block.tables)["mode contrasts"]
    for mode, g in bands.groupby("mode"):
        g = g.sort_values("trial")
        assert list(g["trial"]) == [1, 2, 3, 4] and (g["problems"] == 3).all(), g  # iter's early stop kept
        for col in ("geo_best", "geo_p05", "geo_p95"):
            assert g[col].is_monotonic_increasing, (mode, col, list(g[col]))
        assert (g["geo_p05"] <= g["geo_best"]).all() and (g["geo_best"] <= g["geo_p95"]).all()
        assert math.isclose(g["geo_best"].iloc[-1], EXPECTED_FINAL[mode]), mode
    first = bands[bands["trial"] == 1].set_index("mode")["geo_best"]
    assert math.isclose(first["episodic"], 1.1 ** (1 / 3))  # a failed trial counts the reference, 1.0
    assert math.isclose(first["sample"], 1.1 ** (1 / 3))  # so does a passing one slower than it (0.7x)
    c = contrasts.set_index(["mode_a", "mode_b"])
    assert c.loc[("episodic", "sample"), "problems"] == 3
    assert math.isclose(c.loc[("episodic", "sample"), "geo_ratio"], EXPECTED_FINAL["episodic"]
                        / EXPECTED_FINAL["sample"])
    assert c.loc[("episodic", "sample"), "ratio_p05"] > 1.0  # every problem is faster with episodic


def test_a_model_run_s_report_has_no_kernelbench_section(kb_db, tmp_path):
    output, sections = _report(kb_db, None, tmp_path / "model.html")  # the default run: the model's, not the KB run
    assert MODEL_RUN in output
    assert "overview" in sections and not {"kernelbench", "kb_ablation"} & set(sections)
    assert "KernelBench" not in (tmp_path / "model.html").read_text()


def test_an_unknown_run_kind_is_refused():
    from llm4llm.report import section

    with pytest.raises(ValueError, match="kinds"):
        section("x", "X", kinds=("notebook",))


def test_an_untimed_kernelbench_run_still_renders(tmp_path):
    """A CPU run (`--device cpu`): every problem passes, nothing is timed; the results say so, the curves stay at
    the reference (1.0) and one mode is no ablation."""
    from llm4llm.report import kernelbench_ablation, kernelbench_results, report_context

    path = tmp_path / "cpu.duckdb"
    with Database(path) as db:
        for pid in (1, 2):
            sid = f"cpu-{pid}"
            repo.record_search_start(db, {"search_id": sid, "task_id": f"t{pid}", "run_id": "kb-cpu",
                                          "mode": "episodic", "proposer": "library", "budget": 2})
            for i in range(2):
                repo.record_candidate(db, {"candidate_id": f"c{pid}{i}", "task_id": f"t{pid}", "search_id": sid,
                                           "episode": 0, "iteration": i, "proposer": "library", "passed": True,
                                           "utility": 0.0})
            repo.record_kb_result(db, {"kb_run_id": "kb-cpu", "problem": f"{pid}_P.py", "problem_id": pid,
                                       "task_id": f"t{pid}", "search_id": sid, "mode": "episodic",
                                       "proposer": "library", "budget": 2, "trials": 2, "passed": True})
    with Database(path, read_only=True) as db:
        ctx = report_context(ReportReader(db), "kb-cpu")
        results, ablation = kernelbench_results(ctx), kernelbench_ablation(ctx)
    assert len(results.figures) == 1 and "degenerate problems" not in dict(results.tables)
    assert dict(results.tables)["summary per mode"]["pass_rate"].tolist() == [1.0]
    bands = dict(ablation.tables)["curves"]
    assert bands["geo_best"].tolist() == [1.0, 1.0] and any("one search mode only" in n for n in ablation.notes)
