"""Progress of long steps, for whoever shows it (the CLI installs a rich progress bar; flows run without one).

The stage functions call `progress.start(key, description, total)`, `progress.advance(key)` and
`progress.done(key)`; with no reporter installed these do nothing. Notes also go to a log sink while one is
installed (`also_to`: a flow sends them to its Prefect run log, so a served run shows each trial in the UI).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Protocol


class Reporter(Protocol):
    def start(self, key: str, description: str, total: int | None) -> None: ...
    def advance(self, key: str, n: int = 1) -> None: ...
    def done(self, key: str) -> None: ...
    def note(self, text: str) -> None: ...


_reporter: Reporter | None = None
_lock = threading.Lock()
_clock = None  # the run's llm4llm.planner.Clock: notes carry its elapsed / budget
_sink: Callable[[str], None] | None = None


def use_clock(clock) -> None:
    """Prefix every note with this run's elapsed time and budget (`[2:31 / 8:00]`); None: no prefix."""
    global _clock
    _clock = clock


def note(text: str) -> None:
    """One line of progress for a person (a stage starts or ends, a trial is verified, the plan): printed by the
    installed reporter and sent to the log sink, with the run's clock when one is in use."""
    if _reporter is None and _sink is None:
        return
    line = f"{_clock.status()} {text}" if _clock is not None else text
    with _lock:
        if _reporter is not None:
            _reporter.note(line)
        if _sink is not None:
            _sink(line)


@contextmanager
def also_to(sink: Callable[[str], None]) -> Iterator[None]:
    """Send every note to `sink` too while the block runs, whether a reporter prints them or not (the innermost
    block's sink wins: a nested flow logs each note once)."""
    global _sink
    previous, _sink = _sink, sink
    try:
        yield
    finally:
        _sink = previous


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

    def note(self, text):
        self.progress.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def done(self, key):
        if key in self.ids:
            task = self.progress.tasks[self.ids[key]] if self.ids[key] < len(self.progress.tasks) else None
            total = task.total if task is not None and task.total is not None else 1
            self.progress.update(self.ids[key], total=total, completed=total)


class LineReporter:
    """Progress as plain lines, for output that is no terminal (a file, a pipe, a scheduled or remote run's log):
    the notes, each step's start and end; no bars, no escape codes."""

    def __init__(self, console):
        self.console, self.steps = console, {}

    def start(self, key, description, total):
        self.steps[key] = [description, total, 0]

    def advance(self, key, n=1):
        if key in self.steps:
            self.steps[key][2] += n

    def done(self, key):
        self.steps.pop(key, None)

    def note(self, text):
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)


@contextmanager
def rich_progress(console) -> Iterator[None]:
    """Show progress on `console` while the block runs (the CLI's long commands): bars on a terminal, plain lines
    elsewhere."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    global _reporter
    if not console.is_terminal:
        previous, _reporter = _reporter, LineReporter(console)
        try:
            yield
        finally:
            _reporter = previous
        return
    bars = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True)
    previous, _reporter = _reporter, RichReporter(bars)
    try:
        with bars:
            yield
    finally:
        _reporter = previous
