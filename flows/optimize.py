"""Prefect flows: compose the tasks of tasks/ into the closed loop (profile -> extract -> plan -> search -> accept ->
evaluate) inside one time budget."""
from __future__ import annotations

import time
from contextlib import contextmanager

from prefect import flow

from flows.gpu import gpu_slot
from flows.progress import run_log
from flows.profiling import _defaults, extract_tasks, profile_workload, run_kind
from flows.search import search_flow
from llm4llm import planner, progress
from llm4llm.accept import GraphPlan
from llm4llm.config import OptimizeConfig, RunKind
from llm4llm.coverage import coverage_of_run
from llm4llm.evaluate import eval_batches
from llm4llm.graph_plan import decode_graphs_plan, extract_on_static_cache, prefill_graphed
from llm4llm.outcome import OptimizeResult, summary_lines
from llm4llm.outcomes import DecodeTiming
from tasks.acceptance import AcceptSummary, EvaluateResult, accept_patches, evaluate_e2e
from tasks.planning import plan_search, record_plan, record_stage_times
from storage.store import Store
from tasks.profiling import describe
from tasks.reporting import publish_markdown
from tasks.search import SearchSummary, close_pools, search_task


def _publish(kind: str, workload_name: str, run_id: str, db_path: str | None) -> None:
    """A stage's markdown artifact; a failure to publish is reported, and the run goes on."""
    state = publish_markdown(kind, workload_name, run_id, db_path, return_state=True)
    if state.is_failed():
        print(f"artifact {kind}: not published ({state.message})")


def _coverage_artifact(run_id: str, db_path: str | None) -> None:
    """The run's template coverage (llm4llm.coverage) as a Prefect table artifact."""
    from prefect.artifacts import create_table_artifact
    from storage.store import Store

    cov = coverage_of_run(run_id, Store(db_path))
    rows = [r for r in cov["tasks"] if r["status"] != "not checked"]
    if rows:
        shares = ", ".join(f"{p} {100 * s:.1f}%" for p, s in cov["phases"].items()) or "none"
        create_table_artifact(key="coverage", table=rows,
                              description=f"Template coverage of run {run_id}; phase time under accepted patches: "
                                          f"{shares}")


@flow(name="optimize-workload", log_prints=True)
def optimize_workload(workload_path: str, config: OptimizeConfig = OptimizeConfig(), db_path: str | None = None,
                      data_dir: str | None = None, kind: RunKind | None = None) -> OptimizeResult:
    """The closed loop over one workload: profile -> extract -> plan -> search -> accept -> evaluate, inside
    `config.time_budget_s` counted from now (or from when the CLI command started: llm4llm.planner.RUN_STARTED).

    The plan (llm4llm.planner) ranks the extracted tasks by expected end-to-end saving, leaves out what cannot
    save delta and the modules inside one that is searched whole, and splits the search's share of the budget over
    its targets. The most valuable target is searched and accepted first, so a run stopped by its budget (or
    Ctrl-C) already has an accepted bundle; the other targets follow, and are accepted on top of it; a target that
    is searched whole and fails hands its place to the modules inside it. Every stage's span is a `stage_times`
    row, the plan `plans` rows, and the run ends with what it gave (llm4llm.outcome.summary_lines). Returns an
    OptimizeResult (llm4llm.outcome): each stage's typed result as the stage returned it.

    `config` holds every setting (llm4llm.config.OptimizeConfig: search, accept, graphs, evaluate, llm); db_path and
    data_dir say where the run reads and writes. Every flow run is a run of its own (its own run id and rows, also
    when the profile is served from the cache: `runs.profile_of` names the run that measured it); kind: what
    started it (nightly | manual | on-change | cli; default: the deployment that started this flow run, else cli).
    The run's `runs.status` is `running` until it ends ok, failed or stopped.

    Decode graphs (config.graphs.decode_graphs: auto | on | off). On the GPU the model's one-token decode steps
    replay from CUDA graphs (kernels_runtime.graphs): decode candidates are timed by GPU time under graph replay
    (the verifier's decode_timing="graph"; "graph_prefill", prefill candidates too, where the prompt forward on a
    Mamba/Mamba2 cache replays from a graph as well), acceptance's baseline and trials run with graphs, and the
    bundle ships with them (llm4llm.graph_plan.decode_graphs_plan says when auto turns them on). config.evaluate.variants:
    None = eager, patched, torch_compile; with graphs eager, patched_graphs, eager_graphs, torch_compile (rows are
    written as each is measured: the compiled baseline, slowest to build, last). config.search.rounds: a task
    rejected at deployment is searched again from its experience in the next round. config.scale: where the
    searches run (local, or fanned out over Ray, one GPU per task search; docs/scale-out.md).

    Args:
        workload_path: the workload's TOML file (examples/workloads/*.toml), as the worker's host sees it
        config: every setting of the run (the default is what `llm4llm optimize` runs without options)
        db_path: DuckDB file the run writes (empty: $LLM4LLM_DB, else $LLM4LLM_HOME/llm4llm.duckdb)
        data_dir: where profiles, tasks, candidates and bundles go (empty: $LLM4LLM_HOME, else ./.llm4llm)
        kind: what started the run: nightly, manual, on-change or cli (empty: from the deployment that started it)
    """
    from kernels_runtime.interp import interpret_without_gpu

    interpret_without_gpu()  # a served run (a worker's flow-run process) has no CLI to set Triton's interpreter
    cfg = config if config is not None else OptimizeConfig()  # None: a caller that passes no settings
    data_dir = _defaults(data_dir)
    run = _Run(workload_path, cfg, db_path, data_dir, planner.RUN_STARTED.get() or time.time())
    with gpu_slot(describe(workload_path)["device"]), run_log():
        progress.use_clock(run.clock)
        error = None
        try:
            return _optimize(run, run_kind(kind))
        except BaseException as e:
            error = e
            raise
        finally:
            progress.use_clock(None)
            run.record_times()
            if run.run_id is not None:
                Store(run.db_path).finish_run(run.run_id, error)


