"""A kernel-family template: a declared config space and a renderer from (task spec, config) to candidate source.

Rendered sources implement the candidate contract `entry(inputs, weights, state, static) -> dict` by calling the
project's Triton ops (imported inside the source). They bake in the config, never weights, and read every static
value from `static` at call time, so one source serves every instance and shape of the task. They pass the
verifier's static gate: torch only allocates, views and copies; compute happens in Triton kernels.
"""
from __future__ import annotations

import dataclasses
import importlib
import itertools
import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from llm4llm.search.types import config_key
from llm4llm.taskspec import TaskSpec

Space = dict[str, list[Any]]

# Helper pasted into every rendered source: static values by any of the names the extraction may record.
STATIC_HELPER = '''
def _static(static, *names):
    for n in names:
        if n in static:
            return static[n]
    raise KeyError(f"static: expected one of {names}, got {sorted(static)}")
'''


@dataclass(frozen=True)
class Template:
    name: str
    family: str
    phases: tuple[str, ...]
    requires: tuple[tuple[str, str], ...]  # (module, attribute) every rendering imports
    space_fn: Callable[[TaskSpec], Space]  # ordered values per key (numeric keys ascending: neighbours are adjacent)
    render_fn: Callable[[TaskSpec, dict[str, Any]], str]
    applies_fn: Callable[[TaskSpec], str | None] = lambda spec: None  # None, or why the task is out of scope
    default_fn: Callable[[TaskSpec], dict[str, Any]] = lambda spec: {}  # preferred values (else each key's first)
    # further starting points tried right after the default (derived from the task's shapes and GPU)
    seeds_fn: Callable[[TaskSpec], list[dict[str, Any]]] = lambda spec: []
    choice_requires: dict[tuple[str, Any], tuple[tuple[str, str], ...]] = field(default_factory=dict)
    # Lossy renderings (TileMix's INT8 tiles) differ from the reference by design: they apply only to tasks of a
    # workload that opted in (spec.accuracy_budget), declare LOSSY in their source, and acceptance holds them to
    # the workload's accuracy budget.
    lossy: bool = False
    # keys whose value follows from the module's computation, not from speed (Falcon-Mamba's dt/B/C norms): the
    # applicability check tries the default, then each other value of these, and pins the one that matches
    options: tuple[str, ...] = ()
    # (key, value) -> keys that change nothing in the rendering while key == value (the Triton linear's tiles when
    # the projections run on cuBLAS): `canonical` sets them to the default, so a search never spends trials on points
    # that render the same kernels
    inactive: dict[tuple[str, Any], tuple[str, ...]] = field(default_factory=dict)

    def canonical(self, spec: TaskSpec, config: dict[str, Any], default: dict[str, Any] | None = None) -> dict:
        """`config` with the keys its choices make inactive set to the default's values."""
        dead = {k for (key, value), keys in self.inactive.items() if config.get(key) == value for k in keys}
        if not dead:
            return config
        default = self.default(spec) if default is None else default
        return {k: default[k] if k in dead and k in default else v for k, v in config.items()}

    def pinned(self, values: dict[str, Any]) -> "Template":
        """This template with `values` (option keys) fixed: the config space a search of one task explores once
        the applicability check found which variant computes what the module does."""
        if not values:
            return self
        space_fn = self.space_fn
        return dataclasses.replace(self, space_fn=lambda spec: {**space_fn(spec), **{k: [v] for k, v in
                                                                                   values.items()}})

    def variants(self, spec: TaskSpec) -> list[dict[str, Any]]:
        """The option assignments the applicability check tries after the default's: every other value of each
        option key (one key at a time)."""
        space, default = self.space(spec), self.default(spec)
        return [{k: v} for k in self.options if k in space for v in space[k] if v != default[k]]

    def missing_ops(self, config: dict[str, Any] | None = None) -> list[str]:
        """The `module.attr` names this template (or this config of it) imports that do not exist yet."""
        needs = list(self.requires)
        for (key, value), extra in self.choice_requires.items():
            if config is None or config.get(key) == value:
                needs += [] if config is None else list(extra)
        return [f"{m}.{a}" for m, a in needs if not _importable(m, a)]

    def why_not(self, spec: TaskSpec) -> str | None:
        if self.lossy and not spec.accuracy_budget:
            return (f"{self.name}: lossy, and the workload has not opted in (allow_lossy = true and an "
                    f"[accuracy_budget])")
        if spec.family != self.family:
            return f"{self.name}: expected family {self.family}, got {spec.family}"
        if spec.phase not in self.phases:
            return f"{self.name}: written for phases {self.phases}, not {spec.phase}"
        missing = self.missing_ops()
        if missing:
            return f"{self.name}: ops not available yet: {missing}"
        return self.applies_fn(spec)

    def space(self, spec: TaskSpec) -> Space:
        """The config space with choices whose ops are missing removed."""
        space = {k: list(v) for k, v in self.space_fn(spec).items()}
        for (key, value), extra in self.choice_requires.items():
            if key in space and any(not _importable(m, a) for m, a in extra):
                space[key] = [v for v in space[key] if v != value]
        return space

    def default(self, spec: TaskSpec) -> dict[str, Any]:
        space, pref = self.space(spec), self.default_fn(spec)
        return {k: pref[k] if k in pref and pref[k] in vals else vals[0] for k, vals in space.items()}

    def seeds(self, spec: TaskSpec) -> list[dict[str, Any]]:
        """The seeds_fn points that lie in the space (full configs: the default fills keys a seed leaves out),
        without the default and without repeats."""
        space, default = self.space(spec), self.default(spec)
        out, seen = [], {config_key("", default)}
        for pref in self.seeds_fn(spec):
            c = {k: pref[k] if k in pref and pref[k] in vals else default[k] for k, vals in space.items()}
            if config_key("", c) not in seen:
                seen.add(config_key("", c))
                out.append(c)
        return out

    def configs(self, spec: TaskSpec, limit: int = 20000) -> list[dict[str, Any]]:
        """Every point of the space, or, when it has more than `limit`, the default and the seeds, every point one
        key away from the default, then a uniform sample of the rest (seeded by template and task: reproducible).
        A plain cut of the product would keep only the first keys' smallest values and drop the default (the fused
        Mamba2 decode space has 4.0M points: its searches had tried only 16x32 one-warp GEMVs and never the
        default)."""
        space = self.space(spec)
        keys, sizes = list(space), [len(v) for v in space.values()]
        total = math.prod(sizes)
        if total <= limit:
            return self._distinct(spec, (dict(zip(keys, vals)) for vals in itertools.product(*space.values())))
        return self._distinct(spec, self._sampled(spec, space, keys, sizes, total, limit))

    def _distinct(self, spec: TaskSpec, configs) -> list[dict[str, Any]]:
        # canonical points, each once, in order (the space's product repeats a point once per inactive key's value)
        if not self.inactive:
            return list(configs)
        out, seen, default = [], set(), self.default(spec)
        for c in configs:
            c = self.canonical(spec, c, default)
            if config_key("", c) not in seen:
                seen.add(config_key("", c))
                out.append(c)
        return out

    def _sampled(self, spec: TaskSpec, space, keys, sizes, total: int, limit: int) -> list[dict[str, Any]]:
        default = self.default(spec)
        out = [default, *self.seeds(spec)]
        seen = {config_key("", c) for c in out}
        for k, vals in space.items():
            for v in vals:
                c = {**default, k: v}
                if config_key("", c) not in seen and len(out) < limit:
                    seen.add(config_key("", c))
                    out.append(c)
        rng = random.Random(f"{self.name}:{spec.task_id}:{total}")
        # past sys.maxsize random.sample cannot take the range: independent draws (a repeat is then next to
        # impossible, and a repeated point is skipped below)
        draws = rng.sample(range(total), min(total, limit)) if total <= sys.maxsize else (
            rng.randrange(total) for _ in range(2 * limit))
        for i in draws:
            if len(out) >= limit:
                break
            c = {}
            for k, n in zip(reversed(keys), reversed(sizes)):  # index -> point, the last key fastest
                i, r = divmod(i, n)
                c[k] = space[k][r]
            c = {k: c[k] for k in keys}
            if config_key("", c) not in seen:
                seen.add(config_key("", c))
                out.append(c)
        return out

    def render(self, spec: TaskSpec, config: dict[str, Any]) -> str:
        space = self.space(spec)
        if set(config) != set(space):
            raise ValueError(f"{self.name}: expected config keys {sorted(space)}, got {sorted(config)}")
        bad = {k: v for k, v in config.items() if v not in space[k]}
        if bad:
            raise ValueError(f"{self.name}: expected values from the config space, got {bad}")
        return self.render_fn(spec, config)


