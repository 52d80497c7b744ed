"""Every SQL string the project runs lives here. Functions take plain dicts/records and a Database."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Iterable

from storage.db import Database, check_read_only


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def _insert(con, table: str, row: dict[str, Any], replace: bool = False) -> None:
    cols = list(row)
    verb = "INSERT OR REPLACE" if replace else "INSERT"
    con.execute(
        f"{verb} INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
        [json.dumps(v, default=str) if isinstance(v, (dict, list)) else v for v in row.values()],
    )


# ---- workloads / runs / profiles -----------------------------------------------------------------------------

def upsert_workload(con, workload_hash: str, name: str, path: str, config: dict) -> None:
    con.execute(
        "INSERT INTO workloads (workload_hash, name, path, config_json) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (workload_hash) DO NOTHING",
        [workload_hash, name, path, json.dumps(config, default=str)],
    )


def record_profile_run(db: Database, run: dict, workload: dict, profile_rows: Iterable[dict]) -> None:
    """Write a workload, its run and the run's profile rows in one transaction (all or nothing)."""
    with db.transaction() as con:
        upsert_workload(con, workload["workload_hash"], workload["name"], workload["path"], workload["config"])
        _insert(con, "runs", run)
        for row in profile_rows:
            _insert(con, "profiles", {"run_id": run["run_id"], **row})


def finish_run(db: Database, run_id: str, status: str, error: str | None = None) -> None:
    """A run ends: ok | failed | stopped, when, and the error that ended it."""
    with db.transaction() as con:
        con.execute("UPDATE runs SET status = ?, finished_at = ?, error = ? WHERE run_id = ?",
                    [status, _now(), error, run_id])


def record_tasks(db: Database, run_id: str, task_rows: Iterable[dict]) -> int:
    n = 0
    with db.transaction() as con:
        con.execute("DELETE FROM tasks WHERE run_id = ?", [run_id])
        for row in task_rows:
            _insert(con, "tasks", {"run_id": run_id, **row})
            n += 1
    return n


def list_runs(db: Database, limit: int = 50):
    return db.query_df(
        "SELECT run_id, workload_name, kind, status, started_at, device, gpu_name, prefill_ms, decode_ms, "
        "prefill_forwards, decode_forwards, profile_of FROM runs ORDER BY started_at DESC LIMIT ?",
        [limit],
    )


def run_workload_path(db: Database, run_id: str) -> str | None:
    """The workload file a run was profiled from, as recorded then."""
    rows = db.query("SELECT w.path FROM runs r JOIN workloads w USING (workload_hash) WHERE r.run_id = ?", [run_id])
    return rows[0][0] if rows and rows[0][0] else None


def get_run(db: Database, run_id: str) -> dict | None:
    df = db.query_df("SELECT * FROM runs WHERE run_id = ?", [run_id])
    return None if df.empty else df.iloc[0].to_dict()


def resolve_run_id(db: Database, text: str, pattern: tuple[str, str] | None = None) -> str | None:
    """The run id `text` names: the id itself, or the one run whose id starts with pattern's head and ends with its
    tail (a shortened id as the CLI's tables print it), or the one run whose id ends with `text`. None when no run,
    or more than one, matches."""
    if db.query("SELECT 1 FROM runs WHERE run_id = ?", [text]):
        return text
    if pattern:
        head, tail = pattern
        rows = db.query("SELECT run_id FROM runs WHERE starts_with(run_id, ?) AND ends_with(run_id, ?) "
                        "AND length(run_id) >= ?", [head, tail, len(head) + len(tail)])
    else:
        rows = db.query("SELECT run_id FROM runs WHERE ends_with(run_id, ?)", [text]) if text else []
    return rows[0][0] if len(rows) == 1 else None


def latest_run_id(db: Database, kind: str | None = None) -> str | None:
    sql = "SELECT run_id FROM runs" + (" WHERE kind = ?" if kind else "") + " ORDER BY started_at DESC LIMIT 1"
    rows = db.query(sql, [kind] if kind else [])
    return rows[0][0] if rows else None


