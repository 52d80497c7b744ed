"""What the core's results become in DuckDB: one typed row per table (the columns of storage/migrations/), built
from profiles, task indexes, verdicts, searches and LLM calls. Rows are TypedDicts, so repo.py writes them as they
are and a search away from the flow returns them as plain data. Storage imports nothing of the core: the core's
results (ProfileResult, Verdict, SearchResult, AcceptanceResult, LLMCall) are read by their fields."""
from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any, TypedDict


class RunRow(TypedDict):
    run_id: str
    workload_hash: str
    workload_name: str
    kind: str
    status: str
    started_at: str
    profile_of: str | None
    flow_run_id: str | None
    device: str | None
    gpu_name: str | None
    capability: str | None
    torch_version: str | None
    triton_version: str | None
    transformers_version: str | None
    timer: str
    prefill_ms: float | None
    decode_ms: float | None
    prefill_forwards: int
    decode_forwards: int
    artifact_dir: str


class ProfileRow(TypedDict):
    phase: str
    module_path: str
    class_name: str
    family: str
    depth: int
    calls: int
    time_ms: float
    share: float
    hotspot_score: float
    in_shapes: list[str]
    out_shapes: list[str]


class TaskRow(TypedDict):
    task_id: str
    family: str
    module_class: str
    phase: str
    instances: int
    shapes: list
    dtype: str
    artifact_path: str | None
    score: float
    time_ms: float
    deployable: bool
    reason: str


class CandidateRow(TypedDict):
    candidate_id: str
    task_id: str
    search_id: str
    episode: int
    iteration: int
    proposer: str
    template: str | None
    parent_id: str | None
    config_json: dict
    source_path: str
    passed: bool
    failure_class: str | None
    message: str
    max_abs_err: float | None
    max_rel_err: float | None
    cold_p20_ms: float | None
    cold_p50_ms: float | None
    cold_p80_ms: float | None
    ctx_p20_ms: float | None
    ctx_p50_ms: float | None
    ctx_p80_ms: float | None
    ref_cold_p50_ms: float | None
    ref_ctx_p50_ms: float | None
    speedup_cold: float | None
    speedup_in_context: float | None
    utility: float
    gates_json: list
    worker: str
    gpu_name: str | None
    origin: str  # migration 007
    speedup_compile: float | None
    kb_means_json: dict | None
    kb_degenerate: bool | None  # migration 017
    seconds_json: dict | None  # migration 018: the verification's seconds by phase


class EpisodeRow(TypedDict):
    search_id: str
    episode: int
    trials: int
    passed: int
    best_utility: float | None
    transcript_path: str | None


class SearchRow(TypedDict):
    """The `searches` columns a search fills when it starts."""

    search_id: str
    task_id: str
    run_id: str | None
    mode: str
    proposer: str
    budget: int


class SearchEnd(TypedDict):
    """The `searches` columns a search fills when it ends."""

    trials: int
    passed: int
    best_candidate_id: str | None
    best_utility: float | None


class FinishedSearchRow(SearchRow, SearchEnd):
    """A whole `searches` row, for a search recorded at once (one that ran away from the flow)."""

    started_at: datetime
    finished_at: datetime


class PatchRow(TypedDict):
    bundle_id: str
    run_id: str
    workload_hash: str
    bundle_path: str
    manifest_json: dict


class LLMCallRow(TypedDict):
    call_id: str
    search_id: str | None
    task_id: str | None
    model: str
    prompt_tokens: int | None
    completion_tokens: int | None
    cost_usd: float | None
    latency_ms: float | None
    status: str
    error: str | None
    attempt: int | None


PROFILE_COLUMNS = ("phase", "module_path", "class_name", "family", "depth", "calls", "time_ms", "share",
                   "hotspot_score", "in_shapes", "out_shapes")