_IMPORT_CACHE: dict[tuple[str, str], bool] = {}


def _importable(module: str, attr: str) -> bool:
    if (module, attr) not in _IMPORT_CACHE:
        try:
            _IMPORT_CACHE[(module, attr)] = hasattr(importlib.import_module(module), attr)
        except Exception:  # noqa: BLE001 - an op file being written may fail to import for any reason
            _IMPORT_CACHE[(module, attr)] = False
    return _IMPORT_CACHE[(module, attr)]


def header(template: str, spec: TaskSpec, imports: list[str], config: dict[str, Any]) -> str:
    """Module docstring, imports, the baked config and the static helper of a self-contained source (one that
    writes its own host code: the built-in templates render through `host_source` instead)."""
    doc = f'"""Candidate from template {template} for a {spec.family}/{spec.phase} task ({spec.dtype})."""'
    cfg = repr({k: config[k] for k in sorted(config)})
    return "\n".join([doc, "import torch", "import triton", "import triton.language as tl", *imports, "",
                      f"CONFIG = {cfg}", STATIC_HELPER])


def host_source(template: str, spec: TaskSpec, config: dict[str, Any], module: str, factory: str,
                extra: str = "", **names: Any) -> str:
    """A rendered source whose host code is `kernels_runtime.hosts.<module>.<factory>`: the docstring, the baked
    config, the factory called once with it and the task's `names` (literals), and the contract's `entry`.
    `extra`: module-level lines the runtime reads from the source itself (`LOSSY = {...}`, `STATE_IN_PLACE`)."""
    doc = f'"""Candidate from template {template} for a {spec.family}/{spec.phase} task ({spec.dtype})."""'
    cfg = repr({k: config[k] for k in sorted(config)})
    args = "".join(f", {k}={v!r}" for k, v in names.items())
    return "\n".join([doc, f"from kernels_runtime.hosts.{module} import {factory}", "", f"CONFIG = {cfg}",
                      *([extra.rstrip()] if extra else []), f"_entry = {factory}(CONFIG{args})", "", "",
                      "def entry(inputs, weights, state, static):", "    return _entry(inputs, weights, state, static)",
                      ""])


def short_class(spec: TaskSpec) -> str:
    return spec.module_class.rsplit(".", 1)[-1]
