"""The SQL behind `llm4llm report` and the per-run Prefect markdown artifacts. Each function returns a DataFrame
(one query, no logic beyond SQL); llm4llm.report turns them into tables and plots, reading them through a
ReportReader."""
from __future__ import annotations

from storage import repo
from storage.db import Database
from storage.repo import POOLED_CANDIDATES


def resolve_run(db: Database, run: str | None = None, workload: str | None = None) -> str | None:
    """`run` when it exists (a `runs` row, or a KernelBench run's `kb_run_id`); else the latest run of `workload`
    that got past profiling (searches, acceptances or end-to-end rows), else its latest run; else the latest run
    with any of those."""
    if run:
        rows = db.query("SELECT run_id FROM runs WHERE run_id = ? UNION ALL "
                        "SELECT DISTINCT kb_run_id FROM kernelbench_results WHERE kb_run_id = ?", [run, run])
        return rows[0][0] if rows else None
    rows = db.query(
        "SELECT r.run_id FROM runs r WHERE (? IS NULL OR r.workload_name = ?) ORDER BY "
        "(EXISTS (SELECT 1 FROM searches s WHERE s.run_id = r.run_id) OR "
        " EXISTS (SELECT 1 FROM acceptances a WHERE a.run_id = r.run_id) OR "
        " EXISTS (SELECT 1 FROM e2e_results e WHERE e.run_id IN (r.run_id, r.run_id || '-e2e'))) DESC, "
        "r.started_at DESC LIMIT 1",
        [workload, workload],
    )
    return rows[0][0] if rows else None


def run_overview(db: Database, run_id: str):
    """One row: the run, its workload's path and config."""
    return db.query_df(
        "SELECT r.*, w.path AS workload_path, w.config_json FROM runs r LEFT JOIN workloads w USING (workload_hash) "
        "WHERE r.run_id = ?",
        [run_id],
    )


def hotspots(db: Database, run_id: str, top: int = 12):
    """Per phase, the `top` modules by share of the phase's time (the model and its backbone left out: their share
    is the whole phase);
    `weight` is the phase's weight in the workload (hotspot_score = share x weight)."""
    return db.query_df(
        "SELECT phase, row_number() OVER (PARTITION BY phase ORDER BY share DESC, module_path) AS rank, module_path, "
        "class_name, family, depth, calls, time_ms, share, hotspot_score, "
        "CASE WHEN share > 0 THEN hotspot_score / share END AS weight "
        "FROM profiles WHERE run_id = ? AND depth > 0 AND family <> 'model' QUALIFY rank <= ? ORDER BY phase DESC, rank",
        [run_id, top],
    )


def trials(db: Database, run_id: str):
    """Every verified candidate of the run's searches in trial order, with its task's family and phase and
    `pooled`: its speedup against its search's pooled reference (as the search ranks it; NULL without timings)."""
    return db.query_df(
        f"WITH {POOLED_CANDIDATES} "
        "SELECT p.search_id, p.task_id, t.family, t.phase, s.mode, s.proposer, p.episode, p.iteration, "
        "p.candidate_id, p.template, p.passed, p.failure_class, p.utility, p.speedup_in_context, p.ctx_p50_ms, "
        "p.ref_ctx_p50_ms, CASE WHEN p.passed AND p.ctx_p50_ms > 0 AND p.ref_pool > 0 THEN p.ref_pool / p.ctx_p50_ms "
        "END AS pooled, p.max_abs_err, p.created_at "
        "FROM p JOIN searches s USING (search_id) LEFT JOIN tasks t ON t.task_id = p.task_id AND t.run_id = p.run_id "
        "ORDER BY s.started_at, p.search_id, p.iteration",
        [run_id],
    )


def searches(db: Database, run_id: str):
    return db.query_df(
        "SELECT s.search_id, s.task_id, t.family, t.phase, s.mode, s.proposer, s.budget, s.trials, s.passed, "
        "s.best_candidate_id, s.best_utility, s.started_at, s.finished_at FROM searches s "
        "LEFT JOIN tasks t ON t.task_id = s.task_id AND t.run_id = s.run_id WHERE s.run_id = ? ORDER BY s.started_at",
        [run_id],
    )


