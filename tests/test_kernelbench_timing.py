"""KernelBench timing (llm4llm.kernelbench.protocol): the candidate is timed interleaved with eager and
torch.compile, round by round with the order rotated, and a speedup is the median of the rounds' ratios, so a
drift of eager's speed during the call moves both sides of a ratio instead of one."""
from __future__ import annotations

import statistics

from llm4llm.kernelbench import protocol as P


def test_rounds_rotate_the_order_and_split_the_trials(monkeypatch):
    calls = []

    def fake(fn, args, dev, trials, warmup=P.WARMUP):
        calls.append((fn, trials))
        return [1.0] * trials

    monkeypatch.setattr(P, "time_cuda_events", fake)
    times, means = P.interleaved_times({"candidate": "c", "eager": "e", "compile": "k"}, [], "cuda", 90, rounds=3)
    assert [f for f, _ in calls] == ["c", "e", "k", "e", "k", "c", "k", "c", "e"]
    assert all(n == 30 for _, n in calls) and all(len(v) == 90 for v in times.values())
    assert len(means) == 3 and means[0] == {"candidate": 1.0, "eager": 1.0, "compile": 1.0}
    calls.clear()
    P.interleaved_times({"candidate": "c", "eager": "e"}, [], "cuda", 12, rounds=3)
    assert all(n == 10 for _, n in calls)  # never fewer than 10 trials a round


def test_a_drifting_eager_keeps_its_ratio_per_round(monkeypatch):
    """Eager slows from 2 to 3 ms during the call while the candidate takes 1 ms then 1.5 ms in step with it:
    every round's ratio is 2.0, where one eager measurement taken first (2 ms) against the candidate's mean
    (1.25 ms) would read 1.6."""
    speed = {"candidate": iter([1.0, 1.0, 1.5]), "eager": iter([2.0, 2.0, 3.0])}

    def fake(fn, args, dev, trials, warmup=P.WARMUP):
        return [next(speed[fn])] * trials

    monkeypatch.setattr(P, "time_cuda_events", fake)
    _, means = P.interleaved_times({"candidate": "candidate", "eager": "eager"}, [], "cuda", 30, rounds=3)
    ratios = P.round_ratios(means, "eager")
    assert ratios == [2.0, 2.0, 2.0] and statistics.median(ratios) == 2.0


def test_a_problem_whose_output_ignores_its_inputs_is_flagged_degenerate():
    """_Trials tracks every trial's reference output against the first trial's: all equal (within 1e-6) flags
    the problem degenerate; one trial that differs clears the flag for good."""
    import torch

    t = P._Trials.__new__(P._Trials)
    t.constant, t._first = None, None
    for _ in range(3):
        t.note_reference(torch.zeros(4, 3))
    assert t.constant is True
    t.note_reference(torch.ones(4, 3))
    t.note_reference(torch.zeros(4, 3))
    assert t.constant is False


def test_the_summary_leaves_degenerate_problems_out_of_the_real_geo_mean_with_its_spread(tmp_path):
    """kb_summary: the geo-mean over all passing problems as before, the degenerate ones counted, and the
    geo-mean without them (`geo_eager_real`) with a bootstrap 5-95 % spread around it."""
    import math

    from storage import repo
    from storage.db import Database

    rows = [("a.py", 1, 2.0, 1.5, False), ("b.py", 2, 8.0, 4.0, False), ("c.py", 3, 1000.0, 500.0, True),
            ("d.py", 4, None, None, None)]
    with Database(tmp_path / "kb.duckdb") as db:
        for name, pid, se, sc, deg in rows:
            repo.record_kb_result(db, {"kb_run_id": "kb-x", "problem": name, "problem_id": pid, "task_id": name,
                                       "mode": "sample", "proposer": "library", "budget": 2, "trials": 2,
                                       "passed": se is not None, "speedup_eager": se, "speedup_compile": sc,
                                       "degenerate": deg})
        s = repo.kb_summary(db, "kb-x", resamples=500).iloc[0]
    assert s["problems"] == 4 and s["degenerate"] == 1
    assert math.isclose(s["geo_eager"], (2.0 * 8.0 * 1000.0) ** (1 / 3))
    assert math.isclose(s["geo_eager_real"], 4.0) and math.isclose(s["geo_compile_real"], 6.0 ** 0.5)
    assert 2.0 <= s["geo_eager_p05"] < 4.0 < s["geo_eager_p95"] <= 8.0
