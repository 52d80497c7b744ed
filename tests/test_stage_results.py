"""One typed result per stage, frozen, handed on unchanged (issue 41): the search stage's SearchSummary (its
`ended_by` an EpisodeEnd; serialized only where it crosses from a Ray worker to the flow, and rebuilt there), the
evaluate stage's E2ERow measurements (parsed from the sandboxed child's JSON lines) and EvaluateResult, the
acceptance stage's AcceptSummary, a search Trial's Verdict (typed on the trial, dumped only into the transcript),
and the flow's OptimizeResult / NightlyResult, which hold the stages' objects as the stages returned them."""
import json
from types import SimpleNamespace

import pydantic
import pytest
import torch

from llm4llm import isolation
from llm4llm.config import SearchSettings
from llm4llm.outcomes import EpisodeEnd
from llm4llm.search import LibraryProposer, run_search
from llm4llm.search.templates.base import Template, header
from llm4llm.stages import evaluate as evaluate_stage
from llm4llm.stages.evaluate import E2ERow, run_evaluate
from llm4llm.stages.extract import ExtractedTasks
from llm4llm.stages.profile import ProfiledRun
from llm4llm.stages.search import SearchSummary, record_packed_search, search_summary
from llm4llm.taskspec import TaskSpec, write_task
from llm4llm.verdict import Latency, Verdict


def _finished_search(ended: EpisodeEnd, detail: str):
    """A SearchResult's shape as search_summary reads it: trials, pass rate, best trial, episodes."""
    best = SimpleNamespace(candidate=SimpleNamespace(id="c1"), feedback=SimpleNamespace(utility=1.7))
    episode = SimpleNamespace(ended=ended, ended_by=f"{ended}: {detail}")
    return SimpleNamespace(best=best, trials_used=4, pass_rate=0.5, episodes=[episode, episode])


def test_a_search_summary_is_frozen_and_ends_by_an_episode_end():
    s = search_summary("s1", "t1", _finished_search(EpisodeEnd.STOPPED, "time share spent"))
    assert isinstance(s.ended_by, EpisodeEnd) and s.ended_by == EpisodeEnd.STOPPED == "stopped"
    assert s.ended_text == "stopped: time share spent"
    assert (s.trials, s.pass_rate, s.best_candidate, s.best_utility, s.episodes) == (4, 0.5, "c1", 1.7, 2)
    assert not s.llm_backed and s.llm_calls is None and s.placement is None
    with pytest.raises(pydantic.ValidationError):
        s.trials = 5
    with pytest.raises(pydantic.ValidationError):
        SearchSummary(search_id="s", task_id="t", ended_by="bored")  # not an EpisodeEnd


def test_a_search_summary_round_trips_through_its_serialized_form():
    llm = SimpleNamespace(calls=[1, 2, 3], tokens_used=450, cost_used=0.0125, exhausted="token budget spent")
    s = search_summary("s1", "t1", _finished_search(EpisodeEnd.EXHAUSTED, "x"), SimpleNamespace(llm=llm))
    assert s.llm_backed and (s.llm_calls, s.llm_tokens, s.llm_cost_usd) == (3, 450, 0.0125)
    wire = json.loads(json.dumps(s.model_dump(mode="json")))  # as a Ray worker's rows carry it
    assert wire["ended_by"] == "exhausted"
    back = SearchSummary.model_validate(wire)
    assert back == s and isinstance(back.ended_by, EpisodeEnd)

    class Repo:  # storage.store.Store.record_search_rows hands back the summary the rows carried
        def record_search_rows(self, rows, data_dir):
            return rows["summary"]

    where = {"gpu_ids": ["0"], "started": 1.0, "finished": 2.0}
    recorded = record_packed_search({"summary": wire, "placement": where}, Repo(), "data")
    assert isinstance(recorded, SearchSummary) and recorded.placement == where
    assert recorded.model_copy(update={"placement": None}) == s


