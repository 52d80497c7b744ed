"""`llm4llm report`: a self-contained HTML report of a run from a DuckDB file written through storage's own API
(two nights of a GPU workload: profiles, searches in two modes over episodes, decisions, e2e rows with every timed
run), every plot and table present; and the markdown artifacts a run publishes."""
from __future__ import annotations

import base64
import json
import random
from datetime import datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

import pandas as pd  # noqa: E402

from storage import repo  # noqa: E402
from storage.db import Database  # noqa: E402
from storage.report_queries import ReportReader  # noqa: E402

WL = {"workload_hash": "abc123", "name": "mamba-130m", "path": "/w/mamba-130m.toml", "config": {"dtype": "bfloat16"}}
TASKS = [("mamba-decode-block-1", "ssm_block", "decode", 0.62), ("mamba-prefill-block-2", "ssm_block", "prefill", 0.21),
         ("mamba-decode-norm-3", "norm", "decode", 0.04)]


def _night(db: Database, run_id: str, day: datetime, eager_ms: float, patched_ms: float, rng: random.Random) -> None:
    repo.record_profile_run(db, {
        "run_id": run_id, "workload_hash": WL["workload_hash"], "workload_name": WL["name"], "kind": "profile",
        "status": "ok", "started_at": day, "device": "cuda", "gpu_name": "NVIDIA H200", "capability": "9.0",
        "torch_version": "2.11.0", "triton_version": "3.6.0", "transformers_version": "5.17.0", "timer": "cuda_event",
        "prefill_ms": 31.0, "decode_ms": 1650.0, "prefill_forwards": 1, "decode_forwards": 63}, WL, [
        {"phase": ph, "module_path": path, "class_name": cls, "family": fam, "depth": depth, "calls": calls,
         "time_ms": total * share, "share": share, "hotspot_score": share * w, "in_shapes": [[1, 1, 768]],
         "out_shapes": [[1, 1, 768]]}
        for ph, total, w in (("prefill", 31.0, 0.02), ("decode", 1650.0, 0.98))
        for path, cls, fam, depth, calls, share in (
            ("", "MambaForCausalLM", "model", 0, 1, 1.0),
            ("backbone.layers.0", "MambaBlock", "ssm_block", 2, 63, 0.041),
            ("backbone.layers.0.mixer", "MambaMixer", "ssm_mixer", 3, 63, 0.038),
            ("backbone.layers.0.norm", "MambaRMSNorm", "norm", 3, 63, 0.002),
            ("lm_head", "Linear", "lm_head", 1, 63, 0.011))])
    repo.record_tasks(db, run_id, [
        {"task_id": t, "family": fam, "module_class": "transformers.MambaBlock", "phase": ph, "instances": 24,
         "shapes": [[1, 1, 768]], "dtype": "bfloat16", "artifact_path": f"/d/tasks/{t}", "score": score,
         "time_ms": 1000 * score, "deployable": True, "reason": ""} for t, fam, ph, score in TASKS])
    for t, _, _, _ in TASKS:
        for mode, budget in (("episodic", 8), ("sample", 4)):
            sid = f"{t}-{mode}-library-{run_id[-4:]}"
            repo.record_search_start(db, {"search_id": sid, "task_id": t, "run_id": run_id, "mode": mode,
                                          "proposer": "library", "budget": budget})
            ref = 80.0
            for i in range(budget):
                passed = i % 4 != 3
                ctx = ref / (1.0 + 0.4 * i + rng.random()) if passed else None
                repo.record_candidate(db, {
                    "candidate_id": f"c{i:02d}{mode[0]}{t[-1]}", "task_id": t, "search_id": sid,
                    "episode": i // 5 if mode == "episodic" else 0, "iteration": i, "proposer": "library",
                    "template": "ssm_block.mamba_decode_fused", "config_json": {"lin_GEMV_SPLIT_K": 1 + i % 4},
                    "source_path": f"/d/candidates/{t}/c{i}.py", "passed": passed,
                    "failure_class": None if passed else "correctness", "message": "" if passed else "max err 3e-1",
                    "max_abs_err": 1e-3 if passed else 0.3, "ctx_p20_ms": ctx and ctx * 0.98, "ctx_p50_ms": ctx,
                    "ctx_p80_ms": ctx and ctx * 1.03, "ref_ctx_p50_ms": ref * (0.9 + 0.2 * rng.random()),
                    "speedup_in_context": ref / ctx if ctx else None, "utility": ref / ctx if ctx else 0.0})
            repo.record_episode(db, {"search_id": sid, "episode": 0, "trials": budget, "passed": budget - 1,
                                     "best_utility": 3.0, "transcript_path": None}, {"task_id": t}, t)
            repo.record_search_end(db, sid, budget, budget - budget // 4, f"c00{mode[0]}{t[-1]}", 3.0)
    repo.record_acceptance(db, {"acceptance_id": f"{run_id}:decode-graphs:-", "run_id": run_id,
                                "task_id": "decode-graphs", "candidate_id": "-", "decision": "accepted",
                                "reason": "graphs: logits ok (max step rel-L2 1.2e-3), +61.0 % >= 2 %",
                                "gain": 0.61, "e2e_before_ms": eager_ms, "e2e_after_ms": eager_ms * 0.39})
    for k, (t, _, _, _) in enumerate(TASKS):
        acc = k < 2
        repo.record_acceptance(db, {
            "acceptance_id": f"{run_id}:{t}:c", "run_id": run_id, "task_id": t, "candidate_id": f"c00e{t[-1]}",
            "decision": "accepted" if acc else "rejected", "metric": "logits_rel_l2_floor",
            "reason": "in-model correctness ok; +12.4 % >= 2 %" if acc else
                      "in-model correctness ok; latency +0.6 % < 2 % (bracketed gains 0.4, 0.6, 0.9 %)",
            "gain": 0.124 if acc else 0.006, "e2e_before_ms": 100.0, "e2e_after_ms": 88.0 if acc else 99.4,
            "in_model_max_abs_err": 2e-3})
    repo.record_patch_bundle(db, {"bundle_id": f"{run_id}-bundle", "run_id": run_id,
                                  "workload_hash": WL["workload_hash"], "bundle_path": f"/d/bundles/{run_id}",
                                  "manifest_json": {"patches": 2}})
    rows = []
    for variant, ms in (("eager", eager_ms), ("patched_graphs", patched_ms), ("torch_compile", eager_ms / 2.3),
                        ("patched", None)):
        samples = [ms * (1 + 0.05 * rng.random()) for _ in range(5)] if ms else None
        rows.append({"run_id": f"{run_id}-e2e", "workload_hash": WL["workload_hash"], "variant": variant,
                     "total_ms": sorted(samples)[2] if samples else None, "total_samples_ms": samples,
                     "prefill_ms": 3.0 if ms else None, "decode_ms_per_token": ms / 64 if ms else None,
                     "repeats": 5, "gpu_name": "NVIDIA H200", "notes": "" if ms else "skipped: not asked for"})
    repo.record_e2e(db, rows)


@pytest.fixture(scope="module")
def two_nights(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "r.duckdb"
    rng = random.Random(0)
    with Database(path) as db:
        _night(db, "mamba-130m-night1-aaaa", datetime(2026, 11, 29, 3), 1721.0, 48.0, rng)
        _night(db, "mamba-130m-night2-bbbb", datetime(2026, 11, 30, 3), 1650.0, 47.1, rng)
        _service(db)
    return path


def _validation(run_id: str, subject: str, version, ok: bool, unpatched: float, patched: float, reason: str) -> dict:
    return {"run_id": run_id, "workload_name": WL["name"], "subject": subject, "version": version,
            "bundle_path": f"/d/bundles/{run_id}/{subject}", "ok": ok, "correctness": "ok" if ok else "failed: x",
            "latency": "ok" if ok else "regressed", "unpatched_ms": unpatched, "patched_ms": patched,
            "gain": 1 - patched / unpatched, "reason": reason, "versions_json": {"torch": "2.11.0"}}


def _service(db: Database) -> None:
    """The service's two nights: night 1 puts its bundle in service (v1); night 2 re-validates v1, finds tonight's
    bundle no faster by delta, and keeps v1."""
    n1, n2 = "mamba-130m-night1-aaaa", "mamba-130m-night2-bbbb"
    repo.record_bundle_version(db, {"workload_name": WL["name"], "version": 1, "run_id": n1,
                                    "workload_hash": WL["workload_hash"], "bundle_path": "/d/bundles/mamba/v0001",
                                    "digest": "d1"})
    repo.record_service_night(db, [_validation(n1, "candidate", None, True, 1721.0, 48.0, "correct in-model")],
                              {"run_id": n1, "workload_name": WL["name"], "decision": "replace", "from_version": None,
                               "to_version": 1, "reason": "no bundle in service; tonight's bundle passes"})
    repo.set_current_bundle(db, WL["name"], 1, n1)
    repo.record_service_night(db, [_validation(n2, "current", 1, True, 1650.0, 47.1, "correct in-model"),
                                   _validation(n2, "candidate", None, True, 1650.0, 46.9, "correct in-model")],
                              {"run_id": n2, "workload_name": WL["name"], "decision": "keep", "from_version": 1,
                               "to_version": 1, "reason": "the bundle in service passes at 0.029 of the unpatched "
                                                          "model; tonight's (0.028) is not faster by delta 2%"})


class _Page(HTMLParser):
    """Sections of the page with their images and tables (rows counted)."""

    def __init__(self):
        super().__init__()
        self.sections: dict[str, dict] = {}
        self.cur = None
        self.table = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.cur = self.sections.setdefault(a["data-section"], {"imgs": [], "tables": {}})
        elif tag == "img" and self.cur is not None:
            self.cur["imgs"].append(a["src"])
        elif tag == "table" and self.cur is not None:
            self.table = a["data-table"]
            self.cur["tables"][self.table] = 0
        elif tag == "tr" and self.table is not None:
            self.cur["tables"][self.table] += 1

    def handle_endtag(self, tag):
        if tag == "table":
            self.table = None
        elif tag == "section":
            self.cur = None


def _parse(text: str) -> dict:
    p = _Page()
    p.feed(text)
    return p.sections


def _is_png(src: str) -> bool:
    prefix = "data:image/png;base64,"
    return src.startswith(prefix) and base64.b64decode(src[len(prefix):])[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_a_workload_has_every_plot_and_table(two_nights, tmp_path):
    from typer.testing import CliRunner

    from cli.main import app
    from llm4llm.report import SECTIONS

    out = tmp_path / "r.html"
    res = CliRunner().invoke(app, ["report", "--workload", "mamba-130m", "--db", str(two_nights), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "mamba-130m-night2-bbbb" in res.output  # the latest night
    page = out.read_text()
    assert "<script" not in page and "http://" not in page and "https://" not in page  # nothing external
    sections = _parse(page)
    # no frontier rows, e2e rows at one batch size only and no KernelBench rows: those sections are left out
    assert list(sections) == [s.key for s in SECTIONS if s.key not in ("tilemix", "throughput", "kernelbench",
                                                                       "kb_ablation")]
    assert "TileMix" not in page
    plots = {k: v["imgs"] for k, v in sections.items() if k != "overview"}
    assert all(len(v) == 1 and _is_png(v[0]) for v in plots.values()), {k: len(v) for k, v in plots.items()}
    tables = {k: v["tables"] for k, v in sections.items()}
    # header row + data rows: 4 modules below the model in each of two phases
    assert tables["hotspots"] == {"hotspots": 1 + 8}
    assert tables["speedups"] == {"speedups per task": 1 + 3}
    assert tables["search"] == {"searches": 1 + 6}  # 3 tasks x (episodic, sample)
    assert tables["acceptance"] == {"decisions": 1 + 4}  # the decode-graphs gate and three tasks
    assert tables["e2e"] == {"end to end": 1 + 4}
    # two nights, 3 measured variants; the service's decision per night
    assert tables["history"] == {"end to end per run": 1 + 6, "runs": 1 + 2, "service decisions": 1 + 2}
    assert "2 night(s) of mamba-130m (1 keep, 1 replace); in service now: version 1" in page
    assert "tonight&#x27;s (0.028) is not faster by delta 2%" in page  # the keep's reason, verbatim (escaped)
    assert "latency +0.6 % &lt; 2 %" in page  # the rejection's reason, verbatim (escaped)
    assert "skipped: not asked for" in page


def test_service_history_joins_each_night_to_its_validations(two_nights):
    with Database(two_nights, read_only=True) as db:
        nights = ReportReader(db).frame("service_history", "mamba-130m").set_index("run_id")
        assert ReportReader(db).frame("service_history", "another-workload").empty
    n1, n2 = nights.loc["mamba-130m-night1-aaaa"], nights.loc["mamba-130m-night2-bbbb"]
    assert list(nights.index) == ["mamba-130m-night1-aaaa", "mamba-130m-night2-bbbb"]  # oldest first
    assert (n1["decision"], n1["to_version"], n2["decision"], n2["from_version"]) == ("replace", 1, "keep", 1)
    assert pd.isna(n1["current_ok"]) and bool(n1["candidate_ok"])  # nothing was in service on night 1
    assert n2["current_gain"] == pytest.approx(1 - 47.1 / 1650.0) and n2["candidate_gain"] == pytest.approx(
        1 - 46.9 / 1650.0)
    assert (nights["in_service"] == 1).all()


def test_only_the_nights_that_changed_the_bundle_are_marked_on_the_history_plot(two_nights):
    from llm4llm.report import _figure, _mark_service_nights

    with Database(two_nights, read_only=True) as db:
        nights = ReportReader(db).frame("service_history", "mamba-130m")
    ax = _figure().subplots()
    _mark_service_nights(ax, nights, {"mamba-130m-night1-aaaa-e2e": 0, "mamba-130m-night2-bbbb-e2e": 1})
    assert [line.get_xdata()[0] for line in ax.get_lines()] == [0]  # night 1 replaced; night 2 kept
    assert [t.get_text().strip() for t in ax.texts] == ["replace -> v1"]
    ax = _figure().subplots()
    _mark_service_nights(ax, nights, {})  # no evaluated run of that night: nothing to mark
    assert not ax.get_lines() and not ax.texts


def test_report_numbers_come_from_the_rows(two_nights):
    from llm4llm.report import ReportContext, e2e_table, speedups

    with Database(two_nights, read_only=True) as db:
        ctx = ReportContext(ReportReader(db), "mamba-130m-night1-aaaa", "mamba-130m")
        e = e2e_table(ctx.df("e2e")).set_index("variant")
        trials = ctx.df("trials")
        block = speedups(ctx)
    assert e.loc["patched_graphs", "speedup_vs_eager"] == pytest.approx(e.loc["eager", "total_ms"]
                                                                        / e.loc["patched_graphs", "total_ms"])
    assert e.loc["eager", "runs"] == 5 and "-" in e.loc["eager", "total_range_ms"]
    # pooled: the search's median reference over the candidate's time, only for passing timed trials
    t = trials[trials["search_id"] == trials["search_id"].iloc[0]]
    pool = t["ref_ctx_p50_ms"].median()
    ok = t[t["passed"]]
    assert ok["pooled"].to_numpy() == pytest.approx((pool / ok["ctx_p50_ms"]).to_numpy())
    assert t.loc[~t["passed"], "pooled"].isna().all()
    per_task = block.tables[0][1].set_index("index" if "index" in block.tables[0][1] else "task_id")
    assert per_task.loc["mamba-decode-norm-3", "trials"] == 12 and per_task.loc["mamba-decode-norm-3", "passed"] == 9


def test_a_section_is_one_decorated_function(two_nights):
    """What a later section (e.g. a kernel frontier) needs: register, render, and it appears with its plot."""
    from llm4llm import report

    before = list(report.SECTIONS)
    try:
        @report.section("frontier", "Frontier")
        def frontier(ctx):
            fig = report._figure(4, 3)
            t = ctx.df("trials")
            fig.subplots().scatter(t["ctx_p50_ms"], t["pooled"])
            return report.Block(figures=[fig], tables=[("points", t[["candidate_id", "pooled"]].head(3))])

        with Database(two_nights, read_only=True) as db:
            page = report.render_report(ReportReader(db), "mamba-130m-night1-aaaa", [report.SECTIONS[-1]])
        assert report.SECTIONS[-1].key == "frontier" and len(report.SECTIONS) == len(before) + 1
        sec = _parse(page)["frontier"]
        assert len(sec["imgs"]) == 1 and _is_png(sec["imgs"][0]) and sec["tables"] == {"points": 4}
    finally:
        report.SECTIONS[:] = before


def test_markdown_artifacts_and_cli_errors(two_nights):
    from typer.testing import CliRunner

    from cli.main import app
    from llm4llm.report import ARTIFACTS, artifact_key, markdown

    with Database(two_nights, read_only=True) as db:
        md = {k: markdown(k, ReportReader(db), "mamba-130m-night2-bbbb") for k in ARTIFACTS}
    assert md["acceptance"].count("\n| ") == 1 + 4 and "3 accepted, 1 rejected" in md["acceptance"]
    assert "bracketed gains 0.4, 0.6, 0.9 %" in md["acceptance"]
    assert md["leaderboard"].count("\n| ") == 1 + 9  # the best 3 passing candidates of each of 3 tasks
    assert "patched_graphs" in md["e2e"] and "backbone.layers.0.mixer" in md["hotspots"]
    assert artifact_key("Mamba_130M", "e2e") == "mamba-130m-e2e"
    res = CliRunner().invoke(app, ["report", "--workload", "nope", "--db", str(two_nights)])
    assert res.exit_code == 2 and "nope" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["sql", "select variant, count(*) n from e2e_results group by variant order by 1",
                                   "--db", str(two_nights)])
    assert res.exit_code == 0 and "patched_graphs" in res.output, res.output


def test_a_run_publishes_its_markdown_artifacts_under_per_workload_keys(prefect_harness, two_nights):
    from prefect import flow
    from prefect.artifacts import Artifact

    from llm4llm.report import ARTIFACTS
    from tasks.reporting import publish_markdown

    @flow
    def publish_all() -> list[str]:
        return [publish_markdown(k, "mamba-130m", "mamba-130m-night2-bbbb", str(two_nights)) for k in ARTIFACTS]

    keys = publish_all()
    assert keys == [f"mamba-130m-{k}" for k in ARTIFACTS]
    arts = {k: Artifact.get(k) for k in keys}
    assert all(a is not None and a.type == "markdown" for a in arts.values())
    assert "latency +0.6 % < 2 %" in arts["mamba-130m-acceptance"].data
    assert "patched_graphs" in arts["mamba-130m-e2e"].data


FRONTIER = Path(__file__).resolve().parents[1] / "docs/results/2026-12-01-h200-tilemix/frontier.jsonl"
LONG = {"workload_hash": "long01", "name": "qwen3-4b-long", "path": "/w/qwen3-4b-long.toml", "config": {}}


@pytest.fixture(scope="module")
def tilemix_db(tmp_path_factory):
    """A qwen3-4b-long run and the committed H200 frontier (read from docs/results at test time) tied to its
    workload through storage's own row builder and writer."""
    from storage.rows import tilemix_frontier_rows

    path = tmp_path_factory.mktemp("tilemix") / "t.duckdb"
    records = [json.loads(line) for line in FRONTIER.read_text().splitlines() if line.strip()]
    with Database(path) as db:
        repo.record_profile_run(db, {
            "run_id": "qwen3-4b-long-run1", "workload_hash": LONG["workload_hash"], "workload_name": LONG["name"],
            "kind": "optimize", "status": "ok", "started_at": datetime(2026, 12, 1, 3), "device": "cuda",
            "gpu_name": "NVIDIA H200", "timer": "cuda_event", "prefill_forwards": 1, "decode_forwards": 4}, LONG, [])
        rows = tilemix_frontier_rows(records, "2026-12-01-h200-tilemix", workload_name=LONG["name"],
                                     gpu_name="NVIDIA H200", heads=(32, 8, 128))
        assert repo.record_tilemix_frontier(db, rows) == len(rows)
        assert repo.record_tilemix_frontier(db, rows) == len(rows)  # recorded again: replaced, not doubled
    return path, [r for r in records if r["kind"] == "frontier"]


def test_tilemix_frontier_section_from_the_committed_h200_rows(tilemix_db, two_nights):
    from llm4llm import report

    path, records = tilemix_db
    assert len(records) == 60  # 4 lengths x (SDPA, 0 %, 100 %, 3 templates x 4 coverages)
    with Database(path, read_only=True) as db:
        page = report.render_report(ReportReader(db), "qwen3-4b-long-run1")
        block = report.tilemix_frontier(report.ReportContext(ReportReader(db), "qwen3-4b-long-run1", LONG["name"]))
    sec = _parse(page)["tilemix"]
    assert len(sec["imgs"]) == 1 and _is_png(sec["imgs"][0]) and sec["tables"] == {"frontier": 1 + 60}
    assert 'href="#tilemix"' in page and "NVIDIA H200" in page
    table = block.tables[0][1]
    for r in records:  # every number of the table is the committed file's
        got = table[(table["seq_len"] == r["S"]) & (table["template"] == r["template"])
                    & (table["coverage"].isna() if r["coverage"] is None else table["coverage"] == r["coverage"])]
        assert len(got) == 1, r
        for col, key in (("p50_ms", "p50_ms"), ("vs_sdpa", "vs_sdpa"), ("rel_err_fp32", "rel_err_fp32"),
                         ("realised_coverage", "realised")):
            assert got.iloc[0][col] == pytest.approx(r[key]) or (r[key] is None and pd.isna(got.iloc[0][col]))
    ax_speed, ax_err = block.figures[0].axes
    assert len(ax_speed.get_lines()) == 3 * 4 + 1  # one line per template and length, and SDPA's level
    with Database(two_nights, read_only=True) as db:  # another workload's run: the section says nothing
        assert report.tilemix_frontier(report.ReportContext(ReportReader(db), "mamba-130m-night1-aaaa", "mamba-130m")) is None


def test_tilemix_frontier_scope_prefers_the_run(tilemix_db):
    """A bench tied to the run wins over a later one tied only to its workload; an unrelated run sees neither."""
    from storage import report_queries as q
    from storage.rows import tilemix_frontier_rows

    path, records = tilemix_db
    one = [r for r in records if r["S"] == 4096]
    with Database(path.with_name("scope.duckdb")) as db:
        repo.record_tilemix_frontier(db, tilemix_frontier_rows(one, "b1-run", run_id="r1", workload_name="w"))
        repo.record_tilemix_frontier(db, tilemix_frontier_rows(one[:3], "b2-later", workload_name="w"))
        assert set(q.tilemix_frontier(db, "r1", "w")["bench_id"]) == {"b1-run"}
        assert set(q.tilemix_frontier(db, "r2", "w")["bench_id"]) == {"b2-later"}
        assert q.tilemix_frontier(db, "r3", "other").empty