def acceptances(db: Database, run_id: str):
    """The run's acceptance decisions in the order they were made (the decode-graphs gate has no task row)."""
    return db.query_df(
        "SELECT a.task_id, t.family, t.phase, a.candidate_id, a.decision, a.gain, a.e2e_before_ms, a.e2e_after_ms, "
        "a.in_model_max_abs_err, a.metric, a.reason, a.created_at FROM acceptances a "
        "LEFT JOIN tasks t ON t.task_id = a.task_id AND t.run_id = a.run_id WHERE a.run_id = ? "
        "ORDER BY a.created_at, a.acceptance_id",
        [run_id],
    )


def e2e(db: Database, run_id: str):
    """The run's end-to-end rows (the optimize flow writes them under `<run>-e2e`), in the order measured, each at
    its (batch_size, prompt_len) point."""
    return db.query_df(
        "SELECT run_id, variant, batch_size, prompt_len, prefill_ms, decode_ms_per_token, decode_ms_p20, "
        "decode_ms_p80, decode_tokens_per_s, total_ms, total_samples_ms, tokens_per_s, gpu_step_ms, hbm_floor_ms, "
        "peak_mem_mb, compile_s, repeats, gpu_name, notes, created_at FROM e2e_results "
        "WHERE run_id IN (?, ? || '-e2e') ORDER BY created_at",
        [run_id, run_id],
    )


def e2e_history(db: Database, workload_name: str):
    """Every end-to-end row of every version of a workload (by name: an edited config is the same workload) at that
    version's own (batch_size, prompt_len) point (a run measured at other points too keeps those out of the history:
    runs are compared like with like), oldest first, with the acceptance counts of the run it evaluated;
    `run_started`: that run's start (else the row's)."""
    return db.query_df(
        "WITH acc AS (SELECT run_id, count(*) FILTER (WHERE decision = 'accepted') AS accepted, "
        "count(*) FILTER (WHERE decision = 'rejected') AS rejected FROM acceptances GROUP BY run_id) "
        "SELECT e.run_id, e.variant, e.total_ms, e.total_samples_ms, e.prefill_ms, e.decode_ms_per_token, "
        "e.gpu_name, e.workload_hash, e.notes, e.created_at, coalesce(r.started_at, e.created_at) AS run_started, "
        "acc.accepted, acc.rejected FROM e2e_results e "
        "JOIN (SELECT workload_hash, coalesce(TRY_CAST(config_json ->> 'batch_size' AS INTEGER), 1) AS b, "
        "TRY_CAST(config_json ->> 'prompt_len' AS INTEGER) AS p FROM workloads WHERE name = ?) w "
        "ON w.workload_hash = e.workload_hash AND (e.batch_size = 0 OR p IS NULL OR (e.batch_size = b AND "
        "e.prompt_len = p)) "
        "LEFT JOIN runs r ON r.run_id = regexp_replace(e.run_id, '-e2e$', '') "
        "LEFT JOIN acc ON acc.run_id = regexp_replace(e.run_id, '-e2e$', '') "
        "ORDER BY run_started, e.created_at, e.variant",
        [workload_name],
    )


def run_history(db: Database, workload_name: str):
    """The workload's runs, oldest first, with what each produced (searched tasks, trials, decisions, bundles)."""
    return db.query_df(
        "SELECT r.run_id, r.kind, r.started_at, r.status, r.profile_of, r.device, r.gpu_name, r.workload_hash, "
        "r.torch_version, r.triton_version, (SELECT count(*) FROM searches s WHERE s.run_id = r.run_id) AS searches, "
        "(SELECT coalesce(sum(trials), 0) FROM searches s WHERE s.run_id = r.run_id) AS trials, "
        "(SELECT count(*) FROM acceptances a WHERE a.run_id = r.run_id AND a.decision = 'accepted') AS accepted, "
        "(SELECT count(*) FROM acceptances a WHERE a.run_id = r.run_id AND a.decision = 'rejected') AS rejected, "
        "(SELECT count(*) FROM patches b WHERE b.run_id = r.run_id) AS bundles "
        "FROM runs r WHERE r.workload_name = ? ORDER BY r.started_at",
        [workload_name],
    )