def test_run_evaluate_returns_typed_rows_parsed_from_the_childs_json_lines(tmp_path, monkeypatch):
    from llm4llm.evaluate import E2EResult
    from llm4llm.verify import sandbox

    def row(variant, batch, total):
        r = E2EResult(variant=variant, prefill_ms=1.0, decode_ms_per_token=2.0, total_ms=total, tokens_per_s=50.0,
                      peak_mem_mb=10.0, batch_size=batch, prompt_len=8).to_row()
        return {**r, "gpu_name": None, "versions_json": {"torch": torch.__version__}}

    lines = [row("eager", 1, 30.0), row("patched", 1, 20.0), row("eager", 1, 29.0)]  # eager measured again

    def child(fn, *args, outputs, poll, **kw):
        with open(outputs["results_path"], "w") as f:
            f.write("\n".join(json.dumps(r) for r in lines) + "\n")
        poll()

    monkeypatch.setattr(isolation, "in_subprocess", child)
    monkeypatch.setattr(isolation, "workload_paths", lambda p: [])
    monkeypatch.setattr(sandbox, "make_box", lambda prefix: tmp_path)
    seen = []
    out = run_evaluate(str(tmp_path / "wl.toml"), on_measured=seen.extend)
    assert all(isinstance(r, E2ERow) for r in out + seen) and len(seen) == 3
    assert [(r.variant, r.total_ms) for r in out] == [("eager", 29.0), ("patched", 20.0)]  # the newest per point
    with pytest.raises(pydantic.ValidationError):
        out[0].total_ms = 1.0
    # every field llm4llm.evaluate writes, no more: the e2e_results row is the typed row serialized
    assert set(E2ERow.model_fields) == set(lines[0])
    from storage.store import Store

    [stored] = Store.e2e_rows("r1", "h1", out[:1])
    assert stored == {"run_id": "r1", "workload_hash": "h1", **json.loads(json.dumps(lines[2]))}
    assert evaluate_stage.E2ERow is E2ERow



def test_e2e_fields_are_declared_once_the_row_adds_only_the_gpu_and_the_versions():
    """The measured fields are declared once (llm4llm.e2e_result.E2EResult, which the measuring code fills); E2ERow
    is its frozen subclass and restates none of them, adding only gpu_name and versions_json."""
    from llm4llm.evaluate import E2EResult

    assert issubclass(E2ERow, E2EResult)
    assert set(E2ERow.model_fields) == set(E2EResult.model_fields) | {"gpu_name", "versions_json"}
    assert set(E2ERow.__annotations__) == {"gpu_name", "versions_json"}  # declared in E2ERow's body: these only
    r = E2EResult(variant="eager", total_samples_ms=[1.0])
    r.cpu_samples_ms = [2.0]  # mutable, validated: samples become a tuple, as in the frozen row
    assert r.cpu_samples_ms == (2.0,) and set(r.to_row()) == set(E2EResult.model_fields)
    with pytest.raises(pydantic.ValidationError):
        E2EResult(variant="eager", samples_ms=[1.0])  # the stored name only (total_samples_ms)
    with pytest.raises(pydantic.ValidationError):
        E2ERow(variant="eager").notes = "x"


def _render(spec, config):
    return header("fake.tiles", spec, ["from kernels_runtime.ops.linear import linear"], config) + \
        "\ndef entry(inputs, weights, state, static):\n    return {}\n"


FAKE = Template(name="fake.tiles", family="norm", phases=("prefill", "decode"), requires=(),
                space_fn=lambda spec: {"BLOCK": [32, 64, 128], "num_warps": [1, 2, 4, 8]}, render_fn=_render,
                default_fn=lambda spec: {"BLOCK": 64, "num_warps": 4})


def test_a_trial_keeps_its_verdict_typed_and_its_transcript_holds_it_as_json(tmp_path):
    spec = TaskSpec(family="norm", module_class="fake.Norm", instances=["model.norm"], phase="prefill",
                    input_names=["hidden_states"], weight_names=["weight"], output_names=["out"], cases=[],
                    dtype="float32")
    task_dir = write_task(tmp_path / "tasks", spec, torch.nn.Identity(), [])
    lat = Latency(p20=1.0, p50=1.0, p80=1.0, reps=5)

    def verify(_task_dir, source):  # the verifier's Verdict, or a stand-in's dict of its fields
        if "'num_warps': 8" in source:
            return {"passed": False, "failure_class": "compile", "message": "out of resources"}
        return Verdict(source_hash="h", task_id=spec.task_id, passed=True, candidate_in_context=lat,
                       reference_in_context=lat, speedup_in_context=1.0, utility=1.0)

    res = run_search(task_dir, LibraryProposer(seed=0, templates=[FAKE]), verify,
                     SearchSettings(mode="sample", budget=6), archive_dir=tmp_path / "archive")
    assert res.trials and all(isinstance(t.verdict, Verdict) for t in res.trials)
    failed = [t for t in res.trials if not t.verdict.passed]
    assert failed and all(t.verdict.failure_class == "compile" and t.verdict.task_id == spec.task_id
                          for t in failed)
    [transcript] = (tmp_path / "archive").glob("*.json")
    trials = json.loads(transcript.read_text())["trials"]
    assert [t["verdict"] for t in trials] == [t.verdict.model_dump(mode="json") for t in res.trials]


