"""The built-in proposer (no API key): samples the config spaces of the task family's templates.

Policy per pick: with probability 1 - `explore`, exploit (the nearest untried neighbour of the best config known
from feedback or experience); after a failure with nothing passing yet, repair (step the failed config on the keys
its failure implicates, toward the template's default); otherwise explore (template defaults first, then their
seeds, then random points, favouring values not tried yet). Points ruled out by experience or by the evidence of
this episode's feedback (exact failures and the rules derived from them) are never proposed, and neither is a point
this search already tried: the proposer remembers what it emitted per task until `reset()`.
"""
from __future__ import annotations

import random
from typing import Any, Sequence

from llm4llm.search.experience import (NUMERIC_CLASSES, Point, derive_rules, points_from_experience,
                                       points_from_feedback)
from llm4llm.search.templates.base import Template
from llm4llm.search.types import Candidate, Experience, Feedback, config_key
from llm4llm.taskspec import TaskSpec


class LibraryProposer:
    name = "library"

    def __init__(self, seed: int = 0, explore: float = 0.25, templates: Sequence[Template] | None = None):
        self.seed = seed
        self.explore = explore
        self._templates = list(templates) if templates is not None else None
        self._emitted: dict[str, set[str]] = {}

    def reset(self) -> None:
        """Forget what was emitted: the start of a new search."""
        self._emitted.clear()

    def templates_for(self, spec: TaskSpec) -> list[Template]:
        return [t for t in self._all_templates() if t.why_not(spec) is None]

    def skipped(self, spec: TaskSpec) -> dict[str, str]:
        """Why each template of the task's family is not used (ops missing, out of scope)."""
        return {t.name: t.why_not(spec) or "" for t in self._all_templates()
                if t.family == spec.family and t.why_not(spec)}

    def _all_templates(self) -> list[Template]:
        if self._templates is None:
            from llm4llm.search.templates import TEMPLATES

            return list(TEMPLATES)
        return self._templates

    def propose(self, task: TaskSpec, experience: list[Experience], feedback: list[Feedback], n: int) -> list[Candidate]:
        templates = {t.name: t for t in self.templates_for(task)}
        if not templates or n <= 0:
            return []
        emitted = self._emitted.setdefault(task.task_id, set())
        evidence = points_from_experience(experience) + points_from_feedback(feedback)
        tried = emitted | {config_key(p.template, templates[p.template].canonical(task, p.config)
                                      if p.template in templates else p.config) for p in evidence}
        rules = derive_rules(evidence)
        rng = random.Random(f"{self.seed}:{task.task_id}:{len(tried)}:{len(feedback)}:{len(experience)}")

        def allowed(t: str, c: dict) -> bool:
            return config_key(t, c) not in tried and not any(r.matches(t, c) for r in rules) and \
                not any(e.failure_for(t, c) for e in experience)

        pool = [(name, c) for name, t in templates.items() for c in t.configs(task) if allowed(name, c)]
        best = _best(evidence, experience, templates)
        last = feedback[-1] if feedback else None
        picks: list[tuple[str, dict, str | None]] = []
        while len(picks) < n and pool:
            first = self._first_pick(pool, templates, task, evidence, picks)
            if first is not None:  # every applicable template gets one known-safe try before any is exploited
                pick, parent = first, None
            elif best is not None and rng.random() >= self.explore:
                pick, parent = _nearest(pool, best.template, best.config, templates, task, rng), best
            elif best is None and last is not None and not last.passed and last.template in templates:
                pick, parent = _repair(pool, last, templates[last.template], task, rng), last
            else:
                pick, parent = self._explore_pick(pool, templates, task, evidence, picks, rng), None
            pool.remove(pick)
            picks.append((pick[0], pick[1], getattr(parent, "candidate_id", None)))
        out = []
        for name, config, parent in picks:
            emitted.add(config_key(name, config))
            source = templates[name].render(task, config)
            out.append(Candidate(source=source, config=config, template=name, proposer=self.name, parent=parent))
        return out

    # The two policy steps a family's proposer may replace (llm4llm/kernelbench/proposer.py): the point taken before
    # any exploitation, and the exploration pick.
    def _first_pick(self, pool, templates, task, evidence, picks) -> tuple[str, dict] | None:
        return _untried_template(pool, templates, task, evidence, picks)

    def _explore_pick(self, pool, templates, task, evidence, picks, rng) -> tuple[str, dict]:
        return _explore(pool, templates, task, evidence, picks, rng)


class _Best:
    def __init__(self, template: str, config: dict, utility: float, candidate_id: str | None = None):
        self.template, self.config, self.utility, self.candidate_id = template, config, utility, candidate_id


def _best(evidence: list[Point], experience: list[Experience], templates: dict[str, Template]) -> _Best | None:
    best: _Best | None = None
    for e in experience:
        if e.best and e.best.template in templates and (best is None or e.best.utility > best.utility):
            best = _Best(e.best.template, e.best.config, e.best.utility)
    for p in evidence:
        if p.passed and p.template in templates and (best is None or p.utility > best.utility):
            best = _Best(p.template, p.config, p.utility, p.candidate_id)
    return best