def run_row(payload: dict, result, run_id: str, started: str, profile_of: str | None,
            artifact_dir: str, kind: str = "cli", flow_run_id: str | None = None) -> RunRow:
    """A run's `runs` row, written when its profile is: `result` a llm4llm.records.ProfileResult, `payload`
    profile.json's header (workload hash and name); `kind` what started the run (llm4llm.config.RunKind); the run
    is `running` until it ends (storage.repo.finish_run)."""
    hw, phases = result.hardware, result.phases
    return {
        "run_id": run_id,
        "workload_hash": payload["workload_hash"],
        "workload_name": payload["workload_name"],
        "kind": kind,
        "status": "running",
        "started_at": started,
        "profile_of": profile_of,
        "flow_run_id": flow_run_id,
        "device": hw.get("device"),
        "gpu_name": hw.get("gpu_name"),
        "capability": hw.get("capability"),
        "torch_version": hw.get("torch"),
        "triton_version": hw.get("triton"),
        "transformers_version": hw.get("transformers"),
        "timer": result.timer,
        "prefill_ms": phases["prefill"].time_ms if "prefill" in phases else None,
        "decode_ms": phases["decode"].time_ms if "decode" in phases else None,
        "prefill_forwards": phases["prefill"].forwards if "prefill" in phases else 0,
        "decode_forwards": phases["decode"].forwards if "decode" in phases else 0,
        "artifact_dir": artifact_dir,
    }


def profile_row(record) -> ProfileRow:
    """A `profiles` row from a llm4llm.records.ModuleRecord."""
    return {k: getattr(record, k) for k in PROFILE_COLUMNS}  # type: ignore[return-value]


def task_row(entry: dict) -> TaskRow:
    """A `tasks` row from one entry of a run's task index (tasks.json: a TaskSpec's fields and its artifact path)."""
    return {
        "task_id": entry["task_id"],
        "family": entry["family"],
        "module_class": entry["module_class"],
        "phase": entry["phase"],
        "instances": len(entry["instances"]),
        "shapes": [c for c in entry.get("cases", [])],
        "dtype": entry["dtype"],
        "artifact_path": entry.get("artifact_path"),
        "score": float(entry.get("hotspot_score", 0.0)),
        "time_ms": float(entry.get("time_ms", 0.0)),
        "deployable": bool(entry["deployable"]),
        "reason": entry.get("reason", ""),
    }


def candidate_row(candidate, verdict, task_id: str, search_id: str, episode: int, iteration: int,
                  source_path: str) -> CandidateRow:
    """A `candidates` row from a Candidate and its Verdict (pydantic, dataclass-like or dict)."""
    v = _fields(verdict)

    def lat(key, q):
        d = v.get(key) or {}
        return d.get(q)

    return {
        "candidate_id": candidate.id, "task_id": task_id, "search_id": search_id, "episode": episode,
        "iteration": iteration, "proposer": candidate.proposer, "template": candidate.template,
        "parent_id": candidate.parent, "config_json": candidate.config, "source_path": source_path,
        "passed": bool(v.get("passed")), "failure_class": v.get("failure_class"),
        "message": (v.get("message") or "")[:2000], "max_abs_err": v.get("max_abs_err"),
        "max_rel_err": v.get("max_rel_err"),
        "cold_p20_ms": lat("candidate_cold", "p20"), "cold_p50_ms": lat("candidate_cold", "p50"),
        "cold_p80_ms": lat("candidate_cold", "p80"),
        "ctx_p20_ms": lat("candidate_in_context", "p20"), "ctx_p50_ms": lat("candidate_in_context", "p50"),
        "ctx_p80_ms": lat("candidate_in_context", "p80"),
        "ref_cold_p50_ms": lat("reference_cold", "p50"), "ref_ctx_p50_ms": lat("reference_in_context", "p50"),
        "speedup_cold": v.get("speedup_cold"), "speedup_in_context": v.get("speedup_in_context"),
        "utility": float(v.get("utility") or 0.0), "gates_json": v.get("gates", []),
        "worker": str(v.get("worker_pid")), "gpu_name": v.get("device_name"),
        "origin": candidate_origin(candidate), "speedup_compile": v.get("speedup_compile"),
        "kb_means_json": v.get("kb_means_ms"), "kb_degenerate": v.get("kb_degenerate"),
        "seconds_json": v.get("seconds") or None,
    }


