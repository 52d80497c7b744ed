"""The isolated worker: one sandboxed process per candidate judges it; the parent enforces the wall clock.

A candidate may hang, crash the interpreter, poison its CUDA context, or attack the machine. So candidates never run
in the caller's process: `VerifierPool` starts a worker through llm4llm.verify.sandbox (its own session, an
allowlisted environment, a private dir holding a read-only copy of the task, no network, uid nobody, Landlock,
seccomp; docs/threat-model.md), sends it one job as JSON over a socket, waits at most `timeout_s` for the verdict,
and then kills the worker's whole process group: a worker serves exactly one candidate, so nothing a candidate
patches in its process (the verifier's own functions, torch, Triton) reaches the next. The next worker is started
while the current one runs (a warm spare), so the import of torch and Triton overlaps the work.

Messages are JSON, never pickle (unpickling what a compromised worker sent would run its code in the parent).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from llm4llm import childlog
from llm4llm.outcomes import DecodeTiming, FailureClass
from llm4llm.verify.kernel_cache import default_dir as kernel_cache_dir
from llm4llm.verify.kernel_cache import keep as keep_kernels
from llm4llm.verify.kernel_cache import seed as seed_kernels
from llm4llm.verify.static_check import check_source, forbidden_names_for, host_only
from llm4llm.verify.static_gate import check_task_source
from llm4llm.verify.verdict import GateResult, Verdict, source_hash

START_TIMEOUT_S = 300.0  # a fresh worker imports torch and Triton (and initialises CUDA) before it is ready
MAX_MESSAGE = 64 << 20


def send_json(conn: Connection, obj: Any) -> None:
    conn.send_bytes(json.dumps(obj, default=str).encode())


def recv_json(conn: Connection) -> Any:
    return json.loads(conn.recv_bytes(MAX_MESSAGE).decode())


def sandbox_main() -> int:
    """The worker process (started by `VerifierPool` through the sandbox): python -c boot FD DEVICE."""
    fd, device = int(sys.argv[1]), sys.argv[2]
    conn = Connection(fd)
    _worker_main(conn, device)
    return 0


def _worker_main(conn, device: str) -> None:
    """Worker loop: receive a job dict, answer {"verdict": dict, "poisoned": bool}; None ends the loop."""
    if device == "cpu":
        # Candidates on the CPU run under Triton's interpreter (correctness only; the CPU never times anything).
        os.environ["TRITON_INTERPRET"] = "1"
        from kernels_runtime.interp import enable_fast_interpreter

        enable_fast_interpreter()
    import torch

    from llm4llm.verify.candidate import install_launch_hook
    from llm4llm.verify.gates import install_thread_counting
    from llm4llm.verify.sandbox import layers_from_env

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        torch.cuda.init()
    install_launch_hook()
    install_thread_counting()  # before any candidate: its helper threads count into the judged call's counter
    send_json(conn, {"ready": os.getpid(), "sandbox": layers_from_env()})
    _serve(conn)
    # Skip interpreter teardown (Triton/torch atexit work can take seconds); the worker owns nothing to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(conn) -> None:
    """One candidate: "load" (with the job) builds its session, then "call" and "time" as the parent asks."""
    from llm4llm.verify.gates import CandidateSession

    session = None
    while True:
        try:
            msg = recv_json(conn)
        except (EOFError, OSError, ValueError):
            return
        if msg is None:
            return
        try:
            op = msg.pop("op")
            if op == "load":
                session = CandidateSession(**msg)
                reply = session.load()
            elif op == "call":
                reply = session.call(**msg)
            elif op == "time":
                reply = session.time(**msg)
            elif op == "gates":  # tasks of a kind (llm4llm/taskkind.py): their own protocol, judged in this process
                from llm4llm.verify.gates import run_gates

                verdict, poisoned = run_gates(**msg)
                reply = {"verdict": verdict.model_dump(mode="json"), "poisoned": poisoned}
            else:
                reply = {"error": f"unknown op {op!r}", "poisoned": True}
        except BaseException as e:  # noqa: BLE001 - a harness failure is reported, never hidden
            reply = {"error": "".join(traceback.format_exception(e))[-6000:], "poisoned": True}
        send_json(conn, reply)
        if reply.get("poisoned"):
            return


FRESH_CALLS = 24  # fresh draws a task's cases share at the least, before the per-case count is cut


def fresh_draws(draws: int, cases: int, randomise: bool = True) -> int:
    """Fresh draws per captured case. A task with many cases (a serving regime's corners: batch x prompt length,
    each a distinct shape) shares FRESH_CALLS among them, at least 2 a case, instead of `draws` each: every judged
    call of a 7B layer at batch 32 moves and checks a GB of KV cache, and its corners' draws and references were
    half of its verification (docs/results). A bare check (draws 0) stays bare. A random extra (0-3, 0-1 past 4
    cases) keeps the call count unknown to the candidate."""
    base = max(2, min(draws, -(-FRESH_CALLS // max(cases, 1)))) if draws > 2 and cases > 1 else draws
    return base + (secrets.randbelow(4 if cases <= 4 else 2) if randomise else 0)


class _WorkerTimeout(Exception):
    pass


class _WorkerDied(Exception):
    pass


class _HarnessError(Exception):
    pass


@dataclass
class _Worker:
    """One sandboxed worker process, its socket and its private dir."""

    proc: Any
    conn: Connection
    box: Path
    pid: int | None = None  # set once it said it is ready
    sandbox: dict | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None


# How decode tasks are timed (llm4llm/verify/timing.py): llm4llm.outcomes.DecodeTiming's values, as plain strings
DECODE_TIMINGS: tuple[str, ...] = tuple(t.value for t in DecodeTiming)


class _Rpc:
    """One request to the worker and its reply, within the candidate's deadline; a "load" request sends the
    candidate's load job."""

    def __init__(self, conn: Connection, job: dict, deadline: float):
        self.conn, self.job, self.deadline = conn, job, deadline

    def __call__(self, msg: dict) -> dict:
        send_json(self.conn, self.job if msg.get("op") == "load" else msg)
        if not self.conn.poll(max(0.0, self.deadline - time.monotonic())):
            raise _WorkerTimeout()
        try:
            reply = recv_json(self.conn)
        except (EOFError, OSError, ValueError):
            raise _WorkerDied() from None
        if "error" in reply:
            raise _HarnessError(reply["error"])
        return reply


