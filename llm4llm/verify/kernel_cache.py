"""A Triton cache of the project's own kernels, shared by the verifier's workers.

Every worker compiles in a private, empty cache (its box; a candidate must not plant a binary another candidate
loads). So every candidate recompiled every kernel it launched: a serving regime's decode layer (six batch buckets,
four GEMV stages each) spent its whole 120 s verification limit compiling. Entries compiled by a worker whose
candidate could only run the project's host code with literal settings (static_check.host_only: the built-in
templates' form) are the project's kernels, so they are kept here and copied into each new worker's cache before
it starts; entries from any other worker are never kept. Whole-model children (acceptance, evaluation) start with
a copy too (seed_child) and add nothing. The cache lives in the project's home (`LLM4LLM_HOME`,
default ./.llm4llm) under triton-cache/, or at `LLM4LLM_KERNEL_CACHE` ("off" disables it); it is not used on the
CPU (the interpreter compiles nothing). Triton names each entry by the hash of the kernel's source, constants,
options and Triton's version, so entries never go stale; they are only added, up to MAX_BYTES."""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

CACHE_ENV = "LLM4LLM_KERNEL_CACHE"
MAX_BYTES = 4 << 30  # past this the cache takes no more entries (a few hundred kernels are a few hundred MB)


def default_dir(device: str) -> Path | None:
    """The shared cache for workers on `device`: None on the CPU or where `LLM4LLM_KERNEL_CACHE=off`."""
    where = os.environ.get(CACHE_ENV, "")
    if where.lower() in ("off", "0", "none") or not device.startswith("cuda"):
        return None
    return Path(where) if where else Path(os.environ.get("LLM4LLM_HOME", ".llm4llm")).resolve() / "triton-cache"


def seed_child(box_cache: Path, owner: int | None = None) -> int:
    """Seed a whole-model child's private cache (acceptance trials, end-to-end evaluation: they load bundles whose
    kernels the verifier's workers compiled) from the GPU's shared cache, where one exists; nothing the child
    compiles is kept. Returns how many entries were copied; a failure only costs the child its compiles."""
    cache = default_dir("cuda")
    if cache is None or not cache.is_dir():
        return 0
    try:
        return seed(cache, box_cache, owner)
    except OSError:
        return 0


def _entries(root: Path) -> list[Path]:
    try:
        return [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return []


def seed(cache: Path, box_cache: Path, owner: int | None = None) -> int:
    """Copy the shared entries into a new worker's private cache (owned by `owner` where given: the sandbox's
    unprivileged user, so the worker's Triton may add files beside them). Returns how many were copied."""
    n = 0
    for entry in _entries(cache):
        dest = box_cache / entry.name
        if dest.exists():
            continue
        try:
            shutil.copytree(entry, dest)
            _repoint_groups(dest)
        except (OSError, ValueError):
            shutil.rmtree(dest, ignore_errors=True)
            continue
        n += 1
    if owner is not None and box_cache.exists():
        for path in [box_cache, *box_cache.rglob("*")]:
            try:
                os.chown(path, owner, owner, follow_symlinks=False)
            except OSError:
                pass
    return n


def _repoint_groups(entry: Path) -> None:
    """Triton's group files name their members by absolute path (the worker's box, gone once it is retired): point
    them at this copy."""
    for grp in entry.glob("__grp__*"):
        data = json.loads(grp.read_text())
        paths = data.get("child_paths") or {}
        data["child_paths"] = {name: str(entry / Path(p).name) for name, p in paths.items()}
        grp.write_text(json.dumps(data))


def keep(box_cache: Path, cache: Path) -> int:
    """Add the entries a host-only candidate's worker compiled that the shared cache lacks, each whole or not at all
    (copied beside, then renamed in). Returns how many were added."""
    new = [e for e in _entries(box_cache) if not (cache / e.name).exists()]
    if not new:
        return 0
    cache.mkdir(parents=True, exist_ok=True)
    size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    n = 0
    for entry in new:
        if any(f.is_symlink() for f in entry.rglob("*")):
            continue  # a worker's cache holds plain files; anything else is not kept
        files = [f for f in entry.rglob("*") if f.is_file() and not f.parent.name.startswith("tmp.pid_")]
        size += sum(f.stat().st_size for f in files)
        if size > MAX_BYTES:
            break
        tmp = cache / f".{entry.name}.{uuid.uuid4().hex[:8]}"
        try:
            # without Triton's half-written temporaries (a worker stopped at its time limit)
            shutil.copytree(entry, tmp, symlinks=True, ignore=shutil.ignore_patterns("tmp.pid_*", "lock"))
            tmp.rename(cache / entry.name)
            n += 1
        except OSError:  # another process added it first, or the disk is full: the entry is only an optimisation
            shutil.rmtree(tmp, ignore_errors=True)
    return n
