"""Task-run names are what the Prefect UI lists for a run: they name the task, never an absolute path."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from prefect import Task
from prefect._internal.engine import resolve_custom_task_run_name

import tasks


def _named_tasks() -> list[Task]:
    found = {}
    for info in pkgutil.iter_modules(tasks.__path__):
        module = importlib.import_module(f"tasks.{info.name}")
        found |= {id(t): t for t in vars(module).values() if isinstance(t, Task) and t.task_run_name}
    return list(found.values())


@pytest.mark.parametrize("t", _named_tasks(), ids=lambda t: t.name)
def test_a_task_run_name_carries_no_absolute_path(t):
    params = {name: ("/srv/llm4llm/data/tasks/norm-decode-0123456789ab" if name.endswith(("_dir", "_path"))
                     else "norm-decode-0123456789ab") for name in inspect.signature(t.fn).parameters}
    name = resolve_custom_task_run_name(t, params)
    assert "/" not in name and "norm-decode-0123456789ab" in name, name


def test_the_named_tasks_include_the_search():
    assert "search-task" in {t.name for t in _named_tasks()}
