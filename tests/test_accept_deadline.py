"""Acceptance inside the run's time budget (llm4llm.accept, deadline): past it, the interleaved rounds stop at
MIN_ROUNDS, later trials are not tried, and a regime's check at its largest batch is not run when it would end past
it (the bundle keeps the buckets it was measured at). The first trial always runs. Scripted sides: the gates'
bookkeeping, not timings."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

import kernels_runtime
from kernels_runtime.bundle import Guard, PatchBundle, PatchSpec
from llm4llm import accept as acc
from llm4llm.accept import Decision, GraphPlan, _Run
from llm4llm.config import AcceptSettings, OptimizeConfig
from llm4llm.outcomes import DecidedBy

PAST, FUTURE = -60.0, 3600.0


class Counting:
    """A script whose runs are counted per side (each side's model carries its tag)."""

    def __init__(self):
        self.order: list[str] = []

    def run(self, model, workload, inputs):
        self.order.append(model.tag)


def sides():
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    a.tag, b.tag = "T", "B"
    return a, b


@pytest.mark.parametrize("offset, rounds", [(None, 7), (FUTURE, 7), (PAST, acc.MIN_ROUNDS)])
def test_the_deadline_ends_the_interleaved_rounds_after_the_minimum(offset, rounds, capsys):
    script, (a, b) = Counting(), sides()
    wl = SimpleNamespace(device="cpu", decode_len=4, model_copy=lambda update: wl)
    deadline = None if offset is None else time.time() + offset
    trials, bases = acc.interleave(a, b, wl, None, script.run, 7, deadline)
    assert len(trials) == len(bases) == rounds
    assert len(script.order) == 4 + 2 * rounds  # two warm-ups of each side, then the rounds
    ended = "accept: the run's time budget ended the interleaved rounds after 3 of 7" in capsys.readouterr().out
    assert ended == (offset == PAST)


def _run(deadline: float | None) -> _Run:
    wl = SimpleNamespace(device="cpu", regime=None, batch_size=1, name="wl")
    return _Run(wl, None, None, {}, AcceptSettings(), None, [], None, "logits_rel_l2_floor", GraphPlan(), deadline)


def _scripted_accept(monkeypatch, deadline: float | None, base_bundle: str | None = None) -> tuple[list, list]:
    """accept() over three proposals whose trials are scripted (each a CPU rejection): (tasks tried, decisions)."""
    tried: list[str] = []
    r = _run(deadline)
    monkeypatch.setattr(acc, "_prepare", lambda *a: r)
    start = (PatchBundle(name="wl"), None, "", None)
    monkeypatch.setattr(acc, "_start_fresh", lambda *a: start)
    monkeypatch.setattr(acc, "_start_from", lambda *a: start)
    proposals = [SimpleNamespace(candidate_id=f"c{i}") for i in range(3)]
    monkeypatch.setattr(acc, "rank", lambda ps: [(p, SimpleNamespace(task_id=f"t{i}"), 0.3) for i, p in
                                                 enumerate(ps)])

    def trials(r, p, spec, impact, accepted, current, base_model, run_id):
        tried.append(spec.task_id)
        return [Decision(spec.task_id, p.candidate_id, "rejected", "latency gate skipped on the CPU", "m", None,
                         None, None, None, impact, decided_by=DecidedBy.LATENCY_SKIPPED)], None

    monkeypatch.setattr(acc, "_task_trials", trials)
    res = acc.accept("wl.toml", proposals, "unused", deadline=deadline, base_bundle=base_bundle)
    return tried, res.decisions


def test_past_the_deadline_only_the_first_trial_runs_and_the_rest_say_why(monkeypatch, capsys):
    tried, decisions = _scripted_accept(monkeypatch, time.time() + PAST)
    assert tried == ["t0"]
    late = decisions[1:]
    assert [d.task_id for d in late] == ["t1", "t2"]
    assert all(d.decided_by == DecidedBy.TIME_BUDGET and d.decision == "rejected" for d in late)
    assert all("not tried: the run's time budget ended" in d.reason for d in late)
    assert not any(d.retried() for d in late)  # not a verdict on the candidate: no search again, no experience
    assert capsys.readouterr().out.count("not tried: the run's time budget ended") == 2


@pytest.mark.parametrize("offset", [None, FUTURE])
def test_within_the_budget_every_trial_runs(monkeypatch, offset):
    tried, _ = _scripted_accept(monkeypatch, None if offset is None else time.time() + offset)
    assert tried == ["t0", "t1", "t2"]


def test_a_later_step_past_the_deadline_tries_nothing(monkeypatch):
    """A step on top of a bundle this run already accepted: that bundle is the run's deliverable."""
    tried, decisions = _scripted_accept(monkeypatch, time.time() + PAST, base_bundle="earlier")
    assert tried == [] and [d.decided_by for d in decisions] == [DecidedBy.TIME_BUDGET] * 3


def _serving_bundle() -> PatchBundle:
    bundle = PatchBundle(name="serving", batch_buckets=[1, 2, 4, 8, 16, 32])
    bundle.add_patch(PatchSpec(patch_id="layer", module_class="m.Layer", phase="decode", instances=["l.0"],
                               kernel="", guard=Guard(batch_buckets=[1, 2, 4, 8, 16, 32])))
    return bundle


def _regime_run(monkeypatch, deadline: float | None, interleaved, bundle_deadline: float | None = None):
    for name in ("apply", "revert", "disable_decode_graphs"):
        monkeypatch.setattr(kernels_runtime, name, lambda *a, **k: None)
    monkeypatch.setattr(acc, "interleave", interleaved)
    monkeypatch.setattr("llm4llm.workload.call_script", lambda fn, w: {})
    wl = SimpleNamespace(device="cuda", regime=object(), batch_size=8, name="wl",
                         model_copy=lambda update: SimpleNamespace(**update))
    script = SimpleNamespace(inputs=lambda w: {}, run=None)
    return _Run(wl, script, object(), {}, AcceptSettings(interleave_rounds=7), None, [], None, "m", GraphPlan(),
                deadline, bundle_deadline)


def test_a_regime_check_past_the_rounds_deadline_runs_when_it_ends_inside_the_bundle_deadline(monkeypatch):
    """The check decides what batches the bundle serves: it may end after the deadline of acceptance's rounds (the
    README command on qwen3-4b-serving ended its trial's rounds at 5:31 of 8:00, 1 s past that deadline, and skipped
    a 19-s check), as long as it ends by the bundle's deadline."""
    ran = []

    def interleaved(trial, base, wl, batch, run_fn, rounds, deadline=None):
        ran.append(wl.batch_size)
        return [100.0] * 3, [101.0] * 3

    r = _regime_run(monkeypatch, time.time() - 1.0, interleaved, bundle_deadline=time.time() + 30.0)
    decision, bundle = acc._regime_gate(r, _serving_bundle(), object(), current=500.0)  # about 20 s
    assert ran == [32] and decision.decision == "accepted" and bundle.batch_buckets[-1] == 32
    r = _regime_run(monkeypatch, time.time() - 1.0, interleaved, bundle_deadline=time.time() + 10.0)
    decision, bundle = acc._regime_gate(r, _serving_bundle(), object(), current=500.0)
    assert ran == [32] and decision.decided_by == DecidedBy.TIME_BUDGET and bundle.batch_buckets[-1] == 8


def test_a_regime_check_that_would_end_past_the_deadline_is_not_run_and_the_bundle_keeps_its_measured_buckets(
        monkeypatch):
    def never(*a, **k):
        raise AssertionError("the check ran past the deadline")

    # 10 runs of 500 ms scaled by 32 / 8: about 20 s, and 10 s are left
    r = _regime_run(monkeypatch, time.time() + 10.0, never)
    assert acc.regime_check_s(500.0, 32, 8) == pytest.approx(20.0)
    decision, narrowed = acc._regime_gate(r, _serving_bundle(), object(), current=500.0)
    assert decision.task_id == acc.REGIME_TASK and decision.decided_by == DecidedBy.TIME_BUDGET
    assert decision.decision == "rejected" and "not checked" in decision.reason and "batch 32" in decision.reason
    assert narrowed.batch_buckets == [1, 2, 4, 8] and narrowed.patches[0].guard.batch_buckets == [1, 2, 4, 8]


def test_a_regime_check_that_fits_runs_with_the_deadline_for_its_rounds(monkeypatch):
    seen = {}

    def interleaved(trial, base, wl, batch, run_fn, rounds, deadline=None):
        seen.update(rounds=rounds, deadline=deadline, batch=wl.batch_size)
        return [100.0] * 3, [101.0] * 3

    deadline = time.time() + 60.0
    r = _regime_run(monkeypatch, deadline, interleaved)
    decision, bundle = acc._regime_gate(r, _serving_bundle(), object(), current=500.0)
    assert seen == {"rounds": 7, "deadline": deadline, "batch": 32}
    assert decision.decision == "accepted" and bundle.batch_buckets[-1] == 32


def test_the_flow_gives_acceptance_the_budget_less_evaluation_and_the_safety_share():
    from flows.optimize import _Run as FlowRun
    from llm4llm import planner

    cfg = OptimizeConfig(time_budget_s=480.0)
    started = time.time() - 100.0
    run = FlowRun("wl.toml", cfg, None, "data", started)
    plan = SimpleNamespace(estimates=SimpleNamespace(evaluate_s=135.0, accept_s=70.0, evaluate_rounds_s=30.0))
    # evaluation's rounds are acceptance's to spend: 135 s less its 30 s of rounds is kept back
    assert run.accept_deadline(plan) == pytest.approx(started + 480.0 - 105.0 - 480.0 * planner.SAFETY, abs=0.05)
    no_eval = FlowRun("wl.toml", cfg.model_copy(update={"stages": ("profile", "extract", "search", "accept")}),
                      None, "data", started)
    assert no_eval.accept_deadline(plan) == pytest.approx(started + 480.0 * (1 - planner.SAFETY), abs=0.05)
    # the regime's check, which decides the bundle's reach, may spend the whole budget: nothing is kept back
    assert run.bundle_deadline(plan) == pytest.approx(started + 480.0, abs=0.05)
    off = FlowRun("wl.toml", cfg.model_copy(update={"time_budget_s": None}), None, "data", started)
    assert off.accept_deadline(plan) is None
