"""Config-change trigger: a workload whose content hash differs from the one its last run used is re-optimized."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from llm4llm.errors import Llm4llmError


def workload_files(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        out += sorted(p.glob("*.toml")) if p.is_dir() else [p]
    return out


def changed_workloads(paths: Iterable[str | Path], db_path: str | None = None) -> list[tuple[Path, str]]:
    """Workload files whose current content hash has no run in the database yet (new or edited configs).
    Invalid files are skipped here; running them reports their error."""
    from llm4llm.workload import load_workload
    from storage.db import Database

    changed = []
    with Database(db_path) as db:
        seen = {r[0] for r in db.query("SELECT DISTINCT workload_hash FROM runs WHERE status = 'ok'")}
    for f in workload_files(paths):
        try:
            h = load_workload(f, check_device=False).content_hash()
        except Llm4llmError:
            continue
        if h not in seen:
            changed.append((f, h))
    return changed


def watch(paths: list[str], on_change: Callable[[Path], None], db_path: str | None = None,
          stop_event=None) -> None:
    """Block, watching the workload files (and their scripts' directories); call on_change(path) for each file
    whose content hash has no run yet."""
    from watchfiles import watch as _watch

    for f, _ in changed_workloads(paths, db_path):
        on_change(f)
    for _changes in _watch(*paths, stop_event=stop_event):
        for f, _ in changed_workloads(paths, db_path):
            on_change(f)
