"""The closed sets of outcomes that code decides on: the verifier's failure classes, an acceptance decision and the
gate that made it, why a search episode ended, and what the plan does with a task and why; and how the verifier
times a candidate (a setting the verifier branches on). Each is a StrEnum, so a
member is its string everywhere it is stored or shown (DuckDB rows, JSON transcripts, tests comparing to
"rejected"); the human-readable reason beside it is for display only, and nothing branches on that text.

Imported by the packages that produce and consume these values (llm4llm.verify, llm4llm.search, llm4llm.accept,
llm4llm.stages, llm4llm.planner); it imports nothing of the project itself."""
from __future__ import annotations

from enum import StrEnum


class FailureClass(StrEnum):
    """Why the verifier failed a candidate (Verdict.failure_class; the candidates table's failure_class)."""

    STATIC = "static"
    COMPILE = "compile"
    RUNTIME_ERROR = "runtime_error"
    TIMEOUT = "timeout"
    GPU_FAULT = "gpu_fault"
    OOM = "oom"
    WRONG_OUTPUT = "wrong_output"
    NAN_INF = "nan_inf"
    SHAPE_DTYPE = "shape_dtype"
    UNWRITTEN_OUTPUT = "unwritten_output"
    INPUT_MUTATED = "input_mutated"
    CACHED_OUTPUT = "cached_output"
    SIDE_STREAM = "side_stream"
    OUT_OF_BOUNDS = "out_of_bounds"
    NO_TRITON = "no_triton"
    WORKER_CRASH = "worker_crash"
    INTERRUPTED = "interrupted"  # the worker was stopped from outside (SIGTERM/SIGINT/SIGHUP): not the candidate
    PRECISION_CHANGED = "precision_changed"  # the candidate changed TF32 / reduced-precision settings (KernelBench)
    TORCH_COMPUTE = "torch_compute"  # torch ops, not the candidate's Triton kernels, did the work (does_the_work)
    IMPOSSIBLE_TIME = "impossible_time"  # a timed latency below the physical floor (bytes / HBM bandwidth)
    TIMED_OUTPUT_MISMATCH = "timed_output_mismatch"  # a sampled timed call's outputs differ from the reference
    OUTPUT_ALIASED = "output_aliased"  # an output shares storage with an input, a weight or an earlier output

    @classmethod
    def of(cls, value: str) -> FailureClass:
        """`value` as a member; a class the harness does not know (a worker's reply the candidate process could
        have written) is the worker's fault: WORKER_CRASH."""
        try:
            return cls(value)
        except ValueError:
            return cls.WORKER_CRASH


# failures a worker cannot recover from in its own process: its CUDA context or memory is gone
FATAL_TO_WORKER = frozenset({FailureClass.GPU_FAULT, FailureClass.OOM})


class AcceptTiming(StrEnum):
    """How an acceptance step judged latency (AcceptanceResult.timing, AcceptSummary.timing): on the GPU, or not
    at all on the CPU (where no timing may accept a patch)."""

    CUDA = "cuda"
    SKIPPED_CPU = "skipped: cpu"


class AcceptDecision(StrEnum):
    """An acceptance decision (Decision.decision; the acceptances table's decision)."""

    ACCEPTED = "accepted"
    REJECTED = "rejected"


class DecidedBy(StrEnum):
    """The step of an acceptance trial that decided it. Not stored: the reason says it in words; code reads this."""

    NOT_TRIED = "not_tried"  # rejected without a trial: task-level speedup at or below min_task_speedup
    LOSSY_NOT_ALLOWED = "lossy_not_allowed"  # a lossy candidate in a workload that has not opted in
    RUNTIME = "runtime"  # the patched model raised (applying it, running it, or while timing it)
    IN_MODEL = "in_model"  # teacher-forced logits (or a lossy trial's accuracy budget)
    SHAPE_COVERAGE = "shape_coverage"  # the trial's kernel never ran in-model
    TOKENS = "tokens"  # greedy tokens differ (check_tokens)
    LATENCY_SKIPPED = "latency_skipped"  # correct in-model on a CPU, where no timing may accept a patch
    LATENCY = "latency"  # the end-to-end gain against delta: accepted, or rejected as too small
    TIME_BUDGET = "time_budget"  # not tried (or a regime's check not run): the run's time budget had ended


# rejections that say nothing about the candidate, so its task is not searched again for them
NOT_RETRIED = frozenset({DecidedBy.LATENCY_SKIPPED, DecidedBy.TIME_BUDGET})


class EpisodeEnd(StrEnum):
    """Why a search episode ended (EpisodeRecord.ended; its `ended_by` adds the detail for display)."""

    LENGTH = "length"  # it ran its length
    STUCK = "stuck"  # its last trials repeated one failure signature
    EXHAUSTED = "exhausted"  # the proposer had nothing new
    STOPPED = "stopped"  # the search's stop rule (the planner's time share, the floor) ended it


# endings after which no further episode starts
FINAL_ENDS = frozenset({EpisodeEnd.EXHAUSTED, EpisodeEnd.STOPPED})


class PlanAction(StrEnum):
    """What the run's plan does with a task (PlanItem.action; the plans table's action)."""

    SEARCHED = "searched"  # searched earlier in this run (it still stands for the modules inside it)
    SEARCH = "search"
    FALLBACK = "fallback"  # searched only if the task it sits inside fails
    SKIP = "skip"


class PlanWhy(StrEnum):
    """Why the plan gave a task its action (PlanItem.why; PlanItem.reason says it in words). Not stored."""

    NOT_DEPLOYABLE = "not_deployable"
    FAMILY_NOT_ASKED = "family_not_asked"
    PHASE_NOT_ASKED = "phase_not_asked"
    NOTHING_ACCEPTED = "nothing_accepted"  # searched whole, nothing accepted: its children count in full
    SEARCHED = "searched"
    NOT_COVERED = "not_covered"  # no built-in template computes what it does
    IN_TOP = "in_top"
    BEYOND_TOP = "beyond_top"
    INSIDE_TARGET = "inside_target"
    FAMILY_LOSES = "family_loses"
    BELOW_DELTA = "below_delta"
    EXPECTED_SAVING = "expected_saving"


class DecodeTiming(StrEnum):
    """How the verifier times candidates (SearchSettings.decode_timing; VerifierPool's decode_timing option, carried
    to the worker as its string; llm4llm/verify/timing.py does the timing)."""

    LAUNCH = "launch"  # calls back to back, as eager decoding runs them
    GRAPH = "graph"  # decode tasks by GPU time under CUDA-graph replay, as decoding runs under kernels_runtime.graphs
    GRAPH_PREFILL = "graph_prefill"  # prefill tasks that way too, where the prompt forward replays from graphs
