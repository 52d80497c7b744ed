"""Progress notes (llm4llm.progress) into Prefect's run logs: a served run has no terminal, so each stage, plan and
verified trial (trials done, best so far) shows in the UI's log of the task run it belongs to."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

from llm4llm import progress


@contextmanager
def run_log() -> Iterator[None]:
    """While the block runs, every note goes to the current task run's logger, else to this flow run's (a note
    from a thread outside any run context)."""
    flow_logger = get_run_logger()

    def sink(text: str) -> None:
        try:
            logger = get_run_logger()
        except MissingContextError:
            logger = flow_logger
        logger.info(text)

    with progress.also_to(sink):
        yield