def profile_rows(db: Database, run_id: str, top: int | None = None):
    sql = "SELECT * FROM profiles WHERE run_id = ? ORDER BY hotspot_score DESC" + (" LIMIT ?" if top else "")
    return db.query_df(sql, [run_id, top] if top else [run_id])


def task_rows(db: Database, run_id: str | None = None):
    if run_id:
        return db.query_df("SELECT * FROM tasks WHERE run_id = ? ORDER BY score DESC", [run_id])
    return db.query_df("SELECT * FROM tasks ORDER BY score DESC")


def get_task(db: Database, task_id: str) -> dict | None:
    df = db.query_df("SELECT * FROM tasks WHERE task_id = ? ORDER BY run_id DESC LIMIT 1", [task_id])
    return None if df.empty else df.iloc[0].to_dict()


# ---- search ---------------------------------------------------------------------------------------------------

def record_search_start(db: Database, row: dict) -> None:
    with db.transaction() as con:
        _insert(con, "searches", {"started_at": _now(), "trials": 0, "passed": 0, **row}, replace=True)


def record_candidate(db: Database, row: dict) -> None:
    with db.transaction() as con:
        _insert(con, "candidates", row, replace=True)


def record_episode(db: Database, row: dict, experience: dict | None, task_id: str) -> None:
    with db.transaction() as con:
        _insert(con, "episodes", row, replace=True)
        if experience is not None:
            _insert(con, "experience", {"task_id": task_id, "search_id": row["search_id"], "episode": row["episode"],
                                        "record_json": experience}, replace=True)


def record_search_end(db: Database, search_id: str, trials: int, passed: int, best_id: str | None,
                      best_utility: float | None) -> None:
    with db.transaction() as con:
        con.execute(
            "UPDATE searches SET trials = ?, passed = ?, best_candidate_id = ?, best_utility = ?, finished_at = ? "
            "WHERE search_id = ?",
            [trials, passed, best_id, best_utility, _now(), search_id],
        )


def record_search_result(db: Database, search: dict, candidates: Iterable[dict],
                         episodes: Iterable[tuple[dict, dict | None]], llm_calls: Iterable[dict] = ()) -> None:
    """A whole search at once (a search that ran away from the flow, e.g. on a Ray worker): the search row with
    its end fields, its candidates, episodes with their experience and its LLM calls, all or nothing."""
    with db.transaction() as con:
        _insert(con, "searches", search, replace=True)
        for row in candidates:
            _insert(con, "candidates", row, replace=True)
        for row, experience in episodes:
            _insert(con, "episodes", row, replace=True)
            if experience is not None:
                _insert(con, "experience", {"task_id": search["task_id"], "search_id": row["search_id"],
                                            "episode": row["episode"], "record_json": experience}, replace=True)
        for row in llm_calls:
            _insert(con, "llm_calls", row, replace=True)


def candidate_rows(db: Database, task_id: str | None = None, search_id: str | None = None):
    where, params = [], []
    if task_id:
        where.append("task_id = ?")
        params.append(task_id)
    if search_id:
        where.append("search_id = ?")
        params.append(search_id)
    sql = "SELECT * FROM candidates" + (" WHERE " + " AND ".join(where) if where else "")
    return db.query_df(sql + " ORDER BY created_at", params)


# A run's candidates (one `?`: the run id) with `ref_pool`, the median of every reference time measured in their
# search: the pooled reference a search scores its trials against (llm4llm.search.episode.pool_reference).
POOLED_CANDIDATES = ("p AS (SELECT c.*, s.run_id, median(c.ref_ctx_p50_ms) OVER (PARTITION BY c.search_id) AS ref_pool "
                     "FROM candidates c JOIN searches s USING (search_id) WHERE s.run_id = ?)")


