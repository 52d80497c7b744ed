"""The static gate of a task, by its kind: a task of a registered kind (llm4llm/taskkind.py) takes its kind's
checker, a model task the `entry` contract (static_check.py). Above the general checker, which names no kind."""
from __future__ import annotations

from llm4llm.taskkind import kind_of
from llm4llm.verify.static_check import StaticReport, check_source, forbidden_names_for, oversize


def check_task_source(source: str, spec) -> StaticReport:
    """The static gate for a task: the size limit, then its kind's checker."""
    if (big := oversize(source)) is not None:
        return big
    if (kind := kind_of(spec)) is not None:
        return kind.static_gate(source)
    return check_source(source, forbidden_names_for(spec.module_class))
