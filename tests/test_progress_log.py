"""Progress reaches Prefect: a served run has no terminal, so every note (a stage, the plan, each verified trial with
the trials done and the best so far) goes to the Prefect log of the task run it comes from."""
from __future__ import annotations

import logging

from llm4llm import progress


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_notes_reach_the_sink_without_a_reporter_and_the_innermost_sink_wins():
    outer, inner = [], []
    progress.note("before")  # no reporter, no sink: nowhere, and no error
    with progress.also_to(outer.append):
        progress.note("a")
        with progress.also_to(inner.append):
            progress.note("b")
        progress.note("c")
    progress.note("after")
    assert (outer, inner) == (["a", "c"], ["b"])


def test_a_trial_note_inside_a_task_lands_in_that_task_runs_prefect_log(prefect_harness):
    from prefect import flow, task

    from flows.progress import run_log

    @task(name="search")
    def search():
        progress.note("search t0: trial 1/2 rmsnorm passed (untimed on the CPU)")
        return 1

    @flow(name="served")
    def served():
        with run_log():
            progress.note("plan: 1 target")
            return search()

    handler, loggers = _Records(), [logging.getLogger("prefect.task_runs"), logging.getLogger("prefect.flow_runs")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:  # whatever level an earlier CLI test left: the API handler sees INFO in a served run
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        served()
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
    got = {r.getMessage(): (r.name, getattr(r, "task_run_id", None)) for r in handler.records}
    trial = got["search t0: trial 1/2 rmsnorm passed (untimed on the CPU)"]
    assert trial[0] == "prefect.task_runs" and trial[1] is not None
    assert got["plan: 1 target"][0] == "prefect.flow_runs"


class _Rows:
    """A SearchRecorder that keeps nothing (the rows are not under test here)."""

    def start(self, *args):
        pass

    def trial(self, candidate, verdict, *args) -> bool:
        return verdict["passed"]

    def end(self, *args):
        pass


def test_a_search_task_run_shows_a_progress_artifact_of_its_trials(prefect_harness):
    from prefect import flow, get_client, task
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

    from tasks.search import ProgressArtifact

    seen = []

    @task(name="search")
    def search():
        rec = ProgressArtifact(_Rows())
        rec.start("s1", "norm_decode_t0", "r1", "episodic", "library", 4)
        for verdict in ({"passed": False, "failure_class": "wrong_output"},
                        {"passed": True, "speedup_in_context": 1.31}):
            rec.trial(None, verdict, "norm_decode_t0", "s1", 0, 0, "x.py")
        seen.append(_artifact(rec.artifact))
        rec.end("s1", "norm_decode_t0", None)  # a planned search may end before its budget: the bar is full
        seen.append(_artifact(rec.artifact))

    def _artifact(artifact_id):
        with get_client(sync_client=True) as client:
            (a,) = client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[artifact_id])))
        return a.type, float(a.data), a.description, a.task_run_id is not None

    @flow(name="served-search")
    def served():
        search()

    served()
    assert seen[0] == ("progress", 50.0, "search norm_decode_t0: 2/4 trials, 1 passed, best 1.31x", True)
    assert seen[1][1] == 100.0
