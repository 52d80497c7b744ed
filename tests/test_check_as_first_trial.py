"""The template check and the search's first trial are one verification: where a task has no experience, the check
verifies the template default the search will try first as a trial would be verified (fresh draws, timing), and
that search's first trial takes the verdict instead of verifying the same source again (a 7B serving regime's
decode layer spent 81 s on the check and 169 s on that trial)."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from llm4llm import isolation
from llm4llm.config import SearchSettings
from llm4llm.stages import search as stage
from llm4llm.taskspec import load_spec
from llm4llm.verdict import source_hash
from llm4llm.verify.verdict import Verdict


class CountingPool:
    """Every verification asked of the pool: (source hash, whether it was a bare check), each one passed."""

    def __init__(self):
        self.calls = []

    def verify(self, path, source, timeout_s=None, **kw):
        self.calls.append((source_hash(source), kw.get("draws") == 0 and kw.get("timing") is False))
        return Verdict(source_hash=source_hash(source), task_id="t", device_name="cpu", passed=True)


class Recorder:
    def __init__(self):
        self.trials = []

    def start(self, *a):
        pass

    def trial(self, candidate, verdict, *a):
        self.trials.append((candidate, verdict))
        return bool(verdict.passed)

    def end(self, *a):
        pass


@pytest.fixture
def norm_task(tiny_extracted):
    return next(d for d in tiny_extracted("tiny-llama") if load_spec(d).family == "norm")


@pytest.fixture
def pool(monkeypatch):
    p = CountingPool()
    monkeypatch.setattr(isolation, "verifier_pool", lambda *a: (p, threading.Lock()))
    yield p
    isolation.close_pools()


def _repo(experience):
    written = []
    return SimpleNamespace(template_check_records=lambda ids, cv: [], record_template_checks=written.extend,
                           experience_records=lambda task_id: experience)


def test_the_first_trial_takes_the_checks_verification(norm_task, pool, tmp_path):
    from llm4llm.search.templates import TEMPLATES

    settings = SearchSettings(mode="sample", budget=2, seed=0)
    repo = _repo([])
    first = stage.first_trial_source(load_spec(norm_task), TEMPLATES)
    assert first is not None
    checks = stage.check_applicability(str(norm_task), repo, "run-1", "cpu", settings)
    assert any(c.applicable for c in checks)
    assert [bare for h, bare in pool.calls if h == source_hash(first)] == [False]  # verified as a trial, once
    assert all(bare for h, bare in pool.calls if h != source_hash(first))  # every other template: a bare check
    n_checks = len(pool.calls)
    rec = Recorder()
    stage.run_task_search(str(norm_task), str(tmp_path / "data"), rec, settings, device="cpu", run_id="run-1",
                          check=lambda d: checks)
    assert rec.trials[0][0].source == first and stage.VERIFIED_IN_CHECK in rec.trials[0][1].message
    assert rec.trials[0][1].passed and len(rec.trials) == 2
    # the search verified its second trial only: the first source was not verified again
    assert len(pool.calls) == n_checks + 1 and pool.calls[-1][0] != source_hash(first)
    assert isolation.take_verdict(stage.trial_key("cpu", settings, norm_task, first)) is None  # taken once


def test_with_experience_the_check_stays_a_bare_check(norm_task, pool, tmp_path):
    """A task with experience may start elsewhere (its proposer skips what was tried): no full verification."""
    settings = SearchSettings(mode="sample", budget=1, seed=0)
    stage.check_applicability(str(norm_task), _repo([{"any": "row"}]), "run-1", "cpu", settings)
    assert pool.calls and all(bare for _, bare in pool.calls)
    from llm4llm.search.templates import TEMPLATES

    first = stage.first_trial_source(load_spec(norm_task), TEMPLATES)
    assert isolation.take_verdict(stage.trial_key("cpu", settings, norm_task, first)) is None


def test_a_failed_full_check_is_not_kept(norm_task, monkeypatch, tmp_path):
    """A default that fails its check is verified again by the trial (a failure may be the worker's, not the
    kernel's)."""
    from llm4llm.outcomes import FailureClass
    from llm4llm.search.templates import TEMPLATES

    class Failing(CountingPool):
        def verify(self, path, source, timeout_s=None, **kw):
            super().verify(path, source, timeout_s, **kw)
            return Verdict(source_hash="x", task_id="t", device_name="cpu").fail("static", FailureClass.STATIC, "-")

    p = Failing()
    monkeypatch.setattr(isolation, "verifier_pool", lambda *a: (p, threading.Lock()))
    settings = SearchSettings(mode="sample", budget=1, seed=0)
    stage.run_template_checks(str(norm_task), None, "cpu", settings, full_first=True)
    first = stage.first_trial_source(load_spec(norm_task), TEMPLATES)
    assert isolation.take_verdict(stage.trial_key("cpu", settings, norm_task, first)) is None
    isolation.close_pools()


def test_a_first_trial_taken_from_the_check_still_sets_the_searchs_pace():
    """The search's stop rule counts a taken verdict at what its verification cost: a 169-s first trial taken from
    the check in no time must not start a second one with 100 s left."""
    import time

    from llm4llm.planner import search_stop

    taken = SimpleNamespace(verdict=Verdict(source_hash="x", task_id="t", device_name="cpu", passed=False,
                                            seconds={"total": 169.0}), feedback=SimpleNamespace(passed=False))
    assert "time budget is spent" in (search_stop(time.time() + 100)([taken]) or "")
    quick = SimpleNamespace(verdict=taken.verdict.model_copy(update={"seconds": {"total": 1.0}}),
                            feedback=taken.feedback)
    assert search_stop(time.time() + 100)([quick]) is None


def test_a_search_elsewhere_keeps_the_bare_check(norm_task, pool):
    """Searches fanned out to Ray tasks cannot take a verdict kept in the flow's process: the check stays bare
    (searched_here=False, as flows/search.py and the plan pass it for `scale.task_runner = "ray"`)."""
    settings = SearchSettings(mode="sample", budget=1, seed=0)
    stage.check_applicability(str(norm_task), _repo([]), "run-1", "cpu", settings, searched_here=False)
    assert pool.calls and all(bare for _, bare in pool.calls)


def test_a_default_correct_on_every_call_but_failing_in_timing_still_passes_its_check(norm_task, monkeypatch):
    """The check asks whether the template computes the module: a full verification that passed every correctness
    gate and failed later (timing) keeps the template applicable at its default, and nothing is kept for the
    trial."""
    from llm4llm.outcomes import FailureClass
    from llm4llm.search.templates import TEMPLATES
    from llm4llm.verdict import GateResult

    class LateFail(CountingPool):
        def verify(self, path, source, timeout_s=None, **kw):
            v = super().verify(path, source, timeout_s, **kw)
            if kw.get("draws") == 0:
                return v
            v = Verdict(source_hash="x", task_id="t", device_name="cpu")
            v.gates.append(GateResult(name="does_the_work", passed=True, detail="-"))
            return v.fail("timing_in_context", FailureClass.IMPOSSIBLE_TIME, "below the floor")

    p = LateFail()
    monkeypatch.setattr(isolation, "verifier_pool", lambda *a: (p, threading.Lock()))
    settings = SearchSettings(mode="sample", budget=1, seed=0)
    spec = load_spec(norm_task)
    first = stage.first_trial_source(spec, TEMPLATES)
    checks = stage.run_template_checks(str(norm_task), None, "cpu", settings, full_first=True)
    name = next(t.name for t in TEMPLATES if t.render(spec, t.default(spec)) == first)
    check = next(c for c in checks if c.template == name)
    assert check.applicable
    assert "default config matches" in check.reason
    assert isolation.take_verdict(stage.trial_key("cpu", settings, norm_task, first)) is None
    isolation.close_pools()