def _distance(t: Template, spec: TaskSpec, a: dict, b: dict) -> int:
    space = t.space(spec)
    d = 0
    for k, vals in space.items():
        if a.get(k) == b.get(k):
            continue
        if a.get(k) in vals and b.get(k) in vals and all(_num(v) for v in vals):
            d += abs(vals.index(a[k]) - vals.index(b[k]))
        else:
            d += 1
    return d


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _nearest(pool, template: str, config: dict, templates, spec, rng) -> tuple[str, dict]:
    same = [p for p in pool if p[0] == template]
    if not same:
        return rng.choice(pool)
    scored = [(_distance(templates[template], spec, c, config), rng.random(), (t, c)) for t, c in same]
    return min(scored, key=lambda s: s[:2])[2]


def _implicated(last: Feedback, t: Template, spec: TaskSpec) -> list[str]:
    """Keys a failure points at: named in its message, else by kind (resources: the largest tiles and stages;
    numerics: precision and fusion choices), else every key."""
    space, msg = t.space(spec), (last.message or "").lower()
    named = [k for k in space if k.lower() in msg]
    if named:
        return named
    if last.failure_class in NUMERIC_CLASSES:
        picked = [k for k, vals in space.items() if not all(_num(v) for v in vals)]
    else:
        picked = [k for k, vals in space.items() if all(_num(v) for v in vals) and
                  ("BLOCK" in k.upper() or "stages" in k)]
    return picked or list(space)


def _repair(pool, last: Feedback, t: Template, spec: TaskSpec, rng) -> tuple[str, dict]:
    """The untried point closest to the failed one that changes an implicated key toward the default."""
    keys, default = _implicated(last, t, spec), t.default(spec)
    same = [(name, c) for name, c in pool if name == t.name]
    moved = [(name, c) for name, c in same if any(c[k] != last.config.get(k) for k in keys)
             and all(c[k] == last.config.get(k) for k in c if k not in keys)]
    if last.failure_class not in NUMERIC_CLASSES:  # resources and the like: shrink, never grow
        smaller = [(name, c) for name, c in moved if all(not _num(c[k]) or c[k] <= last.config[k] for k in keys)]
        moved = smaller or moved
    cands = moved or same or pool
    return min(cands, key=lambda p: (_distance(t, spec, p[1], last.config) if p[0] == t.name else 99,
                                     _distance(t, spec, p[1], default) if p[0] == t.name else 99, rng.random()))


def first_start(templates: dict, spec) -> tuple[str, dict] | None:
    """The point a search over `templates` (name -> template) tries first where it has no experience: the first of
    `_starting_points` (None without templates)."""
    points = _starting_points(templates, spec)
    return (points[0][0], points[0][1]) if points else None


def _starting_points(templates, spec) -> list[tuple[str, dict, bool]]:
    """The known-safe starting points in the order they are tried: the default, then the seeds, of the templates
    written for the fewest phases (the task's own specialists), then every other template's default, then their
    seeds. Each with whether it starts a search only while its template has no trial (all but the specialists'
    seeds). `_untried_template` takes them before any exploitation, `_explore` before its diversity pick."""
    if not templates:
        return []
    rank = min(len(t.phases) for t in templates.values())
    special = [(n, t) for n, t in templates.items() if len(t.phases) == rank]  # library order
    others = [(n, t) for n, t in templates.items() if len(t.phases) > rank]
    return ([(n, t.default(spec), True) for n, t in special] + [(n, c, False) for n, t in special for c in t.seeds(spec)]
            + [(n, t.default(spec), True) for n, t in others] + [(n, c, True) for n, t in others for c in t.seeds(spec)])


def _untried_template(pool, templates, spec, evidence: list[Point], picks) -> tuple[str, dict] | None:
    """The first starting point still in the pool, before any exploitation; another template's points only while
    no trial has used that template, so that a small budget reaches every applicable template (e.g. the
    weight-streaming GEMV for a decode MLP) before it exploits the first one tried."""
    used = {p.template for p in evidence} | {t for t, _, _ in picks}
    for name, config, only_unused in _starting_points(templates, spec):
        if (name, config) in pool and not (only_unused and name in used):
            return name, config
    return None


def _explore(pool, templates, spec, evidence: list[Point], picks, rng) -> tuple[str, dict]:
    for name, config, _ in _starting_points(templates, spec):  # the known-safe starting points first
        if (name, config) in pool:
            return name, config
    used_t = [p.template for p in evidence] + [t for t, _, _ in picks]
    fresh_t = [name for name in templates if name not in used_t]
    cands = [p for p in pool if p[0] in fresh_t] or pool
    counts: dict[tuple, int] = {}
    for p in evidence:
        for kv in p.config.items():
            counts[(p.template, repr(kv))] = counts.get((p.template, repr(kv)), 0) + 1
    sample = rng.sample(cands, min(len(cands), 64))
    return min(sample, key=lambda p: (sum(counts.get((p[0], repr(kv)), 0) for kv in p[1].items()), rng.random()))