def best_candidates(db: Database, run_id: str, min_speedup: float = 0.0):
    """Each task's best passing candidate of a run that acceptance has not rejected: by `pooled`, its speedup
    against its search's pooled reference (the median of every reference time measured in that search, as
    llm4llm.search.episode.pool_reference scores trials live), then lowest error. Rows without in-context timings
    (CPU) rank by their own utility. Columns: task_id, candidate_id, source_path, pooled, config_json, template,
    max_abs_err, artifact_path."""
    return db.query_df(
        f"WITH {POOLED_CANDIDATES}, "
        "b AS (SELECT *, CASE WHEN ctx_p50_ms > 0 AND ref_pool > 0 THEN ref_pool / ctx_p50_ms "
        "ELSE utility END AS pooled FROM p WHERE passed) "
        "SELECT p.task_id, p.candidate_id, p.source_path, p.pooled, p.config_json, p.template, p.max_abs_err, "
        "t.artifact_path FROM b AS p JOIN tasks t ON t.task_id = p.task_id AND t.run_id = p.run_id "
        "WHERE p.pooled >= ? AND p.candidate_id NOT IN "
        "(SELECT a.candidate_id FROM acceptances a WHERE a.run_id = p.run_id AND a.decision = 'rejected') "
        "QUALIFY row_number() OVER (PARTITION BY p.task_id ORDER BY p.pooled DESC, p.max_abs_err ASC) = 1",
        [run_id, min_speedup],
    )


def family_best_speedups(db: Database, gpu_name: str | None) -> list[dict]:
    """Per search on this GPU (any GPU when None), its task's family and phase and its best passing candidate's
    speedup against the search's pooled reference: what the planner expects of a family here
    (llm4llm.planner.history_speedups)."""
    return db.query_df(
        "WITH p AS (SELECT c.*, median(c.ref_ctx_p50_ms) OVER (PARTITION BY c.search_id) AS ref_pool "
        "FROM candidates c), "
        "b AS (SELECT search_id, task_id, max(CASE WHEN ctx_p50_ms > 0 AND ref_pool > 0 THEN ref_pool / ctx_p50_ms "
        "END) AS best FROM p WHERE passed AND (CAST(? AS VARCHAR) IS NULL OR gpu_name = ?) GROUP BY 1, 2) "
        "SELECT t.family, t.phase, b.best FROM b JOIN (SELECT DISTINCT task_id, family, phase FROM tasks) t "
        "USING (task_id) WHERE b.best IS NOT NULL",
        [gpu_name, gpu_name],
    ).to_dict("records")


def experience_records(db: Database, task_id: str) -> list[dict]:
    rows = db.query("SELECT record_json FROM experience WHERE task_id = ? ORDER BY created_at", [task_id])
    return [json.loads(r[0]) for r in rows]


def record_llm_call(db: Database, row: dict) -> None:
    with db.transaction() as con:
        _insert(con, "llm_calls", row, replace=True)


# ---- acceptance / patches / e2e / benchmarks ------------------------------------------------------------------

def record_acceptance(db: Database, row: dict) -> None:
    with db.transaction() as con:
        _insert(con, "acceptances", row, replace=True)


def record_patch_bundle(db: Database, row: dict) -> None:
    with db.transaction() as con:
        _insert(con, "patches", row, replace=True)


def record_e2e(db: Database, rows: Iterable[dict]) -> None:
    with db.transaction() as con:
        for row in rows:
            _insert(con, "e2e_results", row, replace=True)


def record_op_benchmarks(db: Database, rows: Iterable[dict]) -> int:
    n = 0
    with db.transaction() as con:
        for row in rows:
            _insert(con, "op_benchmarks", row)
            n += 1
    return n


def record_tilemix_frontier(db: Database, rows: Iterable[dict]) -> int:
    """`tilemix_frontier` rows (storage.rows.tilemix_frontier_rows); a bench recorded again replaces its rows."""
    n = 0
    with db.transaction() as con:
        for row in rows:
            _insert(con, "tilemix_frontier", row, replace=True)
            n += 1
    return n


def table_df(db: Database, table: str, where: str = "", params: list | None = None):
    """Read a whole table (CLI `llm4llm sql`-style inspection); `table` is checked against the schema."""
    known = {r[0] for r in db.query("SELECT table_name FROM information_schema.tables")}
    if table not in known:
        raise ValueError(f"table: expected one of {sorted(known)}, got {table!r}")
    return db.query_df(f"SELECT * FROM {table}" + (f" WHERE {where}" if where else ""), params)


# ---- the bundle in service: versions, the current pointer, nightly validations and decisions -------------------

