"""Where untrusted code runs, away from the flow process: the verifier workers (one per device and timing mode,
shared by the searches of this process) and sandboxed child processes for whole-model runs (acceptance trials,
end-to-end evaluation, bundle re-validation). See docs/threat-model.md."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from llm4llm import childlog
from llm4llm.outcomes import DecodeTiming

_POOLS: dict = {}


def verifier_pool(device: str, timeout_s: float, decode_timing: DecodeTiming | str):
    """One verifier worker per device (and timing mode) in this (flow) process; its lock makes timing jobs on a GPU
    one at a time. timeout_s and decode_timing: the search's (SearchSettings), passed by the search stage."""
    import threading

    from llm4llm.verify.worker import VerifierPool

    key = (device, timeout_s, decode_timing)
    if key not in _POOLS:
        _POOLS[key] = (VerifierPool(device, timeout_s, decode_timing=decode_timing), threading.Lock())
    return _POOLS[key]


# Passed verifications a task's template check ran in full (draws and timing, as a trial) of the template default
# a search tries first, by (device, timeout, decode timing, task dir, source hash): that search's trial of the same
# source in this process takes the verdict instead of verifying it again (a 7B serving regime's decode layer spent
# 81 s checking its default and then 169 s verifying it again as its first trial).
_VERIFIED: dict = {}


def remember_verdict(key: tuple, verdict) -> None:
    _VERIFIED[key] = verdict


def take_verdict(key: tuple):
    """The verdict remembered under `key`, once (None when there is none)."""
    return _VERIFIED.pop(key, None)


def close_pools() -> None:
    for pool, _ in _POOLS.values():
        pool.close()
    _POOLS.clear()
    _VERIFIED.clear()


def _run_child(fn, args, kwargs):
    from kernels_runtime.interp import interpret_without_gpu

    interpret_without_gpu()
    return fn(*args, **kwargs)


def workload_paths(workload_path: str) -> list[str]:
    """What a sandboxed run of the workload must read: its TOML's dir, its script's dir, its checkpoint."""
    paths = [str(Path(workload_path).resolve().parent)]
    try:
        from llm4llm.workload import load_workload

        wl = load_workload(workload_path)
        for attr in ("script", "checkpoint"):
            p = getattr(wl, attr, None) or getattr(getattr(wl, "model", None), attr, None)
            if p:
                paths.append(str(Path(p).resolve().parent if Path(p).is_file() else Path(p).resolve()))
    except Exception:  # noqa: BLE001 - an unusable workload fails in the child with its own message
        pass
    return paths