def _acceptance_result(decisions, bundle_dir=None):
    from llm4llm.accept import AcceptanceResult

    return AcceptanceResult(decisions, bundle_dir, 10.0, 9.0, "logits_rel_l2_floor", "cuda", floor_note="3 runs",
                            graphs="")


def test_accept_recorded_returns_a_frozen_accept_summary_and_records_the_outcome(monkeypatch):
    from llm4llm.outcomes import AcceptDecision, AcceptTiming, DecidedBy
    from llm4llm.stages import accept as accept_stage
    from llm4llm.stages.accept import AcceptOutcome, AcceptSummary

    def decision(task_id, verdict, by):
        return SimpleNamespace(task_id=task_id, decision=verdict, accepted=verdict == AcceptDecision.ACCEPTED,
                               retried=lambda: verdict == AcceptDecision.REJECTED and by != DecidedBy.LATENCY_SKIPPED)

    result = _acceptance_result([decision("won", AcceptDecision.ACCEPTED, DecidedBy.LATENCY),
                                 decision("slow", AcceptDecision.REJECTED, DecidedBy.LATENCY),
                                 decision("cpu", AcceptDecision.REJECTED, DecidedBy.LATENCY_SKIPPED)], "/b/run-1")
    outcome = AcceptOutcome("run-1", "wl", result)
    monkeypatch.setattr(accept_stage, "best_proposals", lambda *a, **kw: [])
    monkeypatch.setattr(accept_stage, "run_accept", lambda *a, **kw: outcome)
    recorded = []
    repo = SimpleNamespace(record_acceptance=recorded.append)
    s = accept_stage.accept_recorded("wl.toml", "run-1", repo, "data")
    assert recorded == [outcome]  # storage gets the typed outcome; the flow its summary
    assert isinstance(s, AcceptSummary) and s == outcome.summary()
    assert (s.bundle, s.accepted, s.rejected) == ("/b/run-1", 1, 2)
    assert s.accepted_tasks == ("won",) and s.retry_tasks == ("slow",)
    assert (s.timing, s.metric, s.floor, s.baseline_ms, s.final_ms) == ("cuda", "logits_rel_l2_floor", "3 runs",
                                                                         10.0, 9.0)
    assert s.timing is AcceptTiming.CUDA  # the string the result carried, as its member
    with pytest.raises(pydantic.ValidationError):
        s.accepted = 2
    with pytest.raises(pydantic.ValidationError):
        AcceptSummary(bundle=None, verdict="yes")  # no field beyond the summary's
    with pytest.raises(pydantic.ValidationError):
        AcceptSummary(timing="on a hunch")  # not an AcceptTiming


def test_evaluate_recorded_returns_a_frozen_evaluate_result_of_typed_rows(monkeypatch):
    from llm4llm.evaluate import table_rows
    from llm4llm.stages import common
    from llm4llm.stages.evaluate import EvaluateResult, evaluate_recorded

    rows = [E2ERow(variant="eager", total_ms=30.0, total_samples_ms=(29.0, 31.0)),
            E2ERow(variant="patched", total_ms=20.0, vs_eager=1.5)]
    monkeypatch.setattr(common, "describe_workload", lambda p: {"name": "wl", "workload_hash": "h1"})

    def measure(workload_path, *, on_measured, **kw):
        on_measured(rows)
        return rows

    monkeypatch.setattr(evaluate_stage, "run_evaluate", measure)
    written = []
    repo = SimpleNamespace(e2e_rows=lambda run_id, h, measured: [(run_id, h, m.variant) for m in measured],
                           record_e2e=written.extend)
    out = evaluate_recorded("wl.toml", repo, run_id="r-e2e")
    assert isinstance(out, EvaluateResult) and out.run_id == "r-e2e"
    assert out.rows == tuple(rows) and all(a is b for a, b in zip(out.rows, rows))  # the rows as measured
    assert written == [("r-e2e", "h1", "eager"), ("r-e2e", "h1", "patched")]  # serialized only for storage
    with pytest.raises(pydantic.ValidationError):
        out.run_id = "other"
    shown = table_rows(out.rows)  # a table reads the typed rows
    assert shown[0]["total_range_ms"] == "29.0-31.0" and shown[1]["vs_eager"] == "1.50x"
    assert table_rows([r.model_dump(mode="json") for r in rows]) == shown  # as a stored row shows the same


