"""The built-in proposer for KernelBench: exploration down a seeded sample over (fusion scope x tile configuration).

The generic LibraryProposer tries every applicable template's default, in library order, before it exploits
anything, so at a budget of a few trials sample-k, iter-k and episodic draw the same candidates and the ablation
cannot tell them apart. Here exploration walks a list drawn once per (seed, task):
- a fusion scope is a template (what runs on cuBLAS/cuDNN, what is rewritten, what is fused) with one value of its
  scope keys (`epilogue`: the pointwise tail fused into the kernel before it, or stored by its own kernel);
- each scope contributes its default tiles, then a seeded sample of the tile configurations one key away, then
  further ones, up to `tiles_per_scope` points;
- the list is breadth first (every scope's first point, then every scope's second, ...), scopes in a seeded order;
  scopes off their template's default fusion choice start one round later;
- the first point is the first applicable template's default whatever the seed, so a budget of one keeps the
  library's measured-best start.
Exploitation (the nearest untried neighbour of the best) and repair stay the library's: sample-k takes the list's
first k points, iter-k follows feedback after the first, and an episodic restart goes on down the list from its
experience (and its own draw of the exploitation coin).
"""
from __future__ import annotations

import random
from typing import Any, Sequence

from llm4llm.search.builtin import LibraryProposer
from llm4llm.search.templates.base import Template
from llm4llm.taskspec import TaskSpec

SCOPE_KEYS = ("epilogue",)  # config keys that choose what is fused; the template chooses the rest of the scope
TILES_PER_SCOPE = 4


def _frozen(name: str, c: dict[str, Any]) -> tuple:
    return name, tuple(sorted((k, repr(v)) for k, v in c.items()))


def sample_scopes_and_tiles(templates: Sequence[Template], spec: TaskSpec, seed: int,
                            tiles_per_scope: int = TILES_PER_SCOPE) -> list[tuple[str, dict[str, Any]]]:
    """The exploration list of one task under one seed: (template name, config) points, each once."""
    rng = random.Random(f"kb-scopes:{seed}:{spec.task_id}")
    scopes = []  # (template name, whether the template's default scope, anchor config, the scope's configs)
    for t in templates:
        default = t.default(spec)
        groups: dict[tuple, list[dict]] = {}
        for c in t.configs(spec):
            groups.setdefault(tuple(c.get(k) for k in SCOPE_KEYS), []).append(c)
        home = tuple(default.get(k) for k in SCOPE_KEYS)
        for values, configs in groups.items():
            anchor = {**default, **{k: v for k, v in zip(SCOPE_KEYS, values) if k in default}}
            scopes.append((t.name, values == home, anchor, configs))
    order = list(range(len(scopes)))
    rng.shuffle(order)
    ranked = []
    for pos, i in enumerate(order):
        name, home, anchor, configs = scopes[i]
        near = sorted(configs, key=lambda c: (sum(c.get(k) != v for k, v in anchor.items()), rng.random()))
        for j, c in enumerate(near[:tiles_per_scope]):
            ranked.append((j + (0 if home else 1), pos, name, c))
    ranked.sort(key=lambda r: r[:2])
    out = [(templates[0].name, templates[0].default(spec))] if templates else []
    seen = {_frozen(*p) for p in out}
    for _, _, name, c in ranked:
        if _frozen(name, c) not in seen:
            seen.add(_frozen(name, c))
            out.append((name, c))
    return out


class KBProposer(LibraryProposer):
    """LibraryProposer whose exploration follows `sample_scopes_and_tiles` (module docstring)."""

    def __init__(self, seed: int = 0, explore: float = 0.25, templates: Sequence[Template] | None = None,
                 tiles_per_scope: int = TILES_PER_SCOPE):
        super().__init__(seed=seed, explore=explore, templates=templates)
        self.tiles_per_scope = tiles_per_scope
        self._lists: dict[str, list[tuple[str, dict]]] = {}

    def candidate_list(self, spec: TaskSpec) -> list[tuple[str, dict[str, Any]]]:
        if spec.task_id not in self._lists:
            self._lists[spec.task_id] = sample_scopes_and_tiles(self.templates_for(spec), spec, self.seed,
                                                                self.tiles_per_scope)
        return self._lists[spec.task_id]

    def _first_pick(self, pool, templates, task, evidence, picks) -> tuple[str, dict] | None:
        return None  # no template-by-template warm-up: the seeded list decides what is explored first

    def _explore_pick(self, pool, templates, task, evidence, picks, rng) -> tuple[str, dict]:
        live = {_frozen(name, c): (name, c) for name, c in pool}  # untried, not ruled out, not picked yet
        for name, c in self.candidate_list(task):
            if (hit := live.get(_frozen(name, c))) is not None:
                return hit
        return super()._explore_pick(pool, templates, task, evidence, picks, rng)
