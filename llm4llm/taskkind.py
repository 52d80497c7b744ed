"""Task kinds: what a task's `reference` field selects beyond the model tasks' own contract.

A model task (the default: `kind_of` returns None) takes an `entry(inputs, weights, state, static)` candidate, judged
by the verifier's gates (llm4llm/verify/gates.py, judge.py) and prompted by llm4llm/llm/prompt.py. A task of another
kind brings its whole candidate contract as one `TaskKind`: its static gate, its judge (run inside the sandboxed
worker), the call whose launches the GPU compiler's gate captures, what a sandboxed worker is handed when it starts,
and its prompt. The verifier and the LLM ask this table and name no benchmark; a kind's package imports them, never
the other way (.importlinter). Kinds are loaded lazily, by entry name, on first use.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol

# TaskSpec.reference -> "module:attribute" of the kind's TaskKind, imported the first time a task of it is seen
ENTRIES: dict[str, str] = {"kernelbench": "llm4llm.kernelbench.kind:KIND"}
_LOADED: dict[str, "TaskKind"] = {}


class TaskKind(Protocol):
    """One kind of task other than the model tasks: its candidate contract, end to end."""

    name: str  # the TaskSpec.reference it serves
    target: Any  # what a candidate's source defines: an llm.extract.Target (a model task's: extract.ENTRY)
    final_instruction: str  # the prompt's last line

    def static_gate(self, source: str) -> Any:
        """The kind's static checker after the size limit: a verify.static_check.StaticReport."""

    def judge(self, v: Any, task: Any, module: Any, dev: Any, timing: bool) -> tuple[Any, bool]:
        """Judge a loaded candidate module inside the worker: (Verdict, whether the CUDA context is poisoned)."""

    def launch_call(self, task: Any, module: Any) -> Callable[[], Any]:
        """A call of the loaded candidate on the CPU whose Triton launches the GPU compiler's gate captures."""

    def worker_handover(self) -> tuple[Any, dict[str, str]]:
        """An open file a sandboxed worker inherits (or None) and the environment that names it to the child."""

    def system_prompt(self) -> str:
        """The LLM's system prompt for this kind."""

    def task_section(self, task: Any) -> str:
        """The prompt's task section for one task spec."""


def register(name: str, entry: str) -> None:
    """Add a kind: tasks whose `reference` is `name` are served by the TaskKind at `entry` ("module:attribute")."""
    ENTRIES[name] = entry
    _LOADED.pop(name, None)


def load(name: str) -> TaskKind:
    if name not in _LOADED:
        module, _, attr = ENTRIES[name].partition(":")
        _LOADED[name] = getattr(importlib.import_module(module), attr)
    return _LOADED[name]


def kind_of(spec: Any) -> TaskKind | None:
    """The kind of a task spec (anything with a `reference`), or None for a model task."""
    name = getattr(spec, "reference", "")
    return load(name) if name in ENTRIES else None


def all_kinds() -> list[TaskKind]:
    return [load(name) for name in ENTRIES]
