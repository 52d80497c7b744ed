"""The static gate of a task, by its kind: a KernelBench task takes a `ModelNew` (llm4llm/kernelbench/static.py),
every other task the `entry` contract (static_check.py). Above both, so the general checker imports nothing of
KernelBench's."""
from __future__ import annotations

from llm4llm.kernelbench.static import check_modelnew
from llm4llm.verify.static_check import StaticReport, check_source, forbidden_names_for, oversize


def check_task_source(source: str, spec) -> StaticReport:
    """The static gate for a task: the size limit, then its kind's checker."""
    if (big := oversize(source)) is not None:
        return big
    if getattr(spec, "reference", "") == "kernelbench":
        return check_modelnew(source)
    return check_source(source, forbidden_names_for(spec.module_class))
