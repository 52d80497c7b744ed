"""The outcome enums (llm4llm.outcomes): their values are what DuckDB rows and transcripts hold, and code decides on
them, never on the reason text beside them."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from llm4llm.accept import AcceptanceResult, Decision
from llm4llm.config import SearchSettings
from llm4llm.outcomes import AcceptDecision, DecidedBy, EpisodeEnd, FailureClass
from llm4llm.search.episode import Ending
from llm4llm.stages.accept import AcceptOutcome
from llm4llm.verify.verdict import Verdict

CPU_SKIP = "latency gate skipped on the CPU: no CPU timing may accept a patch (in-model correctness ok: ...)"


def test_the_stored_strings_are_pinned():
    assert [c.value for c in FailureClass] == [
        "static", "compile", "runtime_error", "timeout", "gpu_fault", "oom", "wrong_output", "nan_inf",
        "shape_dtype", "unwritten_output", "input_mutated", "cached_output", "side_stream", "out_of_bounds",
        "no_triton", "worker_crash", "interrupted", "precision_changed", "torch_compute", "impossible_time",
        "timed_output_mismatch", "output_aliased"]
    assert [d.value for d in AcceptDecision] == ["accepted", "rejected"]
    assert [e.value for e in EpisodeEnd] == ["length", "stuck", "exhausted", "stopped"]
    assert json.dumps([AcceptDecision.REJECTED, FailureClass.OOM]) == '["rejected", "oom"]'


def _decision(task: str, reason: str, by: DecidedBy, decision: str = "rejected") -> Decision:
    return Decision(task, "c1", decision, reason, "logits_rel_l2_floor", None, None, None, None, 0.1, decided_by=by)


def test_a_decision_takes_its_enums_from_strings_and_refuses_unknown_ones():
    d = _decision("t", "in-model correctness: rel-L2 0.2", "in_model")
    assert d.decision is AcceptDecision.REJECTED and d.decided_by is DecidedBy.IN_MODEL and not d.accepted
    with pytest.raises(ValueError):
        _decision("t", "x", DecidedBy.LATENCY, decision="maybe")


def test_the_retry_follows_the_kind_not_the_text():
    """The CPU's skipped latency gate is no fault of the candidate: not retried, whatever its reason says; any other
    rejection is retried, even one whose words read like the CPU skip."""
    decisions = [_decision("skipped", "in-model ok", DecidedBy.LATENCY_SKIPPED),
                 _decision("look-alike", CPU_SKIP, DecidedBy.IN_MODEL),
                 _decision("slow", "end-to-end gain +0.5% below delta 2%", DecidedBy.LATENCY),
                 _decision("won", "end-to-end gain +9%", DecidedBy.LATENCY, decision="accepted")]
    assert [d.retried() for d in decisions] == [False, True, True, False]
    result = AcceptanceResult(decisions, None, None, None, "logits_rel_l2_floor", "skipped: cpu")
    s = AcceptOutcome("run-1", "wl", result).summary()
    assert s.retry_tasks == ("look-alike", "slow") and s.accepted_tasks == ("won",)
    assert (s.accepted, s.rejected) == (1, 3)


def test_the_acceptances_row_holds_the_plain_string():
    from storage.rows import decision_rows

    d = _decision("t", "in-model correctness: rel-L2 0.2", DecidedBy.IN_MODEL)
    [row] = decision_rows(AcceptanceResult([d], None, None, None, "m", "skipped: cpu"), "run-1")
    assert row["decision"] == "rejected" and str(row["decision"]) == "rejected"


def test_a_verdict_records_a_member_and_dumps_its_string():
    v = Verdict(source_hash="h", task_id="t").fail("compile", "compile", "boom")
    assert v.failure_class is FailureClass.COMPILE
    assert v.model_dump(mode="json")["failure_class"] == "compile"
    assert Verdict.model_validate_json(v.model_dump_json()).failure_class is FailureClass.COMPILE


def test_an_unknown_class_from_a_worker_reply_is_a_worker_crash():
    v = Verdict(source_hash="h", task_id="t").fail("correctness", "all_good", "forged")
    assert v.failure_class is FailureClass.WORKER_CRASH and not v.passed
    assert "unknown failure class 'all_good'" in v.message


def test_an_ending_reads_as_before():
    assert str(Ending(EpisodeEnd.STUCK, "compile: out of resources")) == "stuck: compile: out of resources"
    assert str(Ending(EpisodeEnd.EXHAUSTED)) == "exhausted" and str(Ending(EpisodeEnd.LENGTH)) == "length"


def test_the_search_stops_on_the_kind_of_ending(tmp_path: Path, monkeypatch):
    """An episode that the stop rule ends is the last, whatever words the rule gave; a stuck one is followed by
    another."""
    from llm4llm.search import episode

    spec = SimpleNamespace(task_id="t")
    monkeypatch.setattr(episode, "load_spec", lambda _: spec)
    monkeypatch.setattr(episode, "distil", lambda *a, **k: episode.Experience(task_id="t"))
    ends = iter([Ending(EpisodeEnd.STUCK, "stopped: a signature that reads like a stop"),
                 Ending(EpisodeEnd.STOPPED, "time share spent"), Ending(EpisodeEnd.LENGTH)])
    monkeypatch.setattr(episode._Run, "episode", lambda self, *a, **k: next(ends))
    proposer = SimpleNamespace(name="fake")
    result = episode.run_search(tmp_path, proposer, lambda *a: None, SearchSettings(budget=10),
                                archive_dir=tmp_path / "a")
    assert [e.ended for e in result.episodes] == [EpisodeEnd.STUCK, EpisodeEnd.STOPPED]
    assert result.episodes[-1].ended_by == "stopped: time share spent"


def test_the_plan_reads_its_kinds_not_its_reasons():
    """An undeployable task whose own reason says "not covered" is neither counted as uncovered nor hidden in the
    negligible tail: the plan reads PlanWhy, not the words."""
    from llm4llm import planner
    from llm4llm.outcomes import PlanAction, PlanWhy

    odd = planner.TaskView("odd", "mlp", "decode", ["m.0"], 1e-6, deployable=False, reason="not covered by x")
    bare = planner.TaskView("bare", "norm", "decode", ["n.0"], 0.5)
    items = planner.rank_tasks([odd, bare], delta=0.02, covers={"bare": False})
    by = {i.task_id: i for i in items}
    assert (by["odd"].action, by["odd"].why) == (PlanAction.SKIP, PlanWhy.NOT_DEPLOYABLE)
    assert by["bare"].why == PlanWhy.NOT_COVERED and not by["odd"].negligible
    assert "(bare)" in planner._why_nothing(items) and "odd" not in planner._why_nothing(items)
    assert by["odd"].row("r", 0)["action"] == "skip" and "why" not in by["odd"].row("r", 0)


def test_the_decode_timing_is_one_enum_that_reads_and_writes_its_strings(monkeypatch):
    """DecodeTiming is the config field's type and what VerifierPool holds; plain strings go in (the CLI, the run
    form, a JSON config), the same strings come out (the config's JSON, the options the worker is sent)."""
    from pydantic import ValidationError

    from llm4llm.outcomes import DecodeTiming
    from llm4llm.verify.worker import DECODE_TIMINGS, VerifierPool

    assert [t.value for t in DecodeTiming] == ["launch", "graph", "graph_prefill"] == list(DECODE_TIMINGS)
    s = SearchSettings(decode_timing="graph_prefill")
    assert s.decode_timing is DecodeTiming.GRAPH_PREFILL and SearchSettings().decode_timing == "launch"
    assert json.loads(s.model_dump_json())["decode_timing"] == "graph_prefill"
    with pytest.raises(ValidationError):
        SearchSettings(decode_timing="sometimes")
    monkeypatch.setattr(VerifierPool, "_spawn", lambda self: None)
    for given in ("graph", DecodeTiming.GRAPH):
        pool = VerifierPool("cpu", decode_timing=given)
        assert pool.options["decode_timing"] is DecodeTiming.GRAPH
        assert json.loads(json.dumps(pool.options))["decode_timing"] == "graph"