def _fields(verdict) -> dict[str, Any]:
    """A verdict's fields as JSON-able data (a Verdict's model_dump(mode="json"), as transcripts hold a Trial's)."""
    if isinstance(verdict, dict):
        return dict(verdict)
    if hasattr(verdict, "model_dump"):
        return verdict.model_dump(mode="json")
    return {k: v for k, v in vars(verdict).items() if not k.startswith("_")}


def candidate_origin(candidate) -> str:
    """template | rewrite | llm: a built-in template's rendering, one after exact graph rewrites, or an LLM's."""
    if (candidate.proposer or "").startswith("llm") or not candidate.template:
        return "llm"
    return "rewrite" if "rewrite" in candidate.template else "template"


def episode_rows(result, search_id: str) -> list[tuple[EpisodeRow, dict]]:
    """(episodes row, experience record) per episode of a SearchResult."""
    out = []
    for ep in result.episodes:
        passed = sum(1 for t in result.trials if t.episode == ep.index and t.feedback.passed)
        utils = [t.feedback.utility for t in result.trials if t.episode == ep.index]
        out.append(({"search_id": search_id, "episode": ep.index, "trials": len(ep.trials), "passed": passed,
                     "best_utility": max(utils) if utils else None, "transcript_path": ep.transcript},
                    json.loads(ep.experience.to_json())))
    return out


def search_row(search_id: str, task_id: str, run_id: str | None, mode: str, proposer: str,
               budget: int) -> SearchRow:
    return {"search_id": search_id, "task_id": task_id, "run_id": run_id, "mode": mode, "proposer": proposer,
            "budget": budget}


def finished_search_row(row: SearchRow, started_at: datetime, finished_at: datetime, result) -> FinishedSearchRow:
    return {**row, "started_at": started_at, "finished_at": finished_at,  # type: ignore[typeddict-item]
            **search_end(result)}


def search_end(result) -> SearchEnd:
    best = result.best
    return {"trials": result.trials_used, "passed": sum(t.feedback.passed for t in result.trials),
            "best_candidate_id": best.candidate.id if best else None,
            "best_utility": best.feedback.utility if best else None}


def e2e_row(run_id: str, workload_hash: str, measured) -> dict:
    """An `e2e_results` row: one variant's measurements (an llm4llm.stages.evaluate.E2ERow, serialized here: the
    columns are its fields) under the run and workload."""
    return {"run_id": run_id, "workload_hash": workload_hash, **measured.model_dump(mode="json")}


def rejection_episode_row(run_id: str, index: int) -> EpisodeRow:
    """The `episodes` row an acceptance rejection is recorded under (its experience goes with it): one trial of
    the run's pseudo-search `accept-<run id>`."""
    return {"search_id": f"accept-{run_id}", "episode": index, "trials": 1, "passed": 0, "best_utility": None,
            "transcript_path": None}


def patch_row(run_id: str, workload_hash: str, bundle_path: str, manifest: dict) -> PatchRow:
    return {"bundle_id": f"{run_id}-bundle", "run_id": run_id, "workload_hash": workload_hash,
            "bundle_path": bundle_path, "manifest_json": manifest}


def llm_call_row(call, search_id: str | None = None, task_id: str | None = None) -> LLMCallRow:
    """An `llm_calls` row from an LLMCall (its `db_row`, whose error text the core has redacted: nothing key-like
    reaches DuckDB) or a dict of the same fields."""
    if hasattr(call, "db_row"):
        row = call.db_row(search_id)
    else:
        d: dict[str, Any] = call if isinstance(call, dict) else vars(call)
        row = {"call_id": d.get("call_id") or uuid.uuid4().hex, "search_id": search_id or d.get("search_id"),
               "task_id": d.get("task_id"), "model": d.get("model", ""), "prompt_tokens": d.get("prompt_tokens"),
               "completion_tokens": d.get("completion_tokens"), "cost_usd": d.get("cost_usd", d.get("cost")),
               "latency_ms": d.get("latency_ms"), "status": d.get("status", ""), "error": d.get("error"),
               "attempt": d.get("attempt")}
    if task_id is not None:
        row["task_id"] = task_id
    return row


