"""Distilling an episode into Experience: failure signatures and the rules they support, phase predicates,
numerical constraints, and the best region. The same rule derivation serves the built-in proposer within an episode,
so what it prunes mid-episode and what the next episode inherits agree."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from llm4llm.outcomes import FailureClass
from llm4llm.search.types import (BestRegion, Experience, FailingConfig, FailureRule, Feedback, ValidConfig,
                                  config_key)
from llm4llm.taskspec import TaskSpec

KEEP_VALID = 6
KEEP_FAILING = 6
SIGNATURE_CHARS = 80
# Failures that grow with tile sizes / stages: a value above every passing one generalises upward.
RESOURCE_HINTS = ("out of resources", "shared memory", "registers", "too large", "exceeds", "oom")
NUMERIC_CLASSES = frozenset({FailureClass.WRONG_OUTPUT, FailureClass.NAN_INF})
# failures of the kind that larger tiles or more stages cause
RESOURCE_CLASSES = frozenset({FailureClass.COMPILE, FailureClass.OOM})


@dataclass(frozen=True)
class Point:
    """One piece of evidence: a (template, config) and how it fared."""

    template: str
    config: dict[str, Any]
    passed: bool
    utility: float = 0.0
    speedup: float | None = None
    failure_class: str = ""
    signature: str = ""
    max_abs_err: float | None = None
    candidate_id: str | None = None


def signature_of(message: str) -> str:
    """A failure message normalised so repeats compare equal: numbers and paths masked, case folded, head only."""
    text = (message or "").strip().splitlines()[0] if message and message.strip() else ""
    text = re.sub(r"(/[\w.\-]+)+", "<path>", text.lower())
    text = re.sub(r"0x[0-9a-f]+|\d+(\.\d+)?(e-?\d+)?", "#", text)
    return re.sub(r"\s+", " ", text)[:SIGNATURE_CHARS]


def points_from_feedback(feedback: Iterable[Feedback]) -> list[Point]:
    return [Point(f.template, f.config, f.passed, f.utility, f.speedup, f.failure_class or "",
                  signature_of(f.message), f.max_abs_err, f.candidate_id) for f in feedback]


def points_from_experience(experience: Iterable[Experience]) -> list[Point]:
    pts: list[Point] = []
    for e in experience:
        pts += [Point(v.template, v.config, True, v.utility, v.speedup) for v in e.valid]
        pts += [Point(f.template, f.config, False, failure_class=f.failure_class, signature=f.signature)
                for f in e.failing]
    return pts


def derive_rules(points: list[Point]) -> list[FailureRule]:
    """Generalise failures to `key = value` rules that hold on the evidence.

    A value is blamed when (a) a passing config differs from a failing one only in that key, or (b) at least two
    failures with one signature share the value, differ elsewhere, and no passing config uses it. A value above
    every passing one that failed for resources also rules out larger values. Rules are recomputed from the whole
    evidence each time, so a later pass with the value retracts them."""
    rules: dict[tuple, FailureRule] = {}
    passing = [p for p in points if p.passed]
    # a worker stopped from outside says nothing about the config
    failing = [p for p in points if not p.passed and p.failure_class != FailureClass.INTERRUPTED]
    for f in failing:
        for key, value in f.config.items():
            same_t = [p for p in passing if p.template == f.template and key in p.config]
            if any(p.config[key] == value for p in same_t):
                continue
            neighbour = any(_differs_only_in(p.config, f.config, key) for p in same_t)
            alike = [g for g in failing if g.template == f.template and g.signature == f.signature
                     and g.config.get(key) == value]
            varied = len({config_key(g.template, g.config) for g in alike}) >= 2
            if not (neighbour or (len(alike) >= 2 and varied and _only_shared_key(alike, key))):
                continue
            rk = (f.template, key, f.failure_class, f.signature)
            rule = rules.setdefault(rk, FailureRule(template=f.template, key=key, values=[], evidence=0,
                                                    failure_class=f.failure_class, signature=f.signature))
            if value not in rule.values:
                rule.values.append(value)
            rule.evidence += 1
            upper = [p.config[key] for p in same_t if _num(p.config[key])]
            if _num(value) and _resource(f) and (not upper or value > max(upper)):
                rule.min_value = value if rule.min_value is None else min(rule.min_value, value)
    return list(rules.values())


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _resource(p: Point) -> bool:
    return p.failure_class in RESOURCE_CLASSES or any(h in p.signature for h in RESOURCE_HINTS)


def _differs_only_in(a: dict, b: dict, key: str) -> bool:
    return set(a) == set(b) and all(a[k] == b[k] for k in a if k != key) and a[key] != b[key]


def _only_shared_key(alike: list[Point], key: str) -> bool:
    """Among failures sharing `key`'s value, no other key is constant too (else the blame is ambiguous)."""
    others = set(alike[0].config) - {key}
    return not any(len({repr(g.config.get(k)) for g in alike}) == 1 for k in others)