def bundle_versions(db: Database, workload_name: str) -> list[dict]:
    """A workload's bundle versions, newest first."""
    df = db.query_df("SELECT * FROM bundle_versions WHERE workload_name = ? ORDER BY version DESC", [workload_name])
    return df.to_dict("records")


def current_bundle(db: Database, workload_name: str) -> dict | None:
    """The version in service (its bundle_versions row), or None when the workload has none in service."""
    df = db.query_df("SELECT v.* FROM bundle_current c JOIN bundle_versions v USING (workload_name, version) "
                     "WHERE c.workload_name = ?", [workload_name])
    return None if df.empty else df.iloc[0].to_dict()


def next_bundle_version(db: Database, workload_name: str) -> int:
    return int(db.query("SELECT coalesce(max(version), 0) + 1 FROM bundle_versions WHERE workload_name = ?",
                        [workload_name])[0][0])


def record_bundle_version(db: Database, row: dict) -> None:
    """Add a version of a workload's bundle; the (workload, version) key refuses to overwrite an existing one."""
    with db.transaction() as con:
        _insert(con, "bundle_versions", {**row, "created_at": _now()})


def set_current_bundle(db: Database, workload_name: str, version: int | None, run_id: str) -> None:
    with db.transaction() as con:
        _insert(con, "bundle_current", {"workload_name": workload_name, "version": version, "run_id": run_id,
                                        "updated_at": _now()}, replace=True)


def record_service_night(db: Database, validations: Iterable[dict], decision: dict) -> None:
    """A night's validations and its keep / replace / rollback decision, in one transaction."""
    with db.transaction() as con:
        for v in validations:
            _insert(con, "bundle_validations", v, replace=True)
        _insert(con, "service_decisions", decision)


def service_decisions(db: Database, workload_name: str | None = None):
    sql = "SELECT * FROM service_decisions" + (" WHERE workload_name = ?" if workload_name else "")
    return db.query_df(sql + " ORDER BY created_at", [workload_name] if workload_name else [])


def run_sql(db: Database, sql: str):
    """A user's own query (`llm4llm sql`), on a connection the caller opened read-only; anything but a query is
    refused before it runs (check_read_only)."""
    check_read_only(sql)
    return db.query_df(sql)
# ---- kernelbench (migration 007) ----------------------------------------------------------------------------

def record_kb_result(db: Database, row: dict) -> None:
    with db.transaction() as con:
        _insert(con, "kernelbench_results", row, replace=True)


def kb_results(db: Database, kb_run_id: str):
    return db.query_df("SELECT * FROM kernelbench_results WHERE kb_run_id = ? ORDER BY mode, problem_id", [kb_run_id])


def kb_summary(db: Database, kb_run_id: str, resamples: int = 2000):
    """Per mode: problems, pass rate, fast_1 (correct and faster than eager), fast_compile (correct and faster than
    torch.compile), the geometric and the arithmetic mean of the speedups over the passing problems, and the
    geo-mean over all problems with a failed one counted as 1.0 (the reference kept). Degenerate problems (the
    output ignores the inputs, migration 017) are counted and left out of `geo_eager_real` / `geo_compile_real`,
    whose spread over the problems is `*_p05` / `*_p95` (a seeded bootstrap of the problems, `resamples` draws)."""
    df = db.query_df(
        "SELECT mode, count(*) AS problems, avg(passed::INT) AS pass_rate, "
        "avg((passed AND speedup_eager > 1)::INT) AS fast_1, "
        "avg((passed AND speedup_compile > 1)::INT) AS fast_compile, "
        "exp(avg(CASE WHEN passed THEN ln(speedup_eager) END)) AS geo_eager, "
        "avg(CASE WHEN passed THEN speedup_eager END) AS mean_eager, "
        "exp(avg(CASE WHEN passed THEN ln(speedup_compile) END)) AS geo_compile, "
        "avg(CASE WHEN passed THEN speedup_compile END) AS mean_compile, "
        "exp(avg(ln(CASE WHEN passed THEN speedup_eager ELSE 1.0 END))) AS geo_eager_fail_as_1, "
        "exp(avg(CASE WHEN compile_ms IS NOT NULL THEN ln(eager_ms / compile_ms) END)) AS geo_compile_over_eager, "
        "count(*) FILTER (WHERE degenerate) AS degenerate "
        "FROM kernelbench_results WHERE kb_run_id = ? GROUP BY mode ORDER BY mode", [kb_run_id])
    real = db.query_df(
        "SELECT mode, speedup_eager, speedup_compile FROM kernelbench_results "
        "WHERE kb_run_id = ? AND passed AND NOT coalesce(degenerate, false)", [kb_run_id])
    for col in ("eager", "compile"):
        stats = {m: _geo_spread(g[f"speedup_{col}"].dropna().tolist(), resamples) for m, g in real.groupby("mode")}
        for i, key in enumerate(("real", "p05", "p95")):
            df[f"geo_{col}_{key}"] = [stats.get(m, (None, None, None))[i] for m in df["mode"]]
    return df