class _Run:
    """One optimize run's settings, where it reads and writes, its clock and what it has learnt so far."""

    def __init__(self, workload_path: str, cfg: OptimizeConfig, db_path: str | None, data_dir: str,
                 started_wall: float):
        self.workload_path, self.cfg, self.db_path, self.data_dir = workload_path, cfg, db_path, data_dir
        self.clock = planner.Clock(cfg.time_budget_s, started=time.monotonic() - (time.time() - started_wall))
        self.started_wall = started_wall
        self.run_id, self.name, self.device = None, "", "cpu"
        self.graph_plan = GraphPlan()  # the run's CUDA-graph plan, which acceptance gates (set after extraction)
        self.index_path = self.profile_path = None
        self.workload: dict = {}

    def say(self, text: str) -> None:
        """A line of progress: on the CLI's terminal (with the clock) and in the run's Prefect log (flows.progress)."""
        progress.note(text)

    @contextmanager
    def stage(self, name: str, note: str = ""):
        span = self.clock.start(name, note)
        self.say(f"{name}{' ' + note if note else ''}: started")
        try:
            yield span
        finally:
            took = self.clock.end(span)
            self.say(f"{name}{' ' + note if note else ''}: done in {planner.fmt_s(took)}")

    def record_times(self) -> None:
        if self.run_id is not None:
            record_stage_times(self.run_id, self.name, self.device, self.clock.spans, self.db_path)

    def later_s(self, plan: planner.Plan) -> float:
        """Seconds the stages after the search still need (acceptance of one more step, evaluation)."""
        stages = set(self.cfg.stages)
        return ((plan.estimates.accept_s if "accept" in stages else 0.0)
                + (plan.estimates.evaluate_s if "evaluate" in stages else 0.0))

    def accept_deadline(self, plan: planner.Plan) -> float | None:
        """Unix time by which acceptance ends what it can shorten (rounds, later trials): the budget's end less
        evaluation's estimate without its interleaved rounds, and the safety share (None: no budget). Acceptance's
        decisions are the bundle a user ships; evaluation only measures it and runs one round at least."""
        return self.clock.deadline_wall(reserve_s=self._evaluation_fixed_s(plan)
                                        + (self.cfg.time_budget_s or 0.0) * planner.SAFETY)

    def bundle_deadline(self, plan: planner.Plan) -> float | None:
        """Unix time by which a regime's check at its largest batch ends: the budget's end, with nothing kept back
        for evaluation. The check (about 20 s for a 4-7B model at batch 32) decides whether the bundle serves the
        regime's larger batches at all: skipped, a batch past the workload's own falls back to the model's layers
        (llama-2-7b-serving's README run shipped buckets 1-8 for a regime of 1-32, and its batch 32 ran at 0.90x
        torch.compile). Evaluation only measures the bundle; it then runs its one round past the budget."""
        return self.clock.deadline_wall(reserve_s=0.0)

    def _evaluation_fixed_s(self, plan: planner.Plan) -> float:
        est = plan.estimates
        return est.evaluate_s - est.evaluate_rounds_s if "evaluate" in set(self.cfg.stages) else 0.0

    def search_left(self, plan: planner.Plan) -> float | None:
        """Seconds left for searching (None: no budget)."""
        rem = self.clock.remaining()
        return None if rem is None else rem - self.later_s(plan) - (self.cfg.time_budget_s or 0.0) * planner.SAFETY


