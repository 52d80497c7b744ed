"""The search's records: a Candidate (what was proposed), its Feedback (what verification said, in brief), and an
Experience (what one episode taught, compact enough to restart from)."""
from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, Field, model_validator

MESSAGE_CHARS = 300  # feedback carries the head of a verifier message; the transcript keeps the whole verdict
PROMPT_CHARS = 1500


def config_key(template: str, config: dict[str, Any]) -> str:
    """Canonical identity of a (template, config) point: the unit of dedup and pruning."""
    return template + ":" + json.dumps(config, sort_keys=True, default=str)


def source_id(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


class Candidate(BaseModel):
    id: str = ""  # sha256 of the source (first 16 hex digits), filled in from the source
    source: str
    config: dict[str, Any] = Field(default_factory=dict)
    template: str = ""
    proposer: str = ""
    parent: str | None = None  # id of the candidate this one was derived from
    episode: int = 0
    iteration: int = 0

    @model_validator(mode="after")
    def _fill_id(self) -> "Candidate":
        self.id = source_id(self.source)
        return self

    @property
    def key(self) -> str:
        return config_key(self.template, self.config)


def _field(verdict: Any, name: str, default: Any = None) -> Any:
    if isinstance(verdict, dict):
        return verdict.get(name, default)
    return getattr(verdict, name, default)


class Feedback(BaseModel):
    """What a proposer sees of one verified candidate."""

    candidate_id: str
    template: str
    config: dict[str, Any]
    passed: bool
    failure_class: str | None = None
    message: str = ""
    max_abs_err: float | None = None
    speedup: float | None = None
    utility: float = 0.0

    @classmethod
    def from_verdict(cls, candidate: Candidate, verdict: Any) -> "Feedback":
        speedup = _field(verdict, "speedup_in_context")
        if speedup is None:
            speedup = _field(verdict, "speedup_cold")
        return cls(candidate_id=candidate.id, template=candidate.template, config=candidate.config,
                   passed=bool(_field(verdict, "passed", False)), failure_class=_field(verdict, "failure_class"),
                   message=str(_field(verdict, "message", "") or "")[:MESSAGE_CHARS],
                   max_abs_err=_field(verdict, "max_abs_err"), speedup=speedup,
                   utility=float(_field(verdict, "utility", 0.0) or 0.0))

    @property
    def key(self) -> str:
        return config_key(self.template, self.config)


class ValidConfig(BaseModel):
    template: str
    config: dict[str, Any]
    speedup: float | None = None
    utility: float = 0.0


class FailingConfig(BaseModel):
    template: str
    config: dict[str, Any]
    failure_class: str
    signature: str  # the normalised head of the failure message


class FailureRule(BaseModel):
    """A generalisation over failures: every config of `template` with `key` in `values` fails this way."""

    template: str
    key: str
    values: list[Any]
    failure_class: str
    signature: str
    evidence: int = 1  # failing trials behind the rule
    min_value: float | None = None  # resource failures: every value >= this fails too

    def matches(self, template: str, config: dict[str, Any]) -> bool:
        if template != self.template or self.key not in config:
            return False
        v = config[self.key]
        if v in self.values:
            return True
        return (self.min_value is not None and isinstance(v, (int, float)) and not isinstance(v, bool)
                and v >= self.min_value)


class BestRegion(BaseModel):
    template: str
    config: dict[str, Any]
    utility: float
    speedup: float | None = None
    neighbourhood: dict[str, list[Any]] = Field(default_factory=dict)  # per key: the best value and its neighbours


class Experience(BaseModel):
    """The compact lesson of one episode: what a restarted episode keeps (the transcript is archived, not kept)."""

    task_id: str = ""
    family: str = ""
    phase: str = ""
    episode: int = 0
    trials: int = 0
    passed: int = 0
    valid: list[ValidConfig] = Field(default_factory=list)
    failing: list[FailingConfig] = Field(default_factory=list)
    rules: list[FailureRule] = Field(default_factory=list)
    phase_predicates: list[str] = Field(default_factory=list)
    numerical: list[str] = Field(default_factory=list)
    best: BestRegion | None = None
    notes: list[str] = Field(default_factory=list)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> "Experience":
        return cls.model_validate_json(text)

    def failure_for(self, template: str, config: dict[str, Any]) -> str | None:
        """The failure signature that rules out this point, or None when nothing known does."""
        key = config_key(template, config)
        for f in self.failing:
            if config_key(f.template, f.config) == key:
                return f"{f.failure_class}: {f.signature}"
        for r in self.rules:
            if r.matches(template, config):
                return f"{r.failure_class}: {r.signature} ({r.key} {_rule_range(r)})"
        return None

    def to_prompt_text(self, max_chars: int = PROMPT_CHARS) -> str:
        """Compact text for an LLM proposer: constraints first, then the best region, then evidence."""
        lines = [f"experience ep{self.episode} {self.family}/{self.phase}: {self.passed}/{self.trials} passed"]
        lines += [f"phase: {p}" for p in self.phase_predicates]
        lines += [f"numerics: {n}" for n in self.numerical]
        lines += [f"avoid {r.template} {r.key} {_rule_range(r)}: {r.failure_class} '{r.signature}'" for r in self.rules]
        if self.best:
            b = self.best
            lines.append(f"best: {b.template} {_compact(b.config)} utility {b.utility:.3g}")
            if b.neighbourhood:
                lines.append("explore near: " + _compact(b.neighbourhood))
        lines += [f"ok {v.template} {_compact(v.config)} x{v.utility:.3g}"
                  for v in sorted(self.valid, key=lambda v: -v.utility)[:4]]
        lines += [f"fail {f.template} {_compact(f.config)}: {f.failure_class} '{f.signature}'" for f in self.failing[:4]]
        lines += [f"note: {n}" for n in self.notes]
        text, out = "", []
        for line in lines:
            if len(text) + len(line) + 1 > max_chars:
                out.append("...")
                break
            out.append(line)
            text += line + "\n"
        return "\n".join(out)


def _compact(d: dict[str, Any]) -> str:
    return json.dumps(d, sort_keys=True, separators=(",", ":"), default=str)


def _rule_range(r: FailureRule) -> str:
    return f">= {r.min_value}" if r.min_value is not None else f"in {r.values}"
