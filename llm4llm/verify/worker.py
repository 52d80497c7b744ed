"""The isolated worker: one spawned process per device judges candidates; the parent enforces the wall clock.

A candidate may hang, crash the interpreter, or poison its CUDA context (an illegal address leaves every later CUDA
call failing). So candidates never run in the caller's process: `VerifierPool` sends jobs over a pipe to a worker
started with multiprocessing 'spawn', waits at most `timeout_s` for the verdict, and on a timeout or a dead worker
kills it, records the failure class and starts a fresh worker for the next job.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from llm4llm.verify.static_check import check_source, check_task_source, forbidden_names_for
from llm4llm.verify.verdict import GateResult, Verdict, source_hash

START_TIMEOUT_S = 300.0  # a fresh worker imports torch and Triton (and initialises CUDA) before it is ready


def _worker_main(conn, device: str) -> None:
    """Worker loop: receive a job dict, answer {"verdict": dict, "poisoned": bool}; None ends the loop."""
    if device == "cpu":
        # Candidates on the CPU run under Triton's interpreter (correctness only; the CPU never times anything).
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from llm4llm.verify.candidate import install_launch_hook
    from llm4llm.verify.gates import run_gates

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        torch.cuda.init()
    install_launch_hook()
    conn.send({"ready": os.getpid()})
    _serve(conn, run_gates)
    # Skip interpreter teardown (Triton/torch atexit work can take seconds); the worker owns nothing to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(conn, run_gates) -> None:
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            verdict, poisoned = run_gates(**job)
            reply = {"verdict": verdict.model_dump(), "poisoned": poisoned}
        except BaseException as e:  # noqa: BLE001 - a harness failure is reported, never hidden
            reply = {"error": "".join(traceback.format_exception(e))[-6000:], "poisoned": True}
        conn.send(reply)
        if reply["poisoned"]:
            return


# How decode tasks are timed (llm4llm/verify/timing.py): "launch", calls back to back as eager decoding runs them;
# "graph", GPU time under CUDA-graph replay, as decoding runs under kernels_runtime.graphs; "graph_prefill", prefill
# tasks that way too, where the model's prompt forward replays from graphs as well (Mamba, Mamba2).
DECODE_TIMINGS = ("launch", "graph", "graph_prefill")


class VerifierPool:
    """One worker process for `device`, restarted after every timeout, crash or poisoned CUDA context.

    `verify(task_dir, source)` runs the static gate here (cheap, and it keeps rejected code out of the worker), then
    the rest in the worker. Use as a context manager or call `close()`.
    """

    def __init__(self, device: str = "cpu", timeout_s: float = 120.0, draws: int = 5, seed: int = 0,
                 timing: bool = True, memcheck: bool = False, start_timeout_s: float = START_TIMEOUT_S,
                 decode_timing: str = "launch"):
        self.device = "cuda:0" if device == "cuda" else device
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        if decode_timing not in DECODE_TIMINGS:
            raise ValueError(f"decode_timing: expected one of {DECODE_TIMINGS}, got {decode_timing!r}")
        self.options = {"draws": draws, "seed": seed, "timing": timing, "memcheck": memcheck,
                        "decode_timing": decode_timing}
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._conn = None
        self._pid: int | None = None
        self.restarts = 0
        self._spawn()

    # -- process management
    def _spawn(self) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child, self.device), daemon=True,
                                 name=f"llm4llm-verify-{self.device}")
        proc.start()
        child.close()
        self._proc, self._conn, self._pid = proc, parent, None

    def _ready(self) -> None:
        if self._proc is None or not self._proc.is_alive():
            self._discard()
            self._spawn()
        if self._pid is not None:
            return
        if not self._conn.poll(self.start_timeout_s):
            self._discard()
            raise RuntimeError(f"verifier worker on {self.device}: not ready after {self.start_timeout_s:.0f}s")
        try:
            self._pid = self._conn.recv()["ready"]
        except EOFError:
            code = self._proc.exitcode
            self._discard()
            raise RuntimeError(f"verifier worker on {self.device}: died while starting (exit code {code})") from None

    def _discard(self) -> None:
        """Kill the worker (if alive) and forget it."""
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(10)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = self._pid = None

    @property
    def worker_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- jobs
    def verify(self, task_dir: str | Path, source: str, *, timeout_s: float | None = None,
               **options: Any) -> Verdict:
        from llm4llm.taskspec import load_spec

        spec = load_spec(Path(task_dir))
        v = Verdict(source_hash=source_hash(source), task_id=spec.task_id, device_name=self.device,
                    timing_source="cuda_events" if self.device.startswith("cuda") else "none: cpu")
        rep = check_task_source(source, spec)
        if not rep.ok:
            return v.fail("static", "static", rep.reason)
        self._ready()
        v.worker_pid = self._proc.pid
        job = {"task_dir": str(task_dir), "source": source, "device": self.device, **self.options, **options}
        limit = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        self._conn.send(job)
        if not self._conn.poll(limit):
            self._discard()
            self._spawn()
            v.gates.append(GateResult(name="static", passed=True, detail="allowed imports and calls only"))
            return v.fail("worker", "timeout", f"no verdict within {limit:.1f}s: worker killed and replaced")
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            return self._crashed(v, time.monotonic() - t0)
        if reply.get("poisoned"):
            self._discard()
            self._spawn()
        if "error" in reply:
            v.gates.append(GateResult(name="static", passed=True, detail="allowed imports and calls only"))
            return v.fail("worker", "worker_crash", f"verifier error:\n{reply['error']}")
        return Verdict.model_validate(reply["verdict"])

    def _crashed(self, v: Verdict, elapsed: float) -> Verdict:
        self._proc.join(10)
        code = self._proc.exitcode
        self._discard()
        self._spawn()
        v.gates.append(GateResult(name="static", passed=True, detail="allowed imports and calls only"))
        if code == -signal.SIGKILL:
            return v.fail("worker", "oom", f"worker killed by SIGKILL after {elapsed:.1f}s (likely out of memory)")
        if code is not None and -code in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            # stopped from outside (a time limit on the whole run, Ctrl-C): not a fault of the candidate, whose
            # config must not be remembered as one (on the H200 a session's time limit read as gpu_fault)
            return v.fail("worker", "interrupted", f"worker stopped by {signal.Signals(-code).name} after "
                                                    f"{elapsed:.1f}s (from outside: not the candidate's fault)")
        if code is not None and code < 0 and self.device.startswith("cuda"):
            return v.fail("worker", "gpu_fault", f"worker died of signal {-code} after {elapsed:.1f}s")
        return v.fail("worker", "worker_crash", f"worker died (exit code {code}) after {elapsed:.1f}s")

    def close(self) -> None:
        if self._conn is not None and self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(5)
        self._discard()

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def verify_candidate(task_dir: str | Path, source: str, *, device: str = "cpu", timeout_s: float = 120.0,
                     **options: Any) -> Verdict:
    """One-shot verification in a fresh worker (for many candidates, keep a `VerifierPool`)."""
    with VerifierPool(device, timeout_s) as pool:
        return pool.verify(task_dir, source, **options)
