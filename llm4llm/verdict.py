"""The verifier's typed result: one `GateResult` per gate, in the order they ran, and a `Verdict` per candidate (a
search's Trial keeps it too: llm4llm.search imports it from here, below the verifier)."""
from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, Field

from llm4llm.outcomes import FailureClass

NO_GPU = "skipped: no GPU"


class GateResult(BaseModel):
    name: str
    passed: bool
    detail: str = ""


class Latency(BaseModel):
    """Per-call latency percentiles in milliseconds over the timed repetitions."""

    p20: float
    p50: float
    p80: float
    reps: int = 0


class Verdict(BaseModel):
    source_hash: str
    task_id: str
    gates: list[GateResult] = Field(default_factory=list)
    passed: bool = False
    failure_class: FailureClass | None = None
    message: str = ""
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    candidate_cold: Latency | None = None
    reference_cold: Latency | None = None
    candidate_in_context: Latency | None = None
    reference_in_context: Latency | None = None
    speedup_cold: float | None = None
    speedup_in_context: float | None = None
    utility: float = 0.0
    # KernelBench tasks: torch.compile (inductor, default) timed in the same worker, and the means behind the
    # speedups (KernelBench's runtime is the mean over its trials)
    reference_compile: Latency | None = None
    speedup_compile: float | None = None
    kb_means_ms: dict[str, float | None] | None = None
    kb_degenerate: bool | None = None  # every trial's reference output the same: the output ignores the inputs
    worker_pid: int | None = None
    device_name: str = ""
    timing_source: Literal["cuda_events", "none: cpu"] = "none: cpu"
    # the worker's sandbox layers as it reported them before any candidate code ran: layer -> "on ..." | "off: why"
    sandbox: dict[str, str] = Field(default_factory=dict)
    judge_seed: int | None = None  # the per-candidate seed of the draws and canary layout (reproduce with it)
    # (output + weight bytes) / peak HBM bandwidth of one call, no margin (GPU): the planner stops a task's search
    # when its best candidate is near it (llm4llm.planner.NEAR_FLOOR)
    floor_ms: float | None = None
    # where the verification's wall time went, seconds by phase: references (draws and the module's outputs),
    # load (the worker's first call, compiles included), checks (every judged call), timing, timed_outputs; total
    # (the pool's whole job: the worker's start and the copies included)
    seconds: dict[str, float] = Field(default_factory=dict)

    def lap(self, phase: str, since: float) -> float:
        """Add the seconds from `since` (time.perf_counter) to `phase`; returns now, the next phase's start."""
        import time

        now = time.perf_counter()
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + now - since, 3)
        return now

    def fail(self, gate: str, failure_class: FailureClass | str, message: str) -> "Verdict":
        """Record a failing gate; the verdict is then final (later gates do not run). A class given as a string (a
        worker's reply) that names no FailureClass is recorded as worker_crash, the string kept in the message."""
        fc = FailureClass.of(failure_class)
        if fc != failure_class:
            message = f"unknown failure class {failure_class!r}: {message}"
        self.gates.append(GateResult(name=gate, passed=False, detail=message))
        self.passed, self.failure_class, self.message, self.utility = False, fc, message, 0.0
        return self

    def finish(self) -> "Verdict":
        """Passed iff every gate passed; utility is the in-context speedup then, else 0 (a CPU run never has one)."""
        self.passed = self.failure_class is None and all(g.passed for g in self.gates)
        self.utility = float(self.speedup_in_context) if self.passed and self.speedup_in_context else 0.0
        return self


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()