def test_the_prefect_tasks_hand_on_the_stages_objects(monkeypatch):
    import tasks.acceptance as ta
    from llm4llm.stages.accept import AcceptSummary
    from llm4llm.stages.evaluate import EvaluateResult

    acc = AcceptSummary(bundle="/b", accepted=1, accepted_tasks=("t",))
    ev = EvaluateResult(run_id="r-e2e", rows=(E2ERow(variant="eager", total_ms=3.0),))
    monkeypatch.setattr(ta.accept_stage, "accept_recorded", lambda *a, **kw: acc)
    monkeypatch.setattr(ta.evaluate_stage, "evaluate_recorded", lambda *a, **kw: ev)
    tables = []
    monkeypatch.setattr(ta, "create_table_artifact", lambda key, table, description: tables.append(table))
    assert ta.accept_patches.fn("wl.toml", "r", None, None, "data") is acc
    assert ta.evaluate_e2e.fn("wl.toml", None, None, None, "r-e2e") is ev
    assert [t["variant"] for t in tables[0]] == ["eager"]  # the artifact's table made from the typed rows


def _fake_run(monkeypatch, tmp_path, searches, acceptances, e2e):
    """flows.optimize with its tasks replaced: the profile, extraction and plan of one task `t1`, the searches,
    acceptance steps and evaluation returning the given objects in turn."""
    import flows.optimize as opt
    from llm4llm import planner
    from llm4llm.planner import PlanAction, PlanItem

    def plan(run, searched=(), excluded=()):
        item = PlanItem("t1", "mlp", "decode", 1.0, 2.0, 0.5, PlanAction.SKIP if searched else PlanAction.SEARCH,
                        "hot", trials=1, artifact_path=str(tmp_path / "t1"))
        est = SimpleNamespace(trial_s=0.01, accept_s=0.0, evaluate_s=0.0, evaluate_rounds_s=0.0)
        return planner.Plan([item], None, None, est)

    calls = {"search": iter(searches), "accept": iter(acceptances), "base": []}

    def accept(*a, base_bundle=None, **kw):
        calls["base"].append(base_bundle)
        return next(calls["accept"])

    monkeypatch.setattr(opt, "profile_workload", lambda *a, **kw: ProfiledRun(
        run_id="run-1", profile_path="/p.json", workload={"name": "wl", "device": "cpu"}))
    monkeypatch.setattr(opt, "extract_tasks", lambda *a, **kw: ExtractedTasks(run_id="run-1", index_path="/i.json",
                                                                              tasks=1))
    monkeypatch.setattr(opt, "decode_graphs_plan", lambda *a: (False, False, "off: on the CPU"))
    monkeypatch.setattr(opt, "_plan", plan)
    monkeypatch.setattr(opt, "search_task", lambda *a, **kw: next(calls["search"]))
    monkeypatch.setattr(opt, "close_pools", lambda: None)
    monkeypatch.setattr(opt, "accept_patches", accept)
    monkeypatch.setattr(opt, "evaluate_e2e", lambda *a, **kw: e2e)
    monkeypatch.setattr(opt, "eval_batches", lambda *a: None)
    monkeypatch.setattr(opt, "_publish", lambda *a: None)
    monkeypatch.setattr(opt, "_coverage_artifact", lambda *a: None)
    return calls