def _geo_spread(values: list[float], resamples: int, seed: int = 0) -> tuple:
    """(geo-mean, its 5th and 95th percentile over a seeded bootstrap of the values); Nones without values."""
    import numpy as np

    logs = np.log(np.asarray([v for v in values if v and v > 0], dtype=float))
    if not len(logs):
        return None, None, None
    draws = np.random.default_rng(seed).choice(logs, size=(resamples, len(logs)), replace=True).mean(axis=1)
    return float(np.exp(logs.mean())), float(np.exp(np.quantile(draws, 0.05))), float(np.exp(np.quantile(draws, 0.95)))


def kb_curves(db: Database, kb_run_id: str):
    """The search-mode ablation from the trials themselves: per mode and trial index, the geo-mean over problems
    of the best speedup over eager found so far (a problem with nothing passing yet counts 1.0), and the share of
    problems with a passing candidate so far."""
    return db.query_df(
        "WITH t AS (SELECT s.mode, s.task_id, c.iteration, "
        "  CASE WHEN c.passed THEN c.speedup_cold END AS sp, c.passed::INT AS ok "
        "  FROM candidates c JOIN searches s USING (search_id) "
        "  WHERE s.run_id = ?), "
        "b AS (SELECT mode, task_id, iteration, max(sp) OVER w AS best, max(ok) OVER w AS solved FROM t "
        "  WINDOW w AS (PARTITION BY mode, task_id ORDER BY iteration ROWS BETWEEN UNBOUNDED PRECEDING AND "
        "  CURRENT ROW)) "
        "SELECT mode, iteration + 1 AS trial, count(*) AS problems, exp(avg(ln(coalesce(best, 1.0)))) AS geo_best, "
        "avg(solved) AS solved FROM b GROUP BY mode, iteration ORDER BY mode, iteration",
        [kb_run_id])


# A run's best-so-far speedup over eager per mode, problem and trial (one `?`: the kb run id), at equal budget: every
# problem of a mode (its `kernelbench_results` rows) at every trial 1..the mode's budget, its value the best of the
# reference (1.0) and its passing trials up to that one, so a search that stopped early keeps its best and a problem
# with no trial (no template covers it) stays at 1.0; `degenerate` from the problem's row.
KB_BEST_SO_FAR = (
    "r AS (SELECT mode, task_id, search_id, coalesce(degenerate, false) AS degenerate, "
    "  greatest(max(budget) OVER (PARTITION BY mode), max(trials) OVER (PARTITION BY mode)) AS budget "
    "  FROM kernelbench_results WHERE kb_run_id = ?), "
    "g AS (SELECT mode, task_id, search_id, degenerate, unnest(range(1, budget + 1)) AS trial FROM r), "
    "best AS (SELECT g.mode, g.task_id, g.trial, g.degenerate, "
    "  greatest(1.0, coalesce(max(CASE WHEN c.passed THEN c.speedup_cold END), 1.0)) AS best "
    "  FROM g LEFT JOIN candidates c ON c.search_id = g.search_id AND c.iteration < g.trial "
    "  GROUP BY g.mode, g.task_id, g.trial, g.degenerate)")


def kb_best_so_far(db: Database, kb_run_id: str, degenerate: bool = True):
    """KB_BEST_SO_FAR's rows (mode, task_id, trial, degenerate, best) ordered by mode, trial and problem; without
    `degenerate`, the degenerate problems are left out."""
    return db.query_df(
        f"WITH {KB_BEST_SO_FAR} SELECT mode, task_id, trial, degenerate, best FROM best "
        "WHERE ? OR NOT degenerate ORDER BY mode, trial, task_id", [kb_run_id, degenerate])


