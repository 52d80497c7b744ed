"""The one interface every proposer satisfies (built-in library, LLM, hybrid)."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from llm4llm.search.types import Candidate, Experience, Feedback
from llm4llm.taskspec import TaskSpec


@runtime_checkable
class Proposer(Protocol):
    name: str

    def propose(self, task: TaskSpec, experience: list[Experience], feedback: list[Feedback], n: int) -> list[Candidate]:
        """Up to `n` new candidates for `task`. `experience`: the distilled lessons of earlier episodes (oldest
        first); `feedback`: this episode's (or trajectory's) verified candidates so far, oldest first. Returning
        fewer than `n` says the proposer has nothing new to offer."""
        ...