def service_history(db: Database, workload_name: str):
    """The service's nights for a workload, oldest first: each night's keep / replace / rollback decision with its
    reason, the versions it moved between, and that night's re-validation of the bundle in service (`current_*`)
    and of its own accepted bundle (`candidate_*`): passed, gain over the unpatched model, latency verdict;
    `in_service`: the version the workload's `current` pointer names now (on every row; NULL: none)."""
    return db.query_df(
        "WITH v AS (SELECT run_id, subject, bool_and(ok) AS ok, max(gain) AS gain, "
        "string_agg(latency, '; ') AS latency FROM bundle_validations WHERE workload_name = ? "
        "GROUP BY run_id, subject) "
        "SELECT d.run_id, coalesce(r.started_at, d.created_at) AS night, d.decision, d.from_version, d.to_version, "
        "cur.ok AS current_ok, cur.gain AS current_gain, cur.latency AS current_latency, cand.ok AS candidate_ok, "
        "cand.gain AS candidate_gain, cand.latency AS candidate_latency, d.reason, "
        "(SELECT version FROM bundle_current c WHERE c.workload_name = d.workload_name) AS in_service "
        "FROM service_decisions d LEFT JOIN runs r USING (run_id) "
        "LEFT JOIN v cur ON cur.run_id = d.run_id AND cur.subject = 'current' "
        "LEFT JOIN v cand ON cand.run_id = d.run_id AND cand.subject = 'candidate' "
        "WHERE d.workload_name = ? ORDER BY night, d.created_at",
        [workload_name, workload_name],
    )


def tilemix_frontier(db: Database, run_id: str, workload_name: str):
    """The TileMix frontier rows of one bench: the latest tied to the run, else the latest tied to its workload
    (empty when neither has one), by prompt length, template and coverage."""
    return db.query_df(
        "SELECT * FROM tilemix_frontier WHERE bench_id = (SELECT bench_id FROM tilemix_frontier "
        "WHERE run_id = ? OR workload_name = ? ORDER BY (run_id IS NOT DISTINCT FROM ?) DESC, created_at DESC, "
        "bench_id DESC LIMIT 1) ORDER BY seq_len, batch, template, coverage NULLS FIRST",
        [run_id, workload_name, run_id],
    )


def kb_run(db: Database, run_id: str):
    """One row when `run_id` is a KernelBench run (`kernelbench_results.kb_run_id`), else none: its problems,
    modes, proposers, budgets, GPUs and when its rows were written."""
    return db.query_df(
        "SELECT kb_run_id, count(DISTINCT problem) AS problems, "
        "string_agg(DISTINCT mode, ', ' ORDER BY mode) AS modes, string_agg(DISTINCT proposer, ', ') AS proposer, "
        "string_agg(DISTINCT budget::VARCHAR, ', ') AS budget, "
        "string_agg(DISTINCT gpu_name, ', ') AS gpu_name, min(created_at) AS first_row, max(created_at) AS last_row "
        "FROM kernelbench_results WHERE kb_run_id = ? GROUP BY kb_run_id",
        [run_id],
    )


def kb_summary(db: Database, run_id: str, resamples: int = 2000):
    """repo.kb_summary: per mode, pass rate, fast_1 / fast_compile, the geo-means over eager and torch.compile
    (with and without the degenerate problems, those without them with their bootstrap 5-95 %)."""
    return repo.kb_summary(db, run_id, resamples)


def kb_problems(db: Database, run_id: str):
    """repo.kb_results: one row per problem and mode."""
    return repo.kb_results(db, run_id)


def kb_curve_bands(db: Database, run_id: str, resamples: int = 2000):
    """repo.kb_curve_bands without the degenerate problems: the ablation's curves per mode at equal budget."""
    return repo.kb_curve_bands(db, run_id, resamples, degenerate=False)


def kb_mode_contrasts(db: Database, run_id: str, resamples: int = 2000):
    """repo.kb_mode_contrasts without the degenerate problems: each pair of modes, paired by problem."""
    return repo.kb_mode_contrasts(db, run_id, resamples, degenerate=False)


class ReportReader:
    """llm4llm.report's Reader on an open Database: `frame(name, *args)` runs this module's query `name`."""

    def __init__(self, db: Database):
        self.db = db
        self.source = str(db.path)

    def frame(self, name: str, *args):
        return globals()[name](self.db, *args)
