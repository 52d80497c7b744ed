from __future__ import annotations

from prefect import flow

from flows.profile import _defaults, extract_tasks, profile_workload
from flows.search import search_tasks
from llm4llm import pipeline
from tasks.acceptance import accept_patches, evaluate_e2e

STAGES = ("profile", "extract", "search", "accept", "evaluate")


@flow(name="optimize-workload", log_prints=True)
def optimize_workload(workload_path: str, db_path: str | None = None, data_dir: str | None = None,
                      min_score: float = 0.0, refresh: bool = False, stages: tuple[str, ...] = STAGES,
                      mode: str = "episodic", budget: int = 15, proposer: str = "library", top: int | None = 6,
                      families: list[str] | None = None, delta: float = 0.02, repeats: int = 5,
                      timeout_s: float = 120.0, llm: dict | None = None, accept_metric: str = "auto",
                      accept_tol_factor: float = 3.0, accept_floor_factor: float = 2.0,
                      accept_min_task_speedup: float = 1.0, accept_noisy_rounds: int = 2,
                      decode_graphs: str | bool = "auto",
                      e2e_variants: tuple[str, ...] | None = None, rounds: int = 1) -> dict:
    """The closed loop over one workload: profile -> extract -> search (fan-out) -> accept -> evaluate.

    accept_metric: auto (logits_rel_l2_floor for 16-bit models, logits_rel_l2 for fp32) | logits_rel_l2_floor |
    logits_rel_l2 | logits_max_abs; accept_tol_factor: fixed rel-L2 limit = factor x TOLERANCES[dtype].rtol;
    accept_floor_factor: per-step limit = max(fixed, factor x the model's own bf16-vs-fp32 noise floor).
    accept_min_task_speedup: on the GPU, candidates no faster than this in their task are not tried in-model.
    accept_noisy_rounds: more alternating (trial, baseline) pairs when the baseline drifts by more than delta.
    decode_graphs: auto | on | off (or a bool). On the GPU the model's one-token decode steps replay from CUDA graphs
    (kernels_runtime.graphs): decode candidates are timed by GPU time under graph replay (the verifier's
    decode_timing="graph"; "graph_prefill", prefill candidates too, where the prompt forward on a Mamba/Mamba2 cache
    replays from a graph as well: pipeline.prefill_graphed), acceptance's baseline and trials run with graphs, and
    the bundle ships with them. auto: on when every module's decode state sits in a static-address cache (Mamba,
    Mamba2), a KV cache that the run swaps for transformers' static cache (Llama, Qwen3, RecurrentGemma's attention)
    or on modules with a state adapter (RecurrentGemma's recurrent blocks), decided from the extracted tasks
    (pipeline.decode_graphs_plan); acceptance gates the graphs like a patch (teacher-forced logits, then delta), and
    the runtime validates each capture.
    e2e_variants: None = eager, patched, torch_compile; with graphs eager, patched_graphs, eager_graphs, patched,
    torch_compile (rows are written as each is measured: the compiled baseline, slowest to build, last).
    rounds: search + acceptance rounds; a task rejected at deployment is searched again from its experience (the
    rejection included) in the next round."""
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"stages: expected a subset of {STAGES}, got {sorted(unknown)}")
    data_dir = _defaults(data_dir)
    prof = profile_workload(workload_path, db_path=db_path, data_dir=data_dir, refresh=refresh)
    out = {"run_id": prof["run_id"], "profile_path": prof["profile_path"]}
    if "extract" not in stages:
        return out
    # where decode graphs may run, KV-cache decode tasks are captured on the static cache they generate with
    ext = extract_tasks(workload_path, prof["run_id"], prof["profile_path"], db_path=db_path, data_dir=data_dir,
                        min_score=min_score, refresh=refresh,
                        static_cache=pipeline.extract_on_static_cache(prof["workload"]["device"], decode_graphs))
    out.update(index_path=ext["index_path"], tasks=ext["tasks"])
    if "search" not in stages:
        return out
    device = prof["workload"]["device"]
    graphs, static_cache, why = pipeline.decode_graphs_plan(ext["index_path"], device, decode_graphs)
    print(f"decode graphs: {why}")
    out["decode_graphs"] = why
    # candidates are timed as the model will run them: decode (and, on Mamba/Mamba2, prefill) under graph replay
    decode_timing = ("graph_prefill" if pipeline.prefill_graphed(ext["index_path"]) else "graph") if graphs \
        else "launch"
    if e2e_variants is None:
        # what this run produced first (each row lands as it is measured), the compiled baseline last: its compile
        # is the slowest step, and a run stopped by a time limit then still has the patched numbers
        e2e_variants = (("eager", "patched_graphs", "eager_graphs", "patched", "torch_compile") if graphs
                        else ("eager", "patched", "torch_compile"))
    out["searches"] = search_tasks(prof["run_id"], db_path=db_path, data_dir=data_dir, mode=mode, budget=budget,
                                   proposer=proposer, device=device, timeout_s=timeout_s, top=top,
                                   families=families, llm=llm, decode_timing=decode_timing)
    if "accept" not in stages:
        return out
    out["acceptance"] = accept_patches(workload_path, prof["run_id"], db_path, data_dir, delta, accept_metric,
                                       repeats, accept_tol_factor, accept_floor_factor, accept_min_task_speedup,
                                       graphs, static_cache, accept_noisy_rounds)
    for _ in range(1, rounds):
        retry = out["acceptance"].get("retry_tasks") or []
        if not retry:
            break
        out["searches"] += search_tasks(prof["run_id"], db_path=db_path, data_dir=data_dir, mode=mode, budget=budget,
                                        proposer=proposer, device=device, timeout_s=timeout_s, task_ids=retry,
                                        llm=llm, decode_timing=decode_timing)
        out["acceptance"] = accept_patches(workload_path, prof["run_id"], db_path, data_dir, delta, accept_metric,
                                           repeats, accept_tol_factor, accept_floor_factor,
                                           accept_min_task_speedup, graphs, static_cache, accept_noisy_rounds)
    if out["acceptance"].get("graphs"):
        out["decode_graphs"] = out["acceptance"]["graphs"]
    if "evaluate" in stages:
        out["e2e"] = evaluate_e2e(workload_path, db_path, out["acceptance"]["bundle"], 3,
                                  tuple(e2e_variants), prof["run_id"] + "-e2e")
    return out