def test_the_flow_returns_a_frozen_optimize_result_holding_each_stages_object_unchanged(monkeypatch, tmp_path):
    """Two rounds (config.search.rounds): `t1` rejected in the first step is searched and accepted again on top of
    the first step's bundle; the result holds both searches and both steps as the stages returned them."""
    import time

    import flows.optimize as opt
    from llm4llm.config import OptimizeConfig
    from llm4llm.outcome import OptimizeResult
    from llm4llm.stages.accept import AcceptSummary
    from llm4llm.stages.evaluate import EvaluateResult

    searches = [SearchSummary(search_id=f"s{k}", task_id="t1", trials=1, best_candidate="c") for k in (1, 2)]
    steps = [AcceptSummary(bundle="/b/run-1", accepted=1, rejected=1, accepted_tasks=("t0",), retry_tasks=("t1",),
                           graphs="decode graphs on"),
             AcceptSummary(bundle=None, accepted=0, rejected=1)]
    e2e = EvaluateResult(run_id="run-1-e2e", rows=(E2ERow(variant="eager", total_ms=30.0),
                                                   E2ERow(variant="patched", total_ms=20.0, vs_eager=1.5)))
    calls = _fake_run(monkeypatch, tmp_path, searches, steps, e2e)
    cfg = OptimizeConfig(search={"rounds": 2})
    out = opt._optimize(opt._Run("wl.toml", cfg, None, str(tmp_path), time.time()), "cli")
    assert isinstance(out, OptimizeResult)
    assert all(a is b for a, b in zip(out.searches, searches)) and len(out.searches) == 2
    assert all(a is b for a, b in zip(out.acceptances, steps)) and len(out.acceptances) == 2
    assert out.e2e is e2e
    assert calls["base"] == [None, "/b/run-1"]  # the retry is accepted on top of the first step's bundle
    assert out.acceptance is steps[1] and out.bundle == "/b/run-1" and out.accepted_tasks == ("t0",)
    assert (out.run_id, out.profile_path, out.index_path, out.tasks) == ("run-1", "/p.json", "/i.json", 1)
    assert out.decode_graphs == "off: on the CPU"  # the last step made no decode-graphs decision
    assert out.plan and out.plan[0]["task_id"] == "t1"
    assert out.summary[0].startswith("result: patched 20.0 ms") and "bundle: /b/run-1 (t0)" in out.summary
    with pytest.raises(pydantic.ValidationError):
        out.run_id = "other"
    with pytest.raises(pydantic.ValidationError):
        OptimizeResult(run_id="r", searches=({"task_id": "t"},))  # a search is a SearchSummary


def test_the_nightly_flow_hands_on_the_optimize_result_unchanged(monkeypatch):
    from contextlib import nullcontext

    import flows.nightly as fn
    from llm4llm.outcome import NightlyResult, OptimizeResult
    from llm4llm.stages.accept import AcceptSummary

    run = OptimizeResult(run_id="run-1", acceptances=(AcceptSummary(bundle="/b/run-1", accepted=1),))
    seen = {}

    def decide(workload_path, run_id, candidate, current, *a):
        seen.update(run_id=run_id, candidate=candidate, current=current)
        return {"decision": "replace"}

    monkeypatch.setattr(fn, "gpu_slot", lambda device: nullcontext())
    monkeypatch.setattr(fn, "describe", lambda p: {"device": "cpu"})
    monkeypatch.setattr(fn, "revalidate_current", lambda *a: None)
    monkeypatch.setattr(fn, "optimize_workload", lambda *a, **kw: run)
    monkeypatch.setattr(fn, "decide_service", decide)
    night = fn.nightly_workload.fn("wl.toml", data_dir="data")
    assert isinstance(night, NightlyResult) and night.optimize is run and night.service == {"decision": "replace"}
    assert seen == {"run_id": "run-1", "candidate": "/b/run-1", "current": None}
    with pytest.raises(pydantic.ValidationError):
        night.service = {}


def test_the_profile_and_extract_flows_return_frozen_typed_results(monkeypatch, tmp_path):
    """profile-workload returns a ProfiledRun holding describe_workload's dict as the stage handed it;
    extract-tasks returns an ExtractedTasks; both frozen, both refusing fields they do not declare."""
    import flows.profiling as fp

    wl = {"workload_hash": "h1", "name": "wl", "path": "/wl.toml", "device": "cpu", "config": {}}
    profile_path, index_path = tmp_path / "profile.json", tmp_path / "tasks.json"
    profile_path.write_text("{}")
    index_path.write_text("[]")
    finished = []

    class Stage:  # a prefect task as the flow calls it: with_options(...)(args)
        def __init__(self, path):
            self.path = path

        def with_options(self, **kw):
            return lambda *a: str(self.path)

    monkeypatch.setattr(fp.profiling, "describe", lambda p: wl)
    monkeypatch.setattr(fp.profiling, "profile", Stage(profile_path))
    monkeypatch.setattr(fp.profiling, "record_profile", lambda *a: "run-1")
    monkeypatch.setattr(fp.profiling, "publish_hotspots", lambda p: None)
    monkeypatch.setattr(fp, "Store", lambda db: SimpleNamespace(finish_run=finished.append))
    monkeypatch.setattr(fp.extraction, "extract", Stage(index_path))
    monkeypatch.setattr(fp.extraction, "record_tasks", lambda *a: 3)
    monkeypatch.setattr(fp.extraction, "publish_tasks", lambda p: None)
    prof = fp.profile_workload.fn("wl.toml", data_dir=str(tmp_path), kind="cli")
    assert isinstance(prof, ProfiledRun) and prof.workload == wl and finished == ["run-1"]
    assert (prof.run_id, prof.profile_path) == ("run-1", str(profile_path))
    ext = fp.extract_tasks.fn("wl.toml", prof.run_id, prof.profile_path, data_dir=str(tmp_path))
    assert isinstance(ext, ExtractedTasks) and (ext.run_id, ext.index_path, ext.tasks) == ("run-1", str(index_path), 3)
    for obj, field in ((prof, "run_id"), (ext, "tasks")):
        with pytest.raises(pydantic.ValidationError):
            setattr(obj, field, "other")
    with pytest.raises(pydantic.ValidationError):
        ExtractedTasks(run_id="r", index_path="/i.json", tasks=1, extra=2)


