"""The search loop over one task, in the paper's three modes, at one trial budget.

The mode, the budget and the seed come from the run's SearchSettings (llm4llm.config).

- "sample" (sample-N): one step of `budget` independent candidates, no feedback.
- "iter" (iter-N): one trajectory of `budget` single candidates, each proposed with all feedback so far
  (iterate on the best, repair failures).
- "episodic": episodes of up to `episode_len` trials, each a loop of generate (`samples_per_step` candidates) ->
  verify -> decide; an episode ends at its length, or early when its last trials repeat one failure signature. At
  the end its trials are distilled into an Experience, its transcript is archived as JSON, and the next episode
  restarts from the task spec plus the experiences only.

Every mode spends exactly `budget` trials unless the proposer runs out of new candidates.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Protocol

from pydantic import BaseModel, Field

from llm4llm.outcomes import FINAL_ENDS, EpisodeEnd
from llm4llm.search.experience import distil, signature_of
from llm4llm.search.proposer import Proposer
from llm4llm.search.types import Candidate, Experience, Feedback
from llm4llm.taskspec import TaskSpec, load_spec
from llm4llm.verdict import Verdict, source_hash


class SearchSettings(Protocol):
    """What the search reads of llm4llm.config.SearchSettings (not imported: llm4llm.config imports the LLM
    settings, whose package imports this one)."""

    mode: str
    seed: int

    def trials(self) -> int: ...


Mode = Literal["episodic", "sample", "iter"]  # llm4llm.config.SearchMode
Verify = Callable[[Path, str], Any]  # (task_dir, source) -> a Verdict, or a dict of its fields (as_verdict)
OnTrial = Callable[[Candidate, Any, int, int], None]  # (candidate, verdict, episode, iteration)
# (the trials so far) -> why the search ends before its next trial, or None: the planner's time share and floor
Stop = Callable[[list["Trial"]], "str | None"]
STUCK_REPEATS = 2  # an episode whose last this-many trials fail with one signature ends early (restart)
EMPTY_RETRIES = 2  # proposer calls that return nothing new before the search stops short of its budget


class Trial(BaseModel):
    candidate: Candidate
    feedback: Feedback
    verdict: Verdict  # typed; a transcript holds it as model_dump(mode="json")
    episode: int
    iteration: int  # 0-based index within the whole search


@dataclass(frozen=True)
class Ending:
    """Why an episode ended: the kind, which decides what follows, and its detail for people (the repeated failure
    signature, the stop rule's reason)."""

    kind: EpisodeEnd
    detail: str = ""

    def __str__(self) -> str:  # "length" | "exhausted" | "stuck: <signature>" | "stopped: <reason>"
        return f"{self.kind}: {self.detail}" if self.detail else str(self.kind)


class EpisodeRecord(BaseModel):
    index: int
    trials: list[str]  # candidate ids
    experience: Experience
    transcript: str  # path of the archived JSON transcript
    ended: EpisodeEnd
    ended_by: str  # str(Ending): the kind with its detail, for people


class SearchResult(BaseModel):
    task_id: str
    mode: str
    budget: int
    proposer: str
    best: Trial | None = None
    trials: list[Trial] = Field(default_factory=list)
    episodes: list[EpisodeRecord] = Field(default_factory=list)

    @property
    def trials_used(self) -> int:
        return len(self.trials)

    @property
    def pass_rate(self) -> float:
        return sum(t.feedback.passed for t in self.trials) / len(self.trials) if self.trials else 0.0

    @property
    def best_candidate(self) -> Candidate | None:
        return self.best.candidate if self.best else None


def run_search(task_dir: Path, proposer: Proposer, verify: Verify, settings: SearchSettings, *,
               samples_per_step: int = 3, episode_len: int = 5, on_trial: OnTrial | None = None,
               archive_dir: Path | None = None, prior: list[Experience] | None = None,
               stop: Stop | None = None) -> SearchResult:
    """Search one task in `settings.mode` for `settings.trials()` trials (the caller's settings: this package does
    not import llm4llm.config, whose LLM settings' package imports this one). `archive_dir` (default
    `<task_dir>/search`) receives one JSON transcript per episode (sample and iter runs archive their single
    trajectory as episode 0). `settings.seed` names the run in the archive; the
    proposer carries its own seed. `prior` is experience from earlier searches of this task (or acceptance
    rejections recorded against it): every mode starts from it, as an episodic restart would. `stop` is asked
    before every trial but the first (llm4llm.planner: the task's share of the time budget is spent, or its best
    is near the physical floor); its reason ends the search early ("stopped: <reason>")."""
    mode, budget, seed = settings.mode, settings.trials(), settings.seed
    if mode not in ("episodic", "sample", "iter"):
        raise ValueError(f"run_search: expected mode in ('episodic', 'sample', 'iter'), got {mode!r}")
    if budget < 1 or samples_per_step < 1 or episode_len < 1:
        raise ValueError(f"run_search: expected budget, samples_per_step, episode_len >= 1, got "
                         f"{budget}, {samples_per_step}, {episode_len}")
    task_dir = Path(task_dir)
    spec = load_spec(task_dir)
    archive = Path(archive_dir) if archive_dir else task_dir / "search"
    archive.mkdir(parents=True, exist_ok=True)
    if hasattr(proposer, "reset"):
        proposer.reset()
    run = _Run(spec, task_dir, proposer, verify, on_trial, archive, f"{mode}-s{seed}-{int(time.time() * 1000)}",
               stop)
    result = SearchResult(task_id=spec.task_id, mode=mode, budget=budget, proposer=proposer.name)
    prior = list(prior or [])
    if mode == "sample":
        ended = run.episode(0, prior, length=budget, step=budget, stop_when_stuck=False)
        result.episodes.append(run.close_episode(0, prior, ended))
    elif mode == "iter":
        ended = run.episode(0, prior, length=budget, step=1, stop_when_stuck=False)
        result.episodes.append(run.close_episode(0, prior, ended))
    else:
        experiences: list[Experience] = list(prior)
        k = 0
        while len(run.trials) < budget:
            length = min(episode_len, budget - len(run.trials))
            ended = run.episode(k, experiences, length=length, step=samples_per_step, stop_when_stuck=True)
            record = run.close_episode(k, experiences, ended)
            result.episodes.append(record)
            experiences.append(record.experience)
            if ended.kind in FINAL_ENDS:
                break
            k += 1
    result.trials = run.trials
    passed = [t for t in run.trials if t.feedback.passed]
    result.best = max(passed, key=lambda t: t.feedback.utility) if passed else None
    return result


def as_verdict(verdict: Verdict | dict[str, Any], candidate: Candidate, task_id: str) -> Verdict:
    """What `verify` returned as a Verdict: the verifier's own, or a dict of its fields (a stand-in verifier's)
    parsed here, its source hash and task id filled in when it leaves them out."""
    if isinstance(verdict, Verdict):
        return verdict
    return Verdict.model_validate({"source_hash": source_hash(candidate.source), "task_id": task_id, **verdict})


def _p50(verdict: Verdict, key: str) -> float | None:
    lat = getattr(verdict, key)
    return float(lat.p50) if lat is not None and lat.p50 else None


def pool_reference(trials: list[Trial]) -> float | None:
    """Re-score every passing trial against the median of the reference times measured so far in this search.

    Each in-context timing measures the task's reference again next to its candidate (same task, same inputs, same
    method), so those are samples of one quantity. A host-bound reference can spread far more than its candidates,
    and a per-trial ratio would then rank by the reference's luck (a slow default out-scoring a faster candidate).
    The median over the search is stable, so feedback speedup and utility become pooled reference / candidate time.
    Trials without in-context timings (CPU) keep what their verdict says. Returns the pooled reference (ms) or None."""
    refs = [r for t in trials if (r := _p50(t.verdict, "reference_in_context"))]
    if not refs:
        return None
    refs.sort()
    mid = len(refs) // 2
    pooled = refs[mid] if len(refs) % 2 else 0.5 * (refs[mid - 1] + refs[mid])
    for t in trials:
        cand = _p50(t.verdict, "candidate_in_context")
        if t.feedback.passed and cand:
            t.feedback.speedup = t.feedback.utility = pooled / cand
    return pooled


class _Run:
    def __init__(self, spec: TaskSpec, task_dir: Path, proposer: Proposer, verify: Verify,
                 on_trial: OnTrial | None, archive: Path, name: str, stop: Stop | None = None):
        self.spec, self.task_dir, self.proposer, self.verify = spec, task_dir, proposer, verify
        self.on_trial, self.archive, self.name, self.stop = on_trial, archive, name, stop
        self.trials: list[Trial] = []
        self.tried: set[str] = set()
        self.episode_trials: list[Trial] = []

    def episode(self, k: int, experiences: list[Experience], *, length: int, step: int,
                stop_when_stuck: bool) -> Ending:
        """Generate -> verify -> decide until `length` trials; returns why the episode ended."""
        self.episode_trials = []
        empty = 0
        while len(self.episode_trials) < length:
            why = self.stop(self.trials) if self.stop is not None and self.trials else None
            if why:
                return Ending(EpisodeEnd.STOPPED, why)
            want = min(step, length - len(self.episode_trials))
            feedback = [t.feedback for t in self.episode_trials]
            fresh = [c for c in self.proposer.propose(self.spec, list(experiences), feedback, want)
                     if c.id not in self.tried][:want]
            if not fresh:
                empty += 1
                if empty >= EMPTY_RETRIES:
                    return Ending(EpisodeEnd.EXHAUSTED)
                continue
            for i, c in enumerate(fresh):
                why = self.stop(self.trials) if self.stop is not None and self.trials and i else None
                if why:
                    return Ending(EpisodeEnd.STOPPED, why)
                self._trial(c, k)
            stuck = self._stuck()
            if stop_when_stuck and stuck and len(self.episode_trials) < length:
                return Ending(EpisodeEnd.STUCK, stuck)
        return Ending(EpisodeEnd.LENGTH)

    def _trial(self, candidate: Candidate, k: int) -> None:
        iteration = len(self.trials)
        candidate = candidate.model_copy(update={"episode": k, "iteration": iteration})
        verdict = as_verdict(self.verify(self.task_dir, candidate.source), candidate, self.spec.task_id)
        self.tried.add(candidate.id)
        trial = Trial(candidate=candidate, feedback=Feedback.from_verdict(candidate, verdict),
                      verdict=verdict, episode=k, iteration=iteration)
        self.trials.append(trial)
        self.episode_trials.append(trial)
        pool_reference(self.trials)
        if self.on_trial:
            self.on_trial(candidate, verdict, k, iteration)

    def _stuck(self) -> str | None:
        tail = self.episode_trials[-STUCK_REPEATS:]
        if len(tail) < STUCK_REPEATS or any(t.feedback.passed for t in tail):
            return None
        sigs = {(t.feedback.failure_class, signature_of(t.feedback.message)) for t in tail}
        return f"{tail[-1].feedback.failure_class}: {signature_of(tail[-1].feedback.message)}" if len(sigs) == 1 \
            else None

    def close_episode(self, k: int, prior: list[Experience], ended: Ending) -> EpisodeRecord:
        notes = [f"ended by {ended}"] if ended.kind != EpisodeEnd.LENGTH else []
        exp = distil(self.spec, [t.feedback for t in self.episode_trials], episode=k, prior=prior, notes=notes)
        path = self.archive / f"{self.name}-e{k}.json"
        transcript = {"task_id": self.spec.task_id, "episode": k, "ended_by": str(ended),
                      "proposer": self.proposer.name, "experience_in": [e.model_dump(mode="json") for e in prior],
                      "trials": [t.model_dump(mode="json") for t in self.episode_trials],
                      "experience_out": exp.model_dump(mode="json")}
        path.write_text(json.dumps(transcript, indent=1, default=str))
        return EpisodeRecord(index=k, trials=[t.candidate.id for t in self.episode_trials], experience=exp,
                             transcript=str(path), ended=ended.kind, ended_by=str(ended))
