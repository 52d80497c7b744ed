"""Acceptance decisions are recorded as they are made (llm4llm.stages.accept.DecisionJournal): the child appends
each to its journal, the parent's poll records it, so a step stopped by Ctrl-C or a time limit keeps what it decided
(on the H100 a call's limit once ended a step after the layer kernel's +47.8 % acceptance, and the row was lost)."""
from __future__ import annotations

import textwrap

import pytest

from llm4llm.accept import Decision
from llm4llm.outcomes import DecidedBy
from llm4llm.stages.accept import DecisionJournal


def _decision(task: str, verdict: str = "rejected", by: DecidedBy = DecidedBy.LATENCY) -> Decision:
    return Decision(task, f"c-{task}", verdict, f"reason of {task}", "logits_rel_l2_floor", 0.01, 10.0, 9.0, 0.1,
                    0.3, {"kernel": {"x": 2}}, decided_by=by)


def test_a_decision_comes_back_from_its_journal_line_as_it_was():
    d = _decision("t", "accepted")
    back = Decision.from_json(d.to_json())
    assert back == d and back.decided_by is DecidedBy.LATENCY and back.accepted


def test_the_journal_hands_on_each_complete_line_once_in_order(tmp_path, capsys):
    got: list[Decision] = []
    j = DecisionJournal(tmp_path / "accept" / "run.jsonl", got.append)
    j.read()  # nothing written yet
    a, b, c = _decision("a"), _decision("b"), _decision("c", by=DecidedBy.TIME_BUDGET)
    with open(j.path, "a") as f:
        f.write(a.to_json() + "\n" + b.to_json()[:20])  # b still being written
    j.read()
    assert got == [a]
    with open(j.path, "a") as f:
        f.write(b.to_json()[20:] + "\n" + '{"task_id": "forged"}\n' + c.to_json() + "\n")
    j.read()
    j.read()
    assert got == [a, b, c]  # the unreadable line is skipped with a line saying so, the rest kept
    assert "accept: journal line 3 unreadable, skipped: TypeError" in capsys.readouterr().out


def test_a_stale_journal_of_the_same_name_is_not_read_again(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text(_decision("old").to_json() + "\n")
    got: list[Decision] = []
    DecisionJournal(path, got.append).read()
    assert got == []


def test_a_stopped_child_keeps_the_decisions_it_journalled(tmp_path):
    """The child journals two decisions and then never returns: the parent stops it at its time limit and still
    records both (the poll after it ends, however it ends), in order."""
    import runpy

    from llm4llm.isolation import in_subprocess

    first, second = _decision("first", "accepted"), _decision("second")
    # runpy.run_path's `run_name` is the kwarg the journal output maps to: the child's script reads it as __name__
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import time
        with open(__name__, "a") as f:
            f.write({first.to_json()!r} + "\\n")
        with open(__name__, "a") as f:
            f.write({second.to_json()!r} + "\\n")
        time.sleep(600)
    """))
    got: list[Decision] = []
    journal = DecisionJournal(tmp_path / "data" / "accept" / "run.jsonl", got.append)
    with pytest.raises(RuntimeError, match="no result within"):
        in_subprocess(runpy.run_path, str(script), timeout_s=8.0, outputs={"run_name": str(journal.path)},
                      readable=[str(tmp_path)], poll=journal.read, poll_every_s=0.2)
    assert got == [first, second]