def test_run_kernelbench_returns_a_frozen_result_and_dumps_each_problem_only_for_storage(monkeypatch):
    """The stage hands the repository each KernelBenchProblem as a `kernelbench_results` row (a dict of every
    column), and its caller the very problems run_problems made, in a frozen KernelBenchResult."""
    from llm4llm.kernelbench import run as kb_run
    from llm4llm.kernelbench.run import KernelBenchProblem
    from llm4llm.stages.kernelbench import KernelBenchResult, run_kernelbench

    made, told, written = [], [], []

    def run_problems(directory, data_dir, search, trials, record, *, on_problem=None, **kw):
        p = KernelBenchProblem(kb_run_id="kb-1", problem="2_G.py", problem_id=2, task_id="t2", mode="episodic",
                               proposer="library", budget=1, trials=1, passed=True, search_id="s1", speedup_eager=1.5)
        record(p)
        on_problem(p)
        made.append(p)
        return "kb-1", [p]

    monkeypatch.setattr(kb_run, "run_problems", run_problems)
    repo = SimpleNamespace(candidate_rows=lambda s: None, record_kb_result=written.append)
    out = run_kernelbench("kb", repo, "data", on_problem=told.append)
    assert isinstance(out, KernelBenchResult) and out.run_id == "kb-1" and out.problems[0] is made[0] is told[0]
    assert written == [made[0].model_dump()] and written[0]["speedup_eager"] == 1.5 and "skipped_reason" in written[0]
    with pytest.raises(pydantic.ValidationError):
        out.problems[0].passed = False
    with pytest.raises(pydantic.ValidationError):
        out.run_id = "kb-2"


def test_check_applicability_returns_frozen_template_checks_and_dumps_them_only_for_storage(monkeypatch, tmp_path):
    """Checks run now are written as `template_checks` rows (dicts) and returned as frozen TemplateCheckRecords;
    recorded ones are read back into the same records (a NULL read through pandas as NaN made None)."""
    from llm4llm.stages import search as stage
    from llm4llm.stages.search import TemplateCheckRecord

    spec = SimpleNamespace(task_id="t1", family="norm", phase="decode")
    monkeypatch.setattr("llm4llm.taskspec.load_spec", lambda d: spec)
    monkeypatch.setattr(stage, "family_templates", lambda s: {"a", "b"})
    ran = [TemplateCheckRecord(task_id="t1", template="a", applicable=True, stage="computation", pinned={"BLOCK": 8}),
           TemplateCheckRecord(task_id="t1", template="b", applicable=False, stage="scope", reason="no")]
    monkeypatch.setattr(stage, "run_template_checks", lambda *a, **k: ran)
    written = []
    repo = SimpleNamespace(template_check_records=lambda ids, cv: [], record_template_checks=written.extend,
                           experience_records=lambda task_id: [])
    got = stage.check_applicability(str(tmp_path), repo, "run-1", "cpu", SearchSettings())
    assert got is ran and written == [c.model_dump() for c in ran] and written[0]["pinned"] == {"BLOCK": 8}
    with pytest.raises(pydantic.ValidationError):
        got[0].applicable = False
    rows = [{**w, "pinned_json": json.dumps(w.pop("pinned")), "run_id": float("nan"), "checked_at": None}
            for w in written]
    repo = SimpleNamespace(template_check_records=lambda ids, cv: rows)
    back = stage.check_applicability(str(tmp_path), repo, "run-1", "cpu", SearchSettings())
    assert back == ran and all(isinstance(c, TemplateCheckRecord) for c in back)
    templates = [SimpleNamespace(name=n, pinned=lambda p, n=n: (n, p)) for n in ("a", "b")]
    assert stage.applicable_templates_of(templates, back) == [("a", {"BLOCK": 8})]