def phase_predicates(spec: TaskSpec) -> list[str]:
    """What the task's phase rules in or out, from the spec alone."""
    if spec.phase == "decode":
        preds = ["decode: one new position per sequence (q_len == 1); prefill kernels tiled over queries do "
                 "not apply: use split-KV decode / single-step state updates"]
    else:
        preds = ["prefill: many new positions (q_len > 1); decode-only kernels (state update, split-KV) do not "
                 "apply"]
    if spec.state_names:
        preds.append(f"state in/out: {spec.state_names} must be returned as state_out.<name>")
    return preds


def numerical_constraints(spec: TaskSpec, points: list[Point], rules: list[FailureRule]) -> list[str]:
    out = [f"{spec.dtype}: accumulate in fp32; tolerance from TOLERANCES[{spec.dtype}]"]
    for r in rules:
        if r.failure_class in NUMERIC_CLASSES:
            errs = [p.max_abs_err for p in points if not p.passed and p.template == r.template
                    and p.config.get(r.key) in r.values and p.max_abs_err is not None]
            err = f" (max abs err {max(errs):.1e})" if errs else ""
            out.append(f"{r.template}: {r.key} in {r.values} fails numerically{err}")
    return out


def best_region(points: list[Point]) -> BestRegion | None:
    passing = [p for p in points if p.passed]
    if not passing:
        return None
    best = max(passing, key=lambda p: p.utility)
    hood: dict[str, list[Any]] = {}
    for key, value in best.config.items():
        seen = sorted({repr(p.config[key]): p.config[key] for p in points
                       if p.template == best.template and key in p.config}.values(), key=_order)
        i = seen.index(value)
        hood[key] = seen[max(0, i - 1): i + 2]
    return BestRegion(template=best.template, config=best.config, utility=best.utility, speedup=best.speedup,
                      neighbourhood=hood)


def _order(v: Any):
    return (0, float(v), "") if _num(v) else (1, 0.0, repr(v))


def distil(spec: TaskSpec, feedback: list[Feedback], episode: int = 0, prior: list[Experience] | None = None,
           notes: list[str] | None = None) -> Experience:
    """The Experience of one episode: its own trials judged together with what earlier episodes kept, so rules
    and the best region accumulate across restarts while the transcript itself is left behind."""
    own = points_from_feedback(feedback)
    evidence = points_from_experience(prior or []) + own
    rules = derive_rules(evidence)
    valid = sorted((p for p in own if p.passed), key=lambda p: -p.utility)[:KEEP_VALID]
    failing = [p for p in own if not p.passed][-KEEP_FAILING:]
    return Experience(
        task_id=spec.task_id, family=spec.family, phase=spec.phase, episode=episode,
        trials=len(own), passed=sum(p.passed for p in own),
        valid=[ValidConfig(template=p.template, config=p.config, speedup=p.speedup, utility=p.utility) for p in valid],
        failing=[FailingConfig(template=p.template, config=p.config, failure_class=p.failure_class or "unknown",
                               signature=p.signature) for p in failing],
        rules=rules, phase_predicates=phase_predicates(spec) + _phase_failures(own),
        numerical=numerical_constraints(spec, evidence, rules), best=best_region(evidence), notes=notes or [])


def _phase_failures(points: list[Point]) -> list[str]:
    hits = {p.signature for p in points if not p.passed and re.search(r"decode|prefill|q_len|s_q|applicable",
                                                                        p.signature)}
    return [f"observed: {s}" for s in sorted(hits)]