def _min_share(cfg: OptimizeConfig) -> float:
    """The share below which extraction does not capture a module class: the acceptance's delta, where the plan
    applies it (it skips such a task), else 0 (no acceptance, or `--top N`, which searches the N hottest whatever
    their share)."""
    return cfg.accept.delta if "accept" in set(cfg.stages) and cfg.search.top is None else 0.0


def _optimize(run: _Run, kind: str) -> OptimizeResult:
    cfg, stages = run.cfg, set(run.cfg.stages)
    with run.stage("profile"):
        prof = profile_workload(run.workload_path, db_path=run.db_path, data_dir=run.data_dir, refresh=cfg.refresh,
                                kind=kind)
    run.run_id, run.workload, run.profile_path = prof.run_id, prof.workload, prof.profile_path
    run.name, run.device = prof.workload["name"], prof.workload["device"]
    out = OptimizeResult(run_id=run.run_id, profile_path=run.profile_path)
    _publish("hotspots", run.name, run.run_id, run.db_path)
    if "extract" not in stages:
        return out
    # where decode graphs may run, KV-cache decode tasks are captured on the static cache they generate with
    with run.stage("extract"):
        ext = extract_tasks(run.workload_path, run.run_id, run.profile_path, db_path=run.db_path,
                            data_dir=run.data_dir, min_score=cfg.search.min_score, refresh=cfg.refresh,
                            static_cache=extract_on_static_cache(run.device, cfg.graphs.decode_graphs),
                            min_share=_min_share(cfg))
    run.index_path = ext.index_path
    out = out.model_copy(update={"index_path": ext.index_path, "tasks": ext.tasks})
    if "search" not in stages:
        return out
    graphs, static_cache, why = decode_graphs_plan(run.index_path, run.device, cfg.graphs.decode_graphs)
    run.say(f"decode graphs: {why}")
    # candidates are timed as the model will run them: decode (and, on Mamba/Mamba2, prefill) under graph replay
    timing = (DecodeTiming.GRAPH_PREFILL if prefill_graphed(run.index_path) else DecodeTiming.GRAPH) if graphs \
        else DecodeTiming.LAUNCH
    run.cfg = cfg.model_copy(update={"search": cfg.search.model_copy(update={"decode_timing": timing})})
    run.graph_plan = GraphPlan(decode_graphs=graphs, static_cache=static_cache)
    out = _search_and_accept(run, out.model_copy(update={"decode_graphs": why}))
    if "accept" in stages:
        _publish("acceptance", run.name, run.run_id, run.db_path)
        _coverage_artifact(run.run_id, run.db_path)
        if out.acceptance is not None and out.acceptance.graphs:  # none where the plan found nothing to search
            out = out.model_copy(update={"decode_graphs": out.acceptance.graphs})
    e2e = None
    if "evaluate" in stages and out.acceptances:
        e2e = _evaluate(run, out.bundle, graphs)
        _publish("e2e", run.name, run.run_id, run.db_path)
    lines = summary_lines(e2e.rows if e2e is not None else None, out.bundle, list(out.accepted_tasks),
                          run.clock.seconds(), run.clock.elapsed(), cfg.time_budget_s, run.device)
    return out.model_copy(update={"e2e": e2e, "summary": tuple(lines)})


def _plan(run: _Run, searched: list[str] = (), excluded: list[str] = ()) -> planner.Plan:
    with run.stage("plan"):
        plan = plan_search(run.index_path, run.profile_path, run.run_id, run.workload, run.cfg, run.db_path,
                           run.started_wall, searched=list(searched), excluded=list(excluded))
    record_plan(run.run_id, plan, run.db_path)
    for line in plan.lines(run.clock.elapsed(), targets_only=bool(searched)):
        run.say(line)
    return plan


def _search_and_accept(run: _Run, out: OptimizeResult) -> OptimizeResult:
    """Search the plan's targets and accept them: the most valuable first and alone (the first bundle early), then
    the rest on top of it; after each step the plan is made again with what is left (children of a module that
    failed whole become targets). Returns `out` with the first plan's items, every search's SearchSummary and every
    acceptance step's AcceptSummary, each as its stage returned it (the last step's bundle holds every step's
    patches)."""
    stages = set(run.cfg.stages)
    plan = _plan(run)
    out = out.model_copy(update={"plan": tuple(dict(i.__dict__) for i in plan.items)})
    searched: list[str] = []
    failed: list[str] = []
    first = True
    while plan.targets():
        wave = plan.targets()[:1] if first and "accept" in stages else plan.targets()
        results = tuple(_search_wave(run, plan, wave))
        out = out.model_copy(update={"searches": out.searches + results})
        searched += [w.task_id for w in wave]
        failed += [r.task_id for r in results if not r.best_candidate]
        if "accept" in stages:
            acc = _accept(run, [w.task_id for w in wave], out.bundle, plan)
            out = out.model_copy(update={"acceptances": out.acceptances + (acc,)})
            failed += acc.retry_tasks
        first = False
        left = run.search_left(plan)
        if left is not None and left < plan.estimates.trial_s * planner.MIN_TRIALS:
            run.say(f"plan: {max(left, 0):.0f} s left for searching; on to evaluation")
            break
        plan = _plan(run, searched, failed)
    out = _retry_rounds(run, plan, out)
    _publish("leaderboard", run.name, run.run_id, run.db_path)
    return out