def in_subprocess(fn, *args, timeout_s: float = 3600.0, poll=None, poll_every_s: float = 1.0,
                  outputs: dict[str, str] | None = None, readable: list[str] | None = None,
                  extra_env: dict[str, str] | None = None, box=None, **kwargs):
    """Run fn(*args, **kwargs) in a fresh sandboxed process (llm4llm/verify/sandbox.py: candidates' kernels run in
    it) and return its result. Exceptions raised there come back as themselves; a process that dies (GPU fault,
    OOM kill) or overstays `timeout_s` raises RuntimeError, and nothing it started is left behind.

    outputs: {kwarg name: real path} of files or dirs the child writes: it writes them inside its private dir and
    the parent copies them to the real path before every poll and at the end (the child can write nothing else).
    readable: paths outside the usual trees the child must read. poll: called every poll_every_s while the child
    runs (a failing poll is retried by the next), and once after it ends however it ends (to pick up what it
    streams; its failure is raised only when the child succeeded). The result is unpickled with an allowlist of
    classes (llm4llm.verify.sandbox.SafeUnpickler), never as arbitrary pickle. box: a private dir from
    sandbox.make_box the caller already filled (read-only copies under box/ro)."""
    import pickle
    import time

    from llm4llm.verify.kernel_cache import seed_child
    from llm4llm.verify.sandbox import (NOBODY, RssWatchdog, default_mem_limit, kill_group, make_box, remove_box,
                                        sandboxed_popen)

    from kernels_runtime.interp import interpret_without_gpu

    # before the child imports anything: it unpickles `fn` (importing its module, and Triton's kernels with it)
    # before _run_child runs, so a parent without the setting (a served flow run) would leave it too late
    interpret_without_gpu()
    box = box or make_box("llm4llm-call-")
    work = box / "work"
    # the project's kernels the verifier compiled (a bundle's, at every batch bucket) are not compiled again
    seed_child(work / ".triton", NOBODY if os.geteuid() == 0 else None)
    mapped = _map_outputs(work, outputs or {}, kwargs)

    def polled() -> None:
        _sync(mapped)
        if poll:
            poll()

    ok = False
    (box / "ro" / "call.pkl").write_bytes(pickle.dumps((_run_child, (fn, args, kwargs), {})))
    proc = sandboxed_popen("llm4llm.verify.sandbox:call_main", box=box, extra_env={
        "TORCHINDUCTOR_COMPILE_THREADS": "1", **(extra_env or {})}, extra_needed=readable or [],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    # libraries' and candidates' output to the bounded children's log; the stage's own lines ("accept: ...") on
    drain = childlog.drain(proc.stdout, f"{fn.__name__} {proc.pid}", forward=True)
    dog = RssWatchdog(proc.pid, default_mem_limit())
    dog.start()
    try:
        _wait(proc, fn.__name__, time.monotonic() + timeout_s, timeout_s, polled, poll_every_s)
        result = _result(work / "result.pkl", fn.__name__, dog, proc.returncode)
        ok = True
        return result
    finally:
        dog.stop()
        kill_group(proc.pid)
        drain.join(timeout=5)  # the last lines it printed, before the caller reads what the stage returned
        try:
            polled() if (poll or mapped) else None
        except Exception:
            if ok:  # a failing last poll must not mask why the child failed
                raise
        finally:
            remove_box(box)


def _map_outputs(work: Path, outputs: dict[str, str], kwargs: dict) -> dict[str, tuple[Path, Path]]:
    """Point each output kwarg at a path inside the child's private dir; {name: (child path, real path)}."""
    mapped = {}
    for name, real in outputs.items():
        child = work / "out" / name / Path(real).name
        child.parent.mkdir(parents=True, exist_ok=True)
        os.chown(child.parent, 65534, 65534) if os.geteuid() == 0 else None
        os.chown(work / "out", 65534, 65534) if os.geteuid() == 0 else None
        kwargs[name] = str(child)
        mapped[name] = (child, Path(real))
    return mapped


def _sync(mapped: dict[str, tuple[Path, Path]]) -> None:
    """Copy what the child wrote so far to the real paths."""
    import shutil

    for child, real in mapped.values():
        if child.is_dir():
            shutil.copytree(child, real, dirs_exist_ok=True, symlinks=False)
        elif child.is_file():
            real.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(child, real)


def _wait(proc, name: str, deadline: float, timeout_s: float, polled, poll_every_s: float) -> None:
    """Wait for the child, polling every poll_every_s (a failing poll is retried by the next); past the deadline
    raise (the caller kills the group)."""
    import time

    while proc.poll() is None:
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{name}: no result within {timeout_s:.0f}s: the isolated process was killed")
        try:
            proc.wait(poll_every_s)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: poll and wait on
            try:
                polled()
            except Exception:  # noqa: BLE001 - retried by the next poll and by the last one
                pass


def _result(result_file: Path, name: str, dog, returncode: int | None):
    """The child's return value, unpickled with the allowlist; its exception re-raised with the child's
    traceback as a note; a child that left no result died (RSS watchdog or exit code)."""
    from llm4llm.verify.sandbox import SafeUnpickler

    if not result_file.exists():
        why = f"RSS over {dog.limit / 2**30:.1f} GiB" if dog.tripped else f"exit code {returncode}"
        raise RuntimeError(f"{name}: the isolated process died ({why})")
    out = SafeUnpickler.loads(result_file.read_bytes())
    if out[0] == "err":
        exc = out[1]
        if len(out) > 2 and out[2] and hasattr(exc, "add_note"):
            exc.add_note("in the isolated process:\n" + out[2])
        raise exc
    return out[1]
