"""Prefect flows: compose the tasks of tasks/ into the closed loop (profile -> extract -> search -> accept)."""
from __future__ import annotations

from prefect import flow

from flows.gpu import gpu_slot
from flows.profiling import _defaults, extract_tasks, profile_workload
from flows.search import search_flow
from llm4llm.config import OptimizeConfig
from tasks.acceptance import accept_patches, evaluate_e2e
from tasks.graphs import decode_graphs_plan, extract_on_static_cache, prefill_graphed
from tasks.profiling import describe_workload
from tasks.reporting import coverage_table, publish_markdown


def _publish(kind: str, workload_name: str, run_id: str, db_path: str | None) -> None:
    """A stage's markdown artifact; a failure to publish is reported, and the run goes on."""
    state = publish_markdown(kind, workload_name, run_id, db_path, return_state=True)
    if state.is_failed():
        print(f"artifact {kind}: not published ({state.message})")


def _coverage_artifact(run_id: str, db_path: str | None) -> None:
    """The run's template coverage (llm4llm.stages.search.coverage_table) as a Prefect table artifact."""
    from prefect.artifacts import create_table_artifact

    cov = coverage_table(run_id, db_path)
    rows = [r for r in cov["tasks"] if r["status"] != "not checked"]
    if rows:
        shares = ", ".join(f"{p} {100 * s:.1f}%" for p, s in cov["phases"].items()) or "none"
        create_table_artifact(key="coverage", table=rows,
                              description=f"Template coverage of run {run_id}; phase time under accepted patches: "
                                          f"{shares}")


@flow(name="optimize-workload", log_prints=True)
def optimize_workload(workload_path: str, config: OptimizeConfig | None = None, db_path: str | None = None,
                      data_dir: str | None = None, new_run: bool = False) -> dict:
    """The closed loop over one workload: profile -> extract -> search (fan-out) -> accept -> evaluate.

    `config` holds every setting (llm4llm.config.OptimizeConfig: search, accept, graphs, evaluate, llm); db_path and
    data_dir say where the run reads and writes. new_run: record this run under its own run id even when the
    profile is served from the cache (the nightly run: every night keeps its own rows).

    Decode graphs (config.graphs.decode_graphs: auto | on | off). On the GPU the model's one-token decode steps
    replay from CUDA graphs (kernels_runtime.graphs): decode candidates are timed by GPU time under graph replay
    (the verifier's decode_timing="graph"; "graph_prefill", prefill candidates too, where the prompt forward on a
    Mamba/Mamba2 cache replays from a graph as well: stages.graphs.prefill_graphed), acceptance's baseline and
    trials run with graphs, and the bundle ships with them. auto: on when every module's decode state sits in a static-address
    cache (Mamba, Mamba2), a KV cache that the run swaps for transformers' static cache (Llama, Qwen3,
    RecurrentGemma's attention) or on modules with a state adapter (RecurrentGemma's recurrent blocks), decided from
    the extracted tasks (stages.graphs.decode_graphs_plan); acceptance gates the graphs like a patch.
    config.evaluate.variants: None = eager, patched, torch_compile; with graphs eager, patched_graphs, eager_graphs,
    patched, torch_compile (rows are written as each is measured: the compiled baseline, slowest to build, last).
    config.search.rounds: search + acceptance rounds; a task rejected at deployment is searched again from its
    experience (the rejection included) in the next round. config.scale: where the searches run (local, the
    default, or fanned out over Ray, one GPU per task search; docs/scale-out.md). Each stage publishes its markdown
    artifact (`<workload>-hotspots`, `-leaderboard`, `-acceptance`, `-e2e`) as it ends."""
    cfg = config if config is not None else OptimizeConfig()
    data_dir = _defaults(data_dir)
    with gpu_slot(describe_workload(workload_path)["device"]):
        return _optimize(workload_path, cfg, db_path, data_dir, new_run)


def _optimize(workload_path: str, cfg: OptimizeConfig, db_path: str | None, data_dir: str, new_run: bool) -> dict:
    stages = set(cfg.stages)
    prof = profile_workload(workload_path, db_path=db_path, data_dir=data_dir, refresh=cfg.refresh, new_run=new_run)
    out = {"run_id": prof["run_id"], "profile_path": prof["profile_path"]}
    name = prof["workload"]["name"]
    _publish("hotspots", name, prof["run_id"], db_path)
    if "extract" not in stages:
        return out
    # where decode graphs may run, KV-cache decode tasks are captured on the static cache they generate with
    ext = extract_tasks(workload_path, prof["run_id"], prof["profile_path"], db_path=db_path, data_dir=data_dir,
                        min_score=cfg.search.min_score, refresh=cfg.refresh,
                        static_cache=extract_on_static_cache(prof["workload"]["device"], cfg.graphs.decode_graphs))
    out.update(index_path=ext["index_path"], tasks=ext["tasks"])
    if "search" not in stages:
        return out
    device = prof["workload"]["device"]
    graphs, static_cache, why = decode_graphs_plan(ext["index_path"], device, cfg.graphs.decode_graphs)
    print(f"decode graphs: {why}")
    out["decode_graphs"] = why
    # candidates are timed as the model will run them: decode (and, on Mamba/Mamba2, prefill) under graph replay
    decode_timing = ("graph_prefill" if prefill_graphed(ext["index_path"]) else "graph") if graphs else "launch"
    variants = cfg.evaluate.variants
    if variants is None:
        # what this run produced first (each row lands as it is measured), the compiled baseline last: its compile
        # is the slowest step, and a run stopped by a time limit then still has the patched numbers
        variants = (["eager", "patched_graphs", "eager_graphs", "patched", "torch_compile"] if graphs
                    else ["eager", "patched", "torch_compile"])
    search_tasks = search_flow(cfg.scale)
    out["searches"] = search_tasks(prof["run_id"], cfg.search, db_path=db_path, data_dir=data_dir, device=device,
                                   llm=cfg.llm, decode_timing=decode_timing, scale=cfg.scale)
    _publish("leaderboard", name, prof["run_id"], db_path)
    if "accept" not in stages:
        return out
    accept_cfg = cfg.accept.build(decode_graphs=graphs, static_cache=static_cache)
    out["acceptance"] = accept_patches(workload_path, prof["run_id"], accept_cfg, db_path, data_dir)
    for _ in range(1, cfg.search.rounds):
        retry = out["acceptance"].get("retry_tasks") or []
        if not retry:
            break
        out["searches"] += search_tasks(prof["run_id"], cfg.search.model_copy(update={"top": None}),
                                        db_path=db_path, data_dir=data_dir, device=device, task_ids=retry,
                                        llm=cfg.llm, decode_timing=decode_timing, scale=cfg.scale)
        out["acceptance"] = accept_patches(workload_path, prof["run_id"], accept_cfg, db_path, data_dir)
    _publish("acceptance", name, prof["run_id"], db_path)
    _coverage_artifact(prof["run_id"], db_path)
    if out["acceptance"].get("graphs"):
        out["decode_graphs"] = out["acceptance"]["graphs"]
    if "evaluate" in stages:
        out["e2e"] = evaluate_e2e(workload_path, db_path, out["acceptance"]["bundle"],
                                  cfg.evaluate.model_copy(update={"variants": list(variants)}), prof["run_id"] + "-e2e")
        _publish("e2e", name, prof["run_id"], db_path)
    return out