def kb_curve_bands(db: Database, kb_run_id: str, resamples: int = 2000, degenerate: bool = True):
    """The search-mode ablation at equal budget with a 5-95 % band per mode and trial: the geo-mean over the
    mode's problems of the best speedup over eager so far (kb_best_so_far: the reference counts 1.0, a finished
    search keeps its best), over a seeded bootstrap of the problems. The draws are paired across trials (the same
    resampled problems at each trial), so a curve and its band never go down; without `degenerate`, the
    degenerate problems are left out (their speedup is how fast a constant is written)."""
    import pandas as pd

    per = kb_best_so_far(db, kb_run_id, degenerate)
    rows = []
    for (mode, trial), g in per.groupby(["mode", "trial"], sort=True):
        geo, lo, hi = _geo_spread(g.sort_values("task_id")["best"].tolist(), resamples)
        rows.append({"mode": mode, "trial": int(trial), "problems": len(g), "geo_best": geo, "geo_p05": lo,
                     "geo_p95": hi})
    return pd.DataFrame(rows, columns=["mode", "trial", "problems", "geo_best", "geo_p05", "geo_p95"])


def kb_mode_contrasts(db: Database, kb_run_id: str, resamples: int = 2000, degenerate: bool = False):
    """Each pair of search modes at the full budget, on the problems both ran: the geo-mean of the ratio of their
    best speedups (kb_best_so_far at the last trial; above 1: `mode_a` found faster kernels) with its 5-95 % over
    a seeded bootstrap of the problems. Paired by problem, so it separates two modes that the per-mode bands,
    widened by the problems' own spread, cannot."""
    import pandas as pd

    per = kb_best_so_far(db, kb_run_id, degenerate)
    last = per[per["trial"] == per.groupby("mode")["trial"].transform("max")]
    wide = last.pivot_table(index="task_id", columns="mode", values="best")
    modes = sorted(wide.columns)
    rows = []
    for i, a in enumerate(modes):
        for b in modes[i + 1:]:
            both = wide[[a, b]].dropna().sort_index()
            geo, lo, hi = _geo_spread((both[a] / both[b]).tolist(), resamples)
            rows.append({"mode_a": a, "mode_b": b, "problems": len(both), "geo_ratio": geo, "ratio_p05": lo,
                         "ratio_p95": hi})
    return pd.DataFrame(rows, columns=["mode_a", "mode_b", "problems", "geo_ratio", "ratio_p05", "ratio_p95"])


# ---- template applicability and coverage (migration 006) ------------------------------------------------------

def record_template_checks(db: Database, rows: Iterable[dict]) -> None:
    """One row per (task, template): replaces an earlier check of the same pair (a new code version re-checks)."""
    with db.transaction() as con:
        for r in rows:
            _insert(con, "template_checks", {"task_id": r["task_id"], "template": r["template"],
                                             "run_id": r.get("run_id"), "applicable": bool(r["applicable"]),
                                             "stage": r["stage"], "failure_class": r.get("failure_class"),
                                             "reason": (r.get("reason") or "")[:2000],
                                             "pinned_json": r.get("pinned") or {},
                                             "code_version": r.get("code_version"), "checked_at": _now()},
                    replace=True)


def template_check_rows(db: Database, task_ids: list[str] | None = None, code_version: str | None = None):
    where, params = [], []
    if task_ids is not None:
        where.append(f"task_id IN ({', '.join('?' for _ in task_ids)})" if task_ids else "FALSE")
        params += list(task_ids)
    if code_version:
        where.append("code_version = ?")
        params.append(code_version)
    sql = "SELECT * FROM template_checks" + (" WHERE " + " AND ".join(where) if where else "")
    return db.query_df(sql + " ORDER BY task_id, template", params)