def _search_wave(run: _Run, plan: planner.Plan, wave: list[planner.PlanItem]) -> list[SearchSummary]:
    """Search the wave's tasks one after another (one GPU), each until its share of the search time is spent."""
    cfg = run.cfg
    if cfg.scale.task_runner == "ray":  # fanned out: one search per Ray task, each its planned trials
        settings = cfg.search.model_copy(update={"top": None, "budget": cfg.search.budget or
                                                 max(w.trials for w in wave)})
        return search_flow(cfg.scale)(run.run_id, settings, db_path=run.db_path, data_dir=run.data_dir,
                                      device=run.device, task_ids=[w.task_id for w in wave], llm=cfg.llm,
                                      scale=cfg.scale)
    results = []
    try:
        for k, item in enumerate(wave):
            left = run.search_left(plan)
            share = item.saving / (sum(w.saving for w in wave[k:]) or 1.0)
            deadline = None if left is None else time.time() + max(0.0, left) * share
            with run.stage("search", item.task_id) as span:
                r = search_task(item.artifact_path, cfg.search, run.db_path, run.data_dir, run.device, run.run_id,
                                cfg.llm, trials=item.trials, deadline=deadline)
                span["trials"] = r.trials
            best = f"best {r.best_utility:.2f}x" if r.best_utility else "no speedup measured"
            run.say(f"search {item.task_id}: {r.trials} trials, {r.pass_rate:.0%} passed, {best}, "
                    f"ended by {r.ended_text}")
            results.append(r)
    finally:
        close_pools()
    return results


def _accept(run: _Run, task_ids: list[str], base_bundle: str | None, plan: planner.Plan) -> AcceptSummary:
    """One acceptance step of `task_ids` on top of `base_bundle`, inside the plan's deadlines (accept_deadline,
    bundle_deadline); its AcceptSummary as the stage returned it."""
    with run.stage("accept", ", ".join(task_ids)):
        acc = accept_patches(run.workload_path, run.run_id, run.cfg.accept, run.db_path, run.data_dir,
                             task_ids=task_ids, base_bundle=base_bundle, graphs=run.graph_plan,
                             deadline=run.accept_deadline(plan), bundle_deadline=run.bundle_deadline(plan))
    run.say(f"accept: {acc.accepted} accepted, {acc.rejected} rejected; bundle {acc.bundle or base_bundle}")
    return acc


def _retry_rounds(run: _Run, plan: planner.Plan, out: OptimizeResult) -> OptimizeResult:
    """config.search.rounds > 1: tasks rejected in the model are searched again from their experience (the
    rejection included) and accepted on top of the bundle, while the budget lasts."""
    items = {i.task_id: i for i in plan.items}
    for _ in range(1, run.cfg.search.rounds):
        retry = [items[t] for t in (out.acceptance.retry_tasks if out.acceptance else ()) if t in items]
        left = run.search_left(plan)
        if not retry or (left is not None and left < plan.estimates.trial_s):
            break
        for item in retry:
            item.trials = run.cfg.search.budget or planner.MIN_TRIALS
        searches = out.searches + tuple(_search_wave(run, plan, retry))
        acc = _accept(run, [i.task_id for i in retry], out.bundle, plan)
        out = out.model_copy(update={"searches": searches, "acceptances": out.acceptances + (acc,)})
    return out


def _evaluate(run: _Run, bundle: str | None, graphs: bool) -> EvaluateResult:
    """End to end, inside what is left of the budget (the interleaved rounds end by its deadline)."""
    variants = run.cfg.evaluate.variants
    if variants is None:
        # what this run produced first (each row lands as it is measured), the compiled baseline last: its compile
        # is the slowest step, and a run stopped by a time limit then still has the patched numbers
        variants = (["eager", "patched_graphs", "eager_graphs", "torch_compile"] if graphs
                    else ["eager", "patched", "torch_compile"])
    settings = run.cfg.evaluate.model_copy(update={"variants": list(variants),
                                                   "batch_sizes": eval_batches(run.workload_path, run.cfg.evaluate)})
    with run.stage("evaluate"):
        return evaluate_e2e(run.workload_path, run.db_path, bundle, settings, run.run_id + "-e2e",
                            deadline=run.clock.deadline_wall(reserve_s=10.0))