class TileMixFrontierRow(TypedDict):
    bench_id: str
    run_id: str | None
    workload_name: str | None
    seq_len: int
    batch: int
    variant: str
    template: str
    coverage: float | None
    realised_coverage: float | None
    heads_q: int | None
    heads_kv: int | None
    head_dim: int | None
    p20_ms: float
    p50_ms: float
    p80_ms: float
    samples: int
    tokens_per_s: float
    tflops: float
    vs_sdpa: float
    vs_0pct: float
    vs_100pct: float
    rel_err_fp32: float
    gpu_name: str | None
    versions_json: dict | None


def tilemix_frontier_rows(records, bench_id: str, *, run_id: str | None = None, workload_name: str | None = None,
                          gpu_name: str | None = None, versions: dict | None = None,
                          heads: tuple[int, int, int] | None = None) -> list[TileMixFrontierRow]:
    """The `kind: frontier` records of scripts/gpu/tilemix_bench.py (frontier.jsonl, parsed) as `tilemix_frontier`
    rows; `heads` = (query heads, KV heads, head_dim) of the shapes timed. Other kinds are skipped."""
    hq, hkv, d = heads or (None, None, None)
    out: list[TileMixFrontierRow] = []
    for r in records:
        if r.get("kind") != "frontier":
            continue
        cov = r.get("coverage")
        out.append({"bench_id": bench_id, "run_id": run_id, "workload_name": workload_name, "seq_len": int(r["S"]),
                    "batch": int(r["B"]), "variant": r["template"] if cov is None else f"{r['template']}@{cov}",
                    "template": r["template"], "coverage": cov, "realised_coverage": r.get("realised"),
                    "heads_q": hq, "heads_kv": hkv, "head_dim": d, "p20_ms": r["p20_ms"], "p50_ms": r["p50_ms"],
                    "p80_ms": r["p80_ms"], "samples": int(r["samples"]), "tokens_per_s": r["tokens_per_s"],
                    "tflops": r["tflops"], "vs_sdpa": r["vs_sdpa"], "vs_0pct": r["vs_0pct"],
                    "vs_100pct": r["vs_100pct"], "rel_err_fp32": r["rel_err_fp32"], "gpu_name": gpu_name,
                    "versions_json": versions})
    return out


class AcceptanceRow(TypedDict):
    acceptance_id: str
    run_id: str
    task_id: str
    candidate_id: str | None
    decision: str
    reason: str
    metric: str | None
    in_model_max_abs_err: float | None
    e2e_before_ms: float | None
    e2e_after_ms: float | None
    gain: float | None


def decision_rows(result, run_id: str) -> list[AcceptanceRow]:
    """One acceptances row per decision of a llm4llm.accept.AcceptanceResult, the decode-graphs gate first
    (task_id GRAPHS_TASK) where it ran."""
    head = [result.graph_decision] if result.graph_decision is not None else []
    return [decision_row(d, run_id) for d in head + result.decisions]


def decision_row(d, run_id: str) -> AcceptanceRow:
    """The acceptances row of one llm4llm.accept.Decision (its id: run, task, candidate: written again, it
    replaces itself)."""
    return {"acceptance_id": f"{run_id}:{d.task_id}:{d.candidate_id}", "run_id": run_id, "task_id": d.task_id,
            "candidate_id": d.candidate_id, "decision": d.decision, "reason": d.reason, "metric": d.metric,
            "in_model_max_abs_err": d.in_model_err, "e2e_before_ms": d.e2e_before_ms, "e2e_after_ms": d.e2e_after_ms,
            "gain": d.gain}