def coverage_rows(db: Database, run_id: str):
    """Per task of a run: templates tried (with candidate rows), passing trials, accepted (by acceptance), its
    time and its phase's time (runs.prefill_ms / decode_ms) for the share some accepted patch covers."""
    return db.query_df(
        "WITH tried AS (SELECT c.task_id, string_agg(DISTINCT c.template, ', ') AS templates_tried, "
        "count(*) AS trials, count(*) FILTER (WHERE c.passed) AS passed, "
        "count(*) FILTER (WHERE c.failure_class = 'wrong_output') AS wrong_output "
        "FROM candidates c JOIN searches s USING (search_id) WHERE s.run_id = ? GROUP BY c.task_id), "
        "acc AS (SELECT task_id, bool_or(decision = 'accepted') AS accepted FROM acceptances WHERE run_id = ? "
        "GROUP BY task_id) "
        "SELECT t.task_id, t.family, t.phase, t.time_ms, t.artifact_path, t.deployable, "
        "CASE t.phase WHEN 'prefill' THEN r.prefill_ms ELSE r.decode_ms END AS phase_ms, "
        "coalesce(tried.templates_tried, '') AS templates_tried, coalesce(tried.trials, 0) AS trials, "
        "coalesce(tried.passed, 0) AS passed, coalesce(tried.wrong_output, 0) AS wrong_output, "
        "coalesce(acc.accepted, FALSE) AS accepted "
        "FROM tasks t JOIN runs r ON r.run_id = t.run_id LEFT JOIN tried ON tried.task_id = t.task_id "
        "LEFT JOIN acc ON acc.task_id = t.task_id WHERE t.run_id = ? ORDER BY t.score DESC",
        [run_id, run_id, run_id],
    )


# ---- the planner ---------------------------------------------------------------------------------------------

def record_plan(db: Database, rows: list[dict]) -> None:
    """One plan of a run (llm4llm.planner.PlanItem.row per task, under its `step`)."""
    with db.transaction() as con:
        for row in rows:
            _insert(con, "plans", row, replace=True)


def plan_steps(db: Database, run_id: str) -> int:
    """How many plans the run has recorded (the next one's step)."""
    return int(db.query("SELECT count(DISTINCT step) FROM plans WHERE run_id = ?", [run_id])[0][0])


def plan_rows(db: Database, run_id: str, step: int | None = 0):
    """The run's plan of `step` (0: the one made after extraction; None: every step), by rank."""
    if step is None:
        return db.query_df("SELECT * FROM plans WHERE run_id = ? ORDER BY step, rank", [run_id])
    return db.query_df("SELECT * FROM plans WHERE run_id = ? AND step = ? ORDER BY rank", [run_id, step])


def record_stage_times(db: Database, rows: list[dict]) -> None:
    with db.transaction() as con:
        for row in rows:
            _insert(con, "stage_times", row, replace=True)


def stage_time_rows(db: Database, run_id: str):
    return db.query_df("SELECT * FROM stage_times WHERE run_id = ? ORDER BY seq", [run_id])


def last_stage_seconds(db: Database, workload_name: str, device: str) -> dict[str, float]:
    """Seconds per stage of the workload's last run on this device kind that reached its evaluation, and `trial`:
    seconds a search trial took there (what llm4llm.planner.estimates_for plans the next run with)."""
    rows = db.query(
        "WITH last AS (SELECT run_id FROM stage_times WHERE workload_name = ? AND device = ? AND stage = 'evaluate' "
        "ORDER BY started_at DESC LIMIT 1) "
        "SELECT stage, sum(seconds), sum(trials) FROM stage_times WHERE run_id IN (SELECT run_id FROM last) "
        "GROUP BY stage", [workload_name, device])
    out = {stage: float(sec) for stage, sec, _ in rows}
    trials = {stage: n for stage, _, n in rows}
    if out.get("search") and trials.get("search"):
        out["trial"] = out["search"] / float(trials["search"])
    return out


def newest_bundle_since(db: Database, started_unix: float) -> str | None:
    """The path of the newest bundle recorded since `started_unix` (what an interrupted run leaves)."""
    rows = db.query("SELECT bundle_path FROM patches WHERE created_at >= to_timestamp(?)::TIMESTAMP "
                    "ORDER BY created_at DESC LIMIT 1", [started_unix])
    return rows[0][0] if rows else None
