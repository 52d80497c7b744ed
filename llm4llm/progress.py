"""Progress of long steps, for whoever shows it (the CLI installs a rich progress bar; flows run without one).

The stage functions call `progress.start(key, description, total)`, `progress.advance(key)` and
`progress.done(key)`; with no reporter installed these do nothing.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Protocol


class Reporter(Protocol):
    def start(self, key: str, description: str, total: int | None) -> None: ...
    def advance(self, key: str, n: int = 1) -> None: ...
    def done(self, key: str) -> None: ...


_reporter: Reporter | None = None
_lock = threading.Lock()


def start(key: str, description: str, total: int | None = None) -> None:
    if _reporter is not None:
        with _lock:
            _reporter.start(key, description, total)


def advance(key: str, n: int = 1) -> None:
    if _reporter is not None:
        with _lock:
            _reporter.advance(key, n)


def done(key: str) -> None:
    if _reporter is not None:
        with _lock:
            _reporter.done(key)


class RichReporter:
    """One bar per long step (a search's trials, a profile, an extraction) on a rich Progress."""

    def __init__(self, progress):
        self.progress, self.ids = progress, {}

    def start(self, key, description, total):
        self.ids[key] = self.progress.add_task(description, total=total)

    def advance(self, key, n=1):
        if key in self.ids:
            self.progress.advance(self.ids[key], n)

    def done(self, key):
        if key in self.ids:
            task = self.progress.tasks[self.ids[key]] if self.ids[key] < len(self.progress.tasks) else None
            total = task.total if task is not None and task.total is not None else 1
            self.progress.update(self.ids[key], total=total, completed=total)


@contextmanager
def rich_progress(console) -> Iterator[None]:
    """Show progress bars on `console` while the block runs (the CLI's long commands)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    global _reporter
    bars = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=False)
    previous, _reporter = _reporter, RichReporter(bars)
    try:
        with bars:
            yield
    finally:
        _reporter = previous
