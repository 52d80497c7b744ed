"""The sandboxed children's output (llm4llm/childlog.py): the project's own lines reach the user's terminal and the
bounded log as the child prints them, so a child stopped at its limit (an acceptance stopped inside its time
budget) still leaves what it said."""
from __future__ import annotations

import uuid

import pytest

from llm4llm import childlog
from llm4llm.isolation import in_subprocess


def test_a_child_killed_before_it_flushes_still_leaves_its_lines(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("LLM4LLM_HOME", str(tmp_path))
    line = f"accept: step one done ({uuid.uuid4().hex[:8]})"
    # os._exit skips Python's buffer flush: with a block-buffered pipe the line would die with the child
    with pytest.raises(RuntimeError, match="died"):
        in_subprocess(exec, f"print({line!r}); import os; os._exit(3)")
    assert line in capfd.readouterr().out
    assert line in childlog.log_path().read_text()
