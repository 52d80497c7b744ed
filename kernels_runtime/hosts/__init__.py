"""Host code of the built-in templates: ordinary Python that a rendered candidate imports.

A template (llm4llm/search/templates) no longer writes host code into a string: it renders a short candidate source
that imports one factory from here, bakes its config, and calls it once at import:

    from kernels_runtime.hosts.norm import rmsnorm_op
    CONFIG = {"num_warps": 4}
    _entry = rmsnorm_op(CONFIG)
    def entry(inputs, weights, state, static):
        return _entry(inputs, weights, state, static)

Each factory takes the config (the template's keys) and the names the task's module uses (input, weight and
static names, chosen by the template from the task spec) and returns `entry(inputs, weights, state, static) ->
dict`, the candidate contract. Choices a config fixes are taken once, in the factory, not on every call. The code
here is the project's, so linters, the length rule and `duplicates` see it; bundles import it as they import
kernels_runtime.ops. Compute happens in the Triton ops; torch here only allocates, views and copies.
"""
from __future__ import annotations

from typing import Any


def static_value(static: dict, *names: str) -> Any:
    """A static value by any of the names the extraction may record (modules name their epsilon three ways)."""
    for n in names:
        if n in static:
            return static[n]
    raise KeyError(f"static: expected one of {names}, got {sorted(static)}")


def prefixed(config: dict, prefix: str) -> dict:
    """The config's keys under `prefix`, without it: the keyword arguments of one op (`lin_BLOCK_N` -> BLOCK_N)."""
    return {k[len(prefix):]: v for k, v in config.items() if k.startswith(prefix)}
