"""Where a verification's wall time goes (Verdict.seconds): the parent's phases (references, the worker's load,
the judged calls, on a GPU the timing and the timed outputs) and the pool's whole job; stored with the candidate
(candidates.seconds_json) and named in a long trial's progress line."""
from __future__ import annotations

from llm4llm.search.types import Candidate
from llm4llm.stages.search import _seconds_note
from llm4llm.verify.worker import VerifierPool
from storage.rows import candidate_row
from tests.test_verify import build_rmsnorm_task, cheat_source


def test_a_verdict_says_where_its_time_went(tmp_path):
    task = build_rmsnorm_task(tmp_path / "tasks")
    pool = VerifierPool("cpu", timeout_s=120.0, draws=1, timing=False, kernel_cache=None)
    try:
        v = pool.verify(task, cheat_source("correct_rmsnorm"))
        bad = pool.verify(task, cheat_source("correct_rmsnorm").replace("def entry", "def not_entry"))
    finally:
        pool.close()
    assert v.passed, v.message
    assert {"references", "load", "checks", "total"} <= set(v.seconds)
    assert all(s >= 0 for s in v.seconds.values())
    assert v.seconds["total"] >= v.seconds["references"] + v.seconds["load"] + v.seconds["checks"] - 1e-3
    assert not bad.passed and "total" in bad.seconds  # a failed candidate's time is counted too
    row = candidate_row(Candidate(source="x"), v.model_dump(mode="json"), "t", "s", 0, 0, "p")
    assert row["seconds_json"] == v.seconds


def test_a_long_trial_names_its_slowest_phases():
    assert _seconds_note({"total": 12.0, "checks": 10.0}) == ""
    assert _seconds_note(None) == ""
    note = _seconds_note({"references": 20.4, "load": 0.5, "checks": 80.2, "timing": 39.6, "total": 142.3})
    assert note == " (142 s: checks 80, timing 40, references 20)"