class VerifierPool:
    """Sandboxed workers for `device`, one per candidate (a fresh one after every job, timeout, crash or poisoned
    CUDA context).

    `verify(task_dir, source)` runs the static gate here (cheap, and it keeps rejected code out of the worker),
    checks the task's artifact hashes, copies the task read-only into the worker's private dir, then runs the rest in
    the worker. Use as a context manager or call `close()`.
    """

    def __init__(self, device: str = "cpu", timeout_s: float = 120.0, draws: int = 5, seed: int = 0,
                 timing: bool = True, memcheck: bool = False, start_timeout_s: float = START_TIMEOUT_S,
                 decode_timing: DecodeTiming | str = DecodeTiming.LAUNCH, mem_limit_bytes: int | None = None,
                 spare: bool = True, rehearse_timing: bool = False, kernel_cache: str | Path | None = "default"):
        from llm4llm.verify.sandbox import default_mem_limit

        self.device = "cuda:0" if device == "cuda" else device
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        if decode_timing not in DECODE_TIMINGS:  # a DecodeTiming or its string (a StrEnum equals its value)
            raise ValueError(f"decode_timing: expected one of {DECODE_TIMINGS}, got {decode_timing!r}")
        decode_timing = DecodeTiming(decode_timing)
        # rehearse_timing: on the CPU, run the timed calls anyway (host clocks, numbers discarded) so that their
        # sampled outputs are checked (gates.judge_remote); on the GPU timing always runs them
        self.options = {"draws": draws, "seed": seed, "timing": timing, "memcheck": memcheck,
                        "decode_timing": decode_timing, "rehearse_timing": rehearse_timing}
        self.mem_limit = mem_limit_bytes or default_mem_limit()
        self.spare = spare
        # the project's compiled kernels, shared by workers (verify/kernel_cache.py); "default": by device and env
        self.kernel_cache = kernel_cache_dir(self.device) if kernel_cache == "default" else (
            Path(kernel_cache) if kernel_cache else None)
        self._w: _Worker | None = None
        self._hashes: dict[str, dict[str, str]] = {}  # task dir -> artifact hashes first seen
        self.restarts = 0
        self.last_pid: int | None = None
        self._spawn()

    # -- process management
    def _spawn(self) -> None:
        from llm4llm.taskkind import all_kinds
        from llm4llm.verify.sandbox import make_box, sandboxed_popen

        box = make_box()
        if self.kernel_cache is not None:
            from llm4llm.verify.sandbox import NOBODY

            try:
                seed_kernels(self.kernel_cache, box / "work" / ".triton", NOBODY if os.geteuid() == 0 else None)
            except OSError as e:  # a cache is only an optimisation: a worker without it compiles, as before
                print(f"llm4llm verifier: kernel cache {self.kernel_cache} not used ({e})", file=sys.stderr)
        ours, theirs = socket.socketpair()
        # what each task kind hands a worker open (e.g. a GPU lock shared by shards): the child cannot reach its path
        handed = [h for h in (k.worker_handover() for k in all_kinds()) if h[0] is not None]
        fds = (theirs.fileno(),) + tuple(f.fileno() for f, _ in handed)
        try:
            proc = sandboxed_popen("llm4llm.verify.worker:sandbox_main", box=box, pass_fds=fds,
                                   args=[str(theirs.fileno()), self.device], readonly=_readonly_paths(),
                                   extra_env={"TORCHINDUCTOR_COMPILE_THREADS": "1",
                                              **{k: v for _, env in handed for k, v in env.items()}},
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        finally:
            theirs.close()
            for f, _ in handed:
                f.close()
        # candidate code's output goes to the bounded children's log, never the user's terminal
        childlog.drain(proc.stdout, f"verifier worker {proc.pid} ({self.device})", forward=False)
        self._w = _Worker(proc, Connection(ours.detach()), box)

    def _ready(self) -> _Worker:
        if self._w is None or not self._w.alive():
            self._discard()
            self._spawn()
        w = self._w
        if w.pid is not None:
            return w
        if not w.conn.poll(self.start_timeout_s):
            self._discard()
            raise RuntimeError(f"verifier worker on {self.device}: not ready after {self.start_timeout_s:.0f}s")
        try:
            msg = recv_json(w.conn)
            w.pid, w.sandbox = int(msg["ready"]), dict(msg.get("sandbox") or {})
        except (EOFError, OSError, ValueError, KeyError):
            code = w.proc.poll()
            self._discard()
            raise RuntimeError(f"verifier worker on {self.device}: died while starting (exit code {code})") from None
        return w

    def _discard(self) -> None:
        """Kill the worker's whole process group and remove its private dir."""
        from llm4llm.verify.sandbox import kill_group, remove_box

        w, self._w = self._w, None
        if w is None:
            return
        kill_group(w.proc.pid)
        try:
            w.proc.wait(10)
        except Exception:  # noqa: BLE001 - a process that will not die is reported by the OS, not here
            pass
        w.conn.close()
        remove_box(w.box)

    @property
    def worker_pid(self) -> int | None:
        """The pid of the worker that judged the last candidate (each candidate gets its own)."""
        return self.last_pid

    # -- jobs
    def verify(self, task_dir: str | Path, source: str, *, timeout_s: float | None = None,
               **options: Any) -> Verdict:
        """Judge `source` on the task in a fresh sandboxed worker (one per candidate); the verdict's
        seconds["total"] is the whole job's wall time, the worker's start and the copies included."""
        started = time.perf_counter()
        v = self._verify(task_dir, source, timeout_s=timeout_s, **options)
        v.seconds["total"] = round(time.perf_counter() - started, 3)
        return v

    def _verify(self, task_dir: str | Path, source: str, *, timeout_s: float | None = None,
                **options: Any) -> Verdict:
        from llm4llm.taskspec import check_artifacts, load_spec
        from llm4llm.verify.sandbox import RssWatchdog, copy_readonly, layer_summary

        spec = load_spec(Path(task_dir))
        v = Verdict(source_hash=source_hash(source), task_id=spec.task_id, device_name=self.device,
                    timing_source="cuda_events" if self.device.startswith("cuda") else "none: cpu")
        try:  # the parse is bounded (size, nesting) in the gate; a parser failure still must not end the search
            rep = check_task_source(source, spec)
        except (RecursionError, MemoryError) as e:
            return v.fail("static", FailureClass.STATIC, f"the source could not be parsed: {type(e).__name__}")
        if not rep.ok:
            return v.fail("static", FailureClass.STATIC, rep.reason)
        key = str(Path(task_dir).resolve())
        self._hashes[key] = check_artifacts(Path(task_dir), self._hashes.get(key))
        w = self._ready()
        v.worker_pid = self.last_pid = w.proc.pid
        v.sandbox = dict(w.sandbox or {})
        if any(not s.startswith("on") for s in v.sandbox.values()):
            print(f"WARNING: llm4llm verifier: sandbox incomplete: {layer_summary(v.sandbox)}", file=sys.stderr)
        local = copy_readonly(Path(task_dir), w.box / "ro" / spec.task_id)
        opts = {**self.options, **options}
        job = self._load_job(local, source, opts, len(spec.cases))
        v.judge_seed = job["seed"]
        limit = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        rpc = _Rpc(w.conn, job, t0 + limit)
        dog = RssWatchdog(w.proc.pid, self.mem_limit)
        dog.start()
        try:
            v.gates.append(GateResult(name="static", passed=True, detail="allowed imports and calls only"))
            got = self._judge(v, spec, Path(task_dir), local, source, opts, rpc, w)
        except _WorkerTimeout:
            self._keep_kernels(w, source)  # what it compiled before the limit is worth as much
            self._next()
            return v.fail("worker", FailureClass.TIMEOUT, f"no verdict within {limit:.1f}s: worker killed and replaced")
        except _WorkerDied:
            return self._crashed(v, w, time.monotonic() - t0, dog)
        except _HarnessError as e:
            self._next()
            return v.fail("worker", FailureClass.WORKER_CRASH, f"verifier error:\n{e}")
        except BaseException:
            self._next()  # Ctrl-C or an error here: the worker's group goes with it
            raise
        finally:
            dog.stop()
        self._keep_kernels(w, source)
        self._next()
        return self._aot(got, Path(task_dir), source)

    def _keep_kernels(self, w: _Worker, source: str) -> None:
        """The worker's compiled kernels into the shared cache, where its candidate could run project code only."""
        if self.kernel_cache is not None and host_only(source):
            try:
                keep_kernels(w.box / "work" / ".triton", self.kernel_cache)
            except OSError as e:  # an unwritable or misplaced cache costs the sharing, never the verdict
                print(f"llm4llm verifier: kernel cache {self.kernel_cache} not written ({e})", file=sys.stderr)

    def _load_job(self, local: Path, source: str, opts: dict, cases: int = 1) -> dict:
        """The worker's load message. Per candidate: the draws' seed, how many fresh draws (`fresh_draws`), the
        canary layout (a fixed call count or canary offset is something a kernel can count on)."""
        nonce = secrets.randbits(31) | 1
        seed = int(opts.get("seed") or 0) * 1_000_003 + nonce if opts.get("randomise", True) else int(opts["seed"])
        draws = fresh_draws(int(opts["draws"]), cases, bool(opts.get("randomise", True)))
        return {"op": "load", "task_dir": str(local), "source": source, "device": self.device, "draws": draws,
                "seed": seed, "canary_seed": seed, "timing": opts["timing"], "decode_timing": opts["decode_timing"]}

    def _judge(self, v: Verdict, spec, task_dir: Path, local: Path, source: str, opts: dict, rpc: "_Rpc",
               w: _Worker) -> Verdict:
        """The gates, run through the worker: a task kind's own protocol inside it, else judged from here on what
        it returns; then the optional memcheck."""
        import torch

        from llm4llm.taskkind import kind_of
        from llm4llm.taskspec import load_task
        from llm4llm.verify.gates import Canary, judge_remote, lossy_of_source

        draws, seed = rpc.job["draws"], rpc.job["seed"]
        task = load_task(task_dir)
        if kind_of(spec) is not None:
            # a task kind's protocol (one that compares the candidate with the reference in one process, as a
            # benchmark does) runs in the sandboxed worker, not here (docs/threat-model.md)
            r = rpc({"op": "gates", "task_dir": str(local), "source": source, "device": self.device,
                     "draws": draws, "seed": seed, "timing": bool(opts["timing"])})
            got = Verdict.model_validate(r["verdict"])
            got.worker_pid, got.sandbox, got.judge_seed = v.worker_pid, v.sandbox, seed
        else:
            try:
                got, _poisoned = judge_remote(v, task, torch.device(self.device), rpc, w.box / "work", draws, seed,
                                              Canary(seed), timing=bool(opts["timing"]),
                                              rehearse=bool(opts.get("rehearse_timing")),
                                              lossy=lossy_of_source(source, task))
            finally:  # the draws' and references' blocks, back to the driver for the next worker or stage
                if self.device.startswith("cuda"):
                    torch.cuda.empty_cache()
        if opts.get("memcheck") and got.passed:
            from llm4llm.verify.sanitizer import memcheck_gate

            g = memcheck_gate(str(local), source, self.device)
            got = got.fail("memcheck", FailureClass.OUT_OF_BOUNDS, g.detail) if not g.passed else got
            if g.passed:
                got.gates.append(g)
        return got

    def _aot(self, v: Verdict, task_dir: Path, source: str) -> Verdict:
        """On the CPU, after the interpreter passed it: would the GPU compiler take it? (its own sandboxed process,
        started from here: the worker may not exec anything)"""
        from llm4llm.verify.aot import aot_arch, aot_gate

        arch = aot_arch()
        if self.device != "cpu" or arch is None or not v.passed:
            return v
        g = aot_gate(str(task_dir), source, arch)
        timing = [x for x in v.gates if x.name.startswith("timing")]
        v.gates = [x for x in v.gates if not x.name.startswith("timing")]
        if not g.passed:
            return v.fail(g.name, FailureClass.COMPILE, g.detail)
        v.gates += [g, *timing]
        return v.finish()

    def _next(self) -> None:
        """Retire the worker that judged a candidate and start the next one (a worker serves one candidate)."""
        self._discard()
        self.restarts += 1
        if self.spare:
            self._spawn()

    def _crashed(self, v: Verdict, w: _Worker, elapsed: float, dog) -> Verdict:
        try:
            code = w.proc.wait(10)
        except Exception:  # noqa: BLE001
            code = None
        self._next()
        if dog.tripped is not None:
            return v.fail("worker", FailureClass.OOM,
                          f"worker's resident memory reached {dog.tripped / 2**30:.2f} GiB, over the sandbox limit "
                          f"of {self.mem_limit / 2**30:.2f} GiB: killed after {elapsed:.1f}s")
        if code == -signal.SIGKILL:
            return v.fail("worker", FailureClass.OOM,
                          f"worker killed by SIGKILL after {elapsed:.1f}s (likely out of memory)")
        if code is not None and -code in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            # stopped from outside (a time limit on the whole run, Ctrl-C): not a fault of the candidate, whose
            # config must not be remembered as one. Inside the sandbox seccomp refuses these signals, so the
            # candidate cannot have sent them; where seccomp is off it could have, and the message says so.
            sure = str((v.sandbox or {}).get("seccomp", "")).startswith("on")
            return v.fail("worker", FailureClass.INTERRUPTED,
                          f"worker stopped by {signal.Signals(-code).name} after {elapsed:.1f}s (from outside: not "
                          f"the candidate's fault"
                          + ("" if sure else "; seccomp is off, so the candidate could have sent it itself") + ")")
        if code is not None and code < 0 and self.device.startswith("cuda"):
            return v.fail("worker", FailureClass.GPU_FAULT, f"worker died of signal {-code} after {elapsed:.1f}s")
        return v.fail("worker", FailureClass.WORKER_CRASH, f"worker died (exit code {code}) after {elapsed:.1f}s")

    def close(self) -> None:
        if self._w is not None and self._w.alive():
            try:
                send_json(self._w.conn, None)
            except (BrokenPipeError, OSError):
                pass
        self._discard()

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._discard()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _readonly_paths() -> list[str]:
    """Trees the worker sees read-only even where the uid drop is refused: the project and the data dirs."""
    from llm4llm.verify.sandbox import _project_root

    paths = {_project_root(), os.getcwd()}
    data = os.environ.get("LLM4LLM_DATA_DIR")
    if data:
        paths.add(data)
    return sorted(p for p in paths if p not in ("/", "/tmp") and os.path.isdir(p))


def verify_candidate(task_dir: str | Path, source: str, *, device: str = "cpu", timeout_s: float = 120.0,
                     **options: Any) -> Verdict:
    """One-shot verification in a fresh worker (for many candidates, keep a `VerifierPool`)."""
    with VerifierPool(device, timeout_s) as pool:
        return pool.verify(task_dir, source, **options)
