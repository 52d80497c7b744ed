"""Config-change trigger. `llm4llm watch DIR` watches workload TOMLs and their inference scripts and emits a Prefect
event, `llm4llm.workload.changed`, when a workload's content hash (the parsed TOML + the script's bytes:
llm4llm.workload.Workload.content_hash) differs from the last one seen. A touch, an identical rewrite or a
comment-only edit of the TOML changes no hash and emits nothing. The `optimize-workload/on-change` deployment has a
trigger on that event (deployments.serve.on_change_trigger) and runs with the event's path as its parameter, so the
run shows in the Prefect UI as started by the event."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable

from llm4llm.errors import Llm4llmError

EVENT = "llm4llm.workload.changed"
RESOURCE_PREFIX = "llm4llm.workload."


def workload_files(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        out += sorted(p.glob("*.toml")) if p.is_dir() else [p]
    return out


def workload_identity(path: Path) -> tuple[str, str, Path, str] | None:
    """(name, content hash, script path, device) of a workload file, or None when it does not load (its run would report
    why; an invalid file mid-edit emits nothing)."""
    from llm4llm.workload import load_workload

    try:
        wl = load_workload(path, check_device=False)
    except Llm4llmError:
        return None
    return wl.name, wl.content_hash(), Path(wl.script), wl.device


def device_label(device: str) -> str:
    """cpu | cuda:N (a bare "cuda" is device 0), as the triggers match it."""
    return "cuda:0" if device == "cuda" else device


def change_event(path: Path, name: str, content_hash: str, previous: str | None, device: str = "cpu") -> dict:
    """The event's fields: one resource per workload (its device as a label, for the triggers that route GPU
    workloads to GPU workers), the path and the new hash in the payload."""
    return {"event": EVENT,
            "resource": {"prefect.resource.id": RESOURCE_PREFIX + name, "prefect.resource.name": name,
                         "llm4llm.path": str(path.resolve()), "llm4llm.device": device_label(device)},
            "payload": {"path": str(path.resolve()), "content_hash": content_hash, "previous_hash": previous}}


def emit(fields: dict) -> None:
    """Send one event to the Prefect API in use (PREFECT_API_URL), and wait until it is sent."""
    import asyncio

    from prefect.events import Event
    from prefect.events.clients import get_events_client

    async def send() -> None:
        async with get_events_client() as client:
            await client.emit(Event(**fields))

    asyncio.run(send())


class HashState:
    """The last content hash seen per workload file, kept in a small JSON file so that a restarted watcher does not
    emit for workloads that did not change while it was down."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.hashes: dict[str, str] = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def update(self, key: str, value: str) -> str | None:
        """Record `value`; returns the previous hash (None if the file was unseen)."""
        old = self.hashes.get(key)
        self.hashes[key] = value
        tmp = self.path.with_suffix(".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(self.hashes, indent=1, sort_keys=True))
        os.replace(tmp, self.path)
        return old


def scan(paths: Iterable[str | Path], state: HashState, on_change: Callable[[dict], None],
         emit_new: bool = True) -> list[dict]:
    """Compare every workload's hash with the state; call on_change(event fields) for each one that changed (and,
    with emit_new, for files not seen before). Returns the events."""
    events = []
    for f in workload_files(paths):
        ident = workload_identity(f)
        if ident is None:
            continue
        name, h, _, device = ident
        key = str(f.resolve())
        old = state.hashes.get(key)
        if old == h:
            continue
        state.update(key, h)
        if old is None and not emit_new:
            continue
        fields = change_event(f, name, h, old, device)
        on_change(fields)
        events.append(fields)
    return events


def watched_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """The directories to watch: the given ones (or the files' parents) and every workload script's directory."""
    dirs = {(Path(p) if Path(p).is_dir() else Path(p).parent).resolve() for p in paths}
    for f in workload_files(paths):
        ident = workload_identity(f)
        if ident is not None:
            dirs.add(ident[2].resolve().parent)
    return sorted(dirs)


def api_url() -> str | None:
    """The Prefect API events go to: $PREFECT_API_URL, else the active Prefect profile's; None when neither sets
    one (Prefect would then start a private ephemeral server that no deployment listens on)."""
    from prefect.settings import PREFECT_API_URL

    return os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value() or None


def start_line(paths: Iterable[str | Path], state_path: str | Path, target: str | None) -> str:
    """What `llm4llm watch` says when it starts: the workloads, the directories, the state file, where events go."""
    names = [ident[0] for f in workload_files(paths) if (ident := workload_identity(f)) is not None]
    dirs = ", ".join(str(d) for d in watched_dirs(paths))
    where = f"emitting {EVENT} to {target}" if target else "dry run: changes are printed, no event is emitted"
    return f"watching {len(names)} workload(s) ({', '.join(names) or 'none loads yet'}) in {dirs}; state " \
           f"{state_path}; {where}"


def watch(paths: list[str], state_path: str | Path, on_change: Callable[[dict], None] = emit,
          debounce_ms: int = 1600, initial: bool = False, stop_event=None) -> None:
    """Block, watching the workload files and their scripts; call on_change(event fields) whenever a workload's
    content hash changes (watchfiles groups a burst of writes within debounce_ms into one check). On start, files
    whose hash differs from the state file emit; files never seen emit only with `initial`."""
    from watchfiles import watch as _watch

    state = HashState(state_path)
    scan(paths, state, on_change, emit_new=initial)
    for _changes in _watch(*watched_dirs(paths), debounce=debounce_ms, stop_event=stop_event):
        scan(paths, state, on_change)
