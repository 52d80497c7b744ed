"""The search stage: proposers, one task's search (locally, every row written as it happens; or away from the flow,
every row returned for the flow to write), which tasks a search fans out to, the built-in templates' applicability
checks, and the run's template coverage."""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from pathlib import Path

from llm4llm import isolation
from llm4llm.stages.common import code_version
from llm4llm.stages.experience import prior_experience
from storage.rows import candidate_row, episode_rows, finished_search_row, llm_call_row, search_end, search_row


def make_proposer(kind: str, seed: int = 0, llm=None, templates=None):
    """library (built-in kernel families, no API key) | llm (litellm) | hybrid (both share the budget).

    `llm`: an LLMConfig, or a dict of its fields (the CLI's merged `[llm]` table + env + flags, or a caller's own;
    env `LLM4LLM_LLM_*` fill what the dict leaves out or sets to None). API keys are never part of it: litellm
    reads them from the provider's environment variable. templates: the built-in templates the library proposer
    may use (default: all; the applicability check passes those that match the task's module)."""
    from llm4llm.search.builtin import LibraryProposer

    if kind == "library":
        return LibraryProposer(seed=seed, templates=templates)
    if kind not in ("llm", "hybrid"):
        raise ValueError(f"proposer: expected library, llm or hybrid, got {kind!r}")
    from llm4llm.llm.config import LLMConfig, load_llm_config
    from llm4llm.llm.proposer import HybridProposer, LLMProposer

    cfg = llm if isinstance(llm, LLMConfig) else load_llm_config(None, flags=dict(llm or {}))
    if kind == "llm":
        return LLMProposer(cfg)
    return HybridProposer(LLMProposer(cfg), LibraryProposer(seed=seed, templates=templates), cfg.hybrid_share)


def run_task_search(task_dir: str, db_path: str | None, data_dir: str, *, mode: str = "episodic", budget: int = 15,
                    proposer: str = "library", device: str = "cpu", timeout_s: float = 120.0, seed: int = 0,
                    run_id: str | None = None, llm: dict | None = None, use_prior: bool = True,
                    decode_timing: str = "launch", proposer_obj=None) -> dict:
    """Search one task; every trial becomes a `candidates` row as it is verified, every episode an `episodes` row
    and an `experience` record. Returns a small summary. decode_timing: "graph" times decode candidates by GPU time
    under CUDA-graph replay (a run whose decode steps replay from graphs), "graph_prefill" prefill candidates too
    (a run whose prompt forward replays from graphs as well), "launch" back to back."""
    from llm4llm import progress
    from llm4llm.search.episode import run_search
    from llm4llm.taskspec import load_spec
    from storage import repo
    from storage.db import Database

    spec = load_spec(Path(task_dir))
    templates = None
    if proposer_obj is None and proposer in ("library", "hybrid"):  # the built-in templates that compute what this module does
        from llm4llm.search.applicability import NOT_COVERED
        from llm4llm.search.templates import TEMPLATES

        checks = check_applicability(task_dir, db_path, run_id, device, timeout_s, decode_timing)
        templates = applicable_templates_of(TEMPLATES, checks)
        if not templates and proposer == "library":
            print(f"search: {spec.task_id} {NOT_COVERED} (no trial spent)")
            return {"search_id": None, "task_id": spec.task_id, "trials": 0, "pass_rate": 0.0,
                    "best_candidate": None, "best_utility": None, "episodes": 0, "ended_by": NOT_COVERED}
        if not templates:  # hybrid: the LLM writes for it alone
            proposer = "llm"
    prop = proposer_obj if proposer_obj is not None else make_proposer(proposer, seed, llm, templates)
    pool, lock = isolation.verifier_pool(device, timeout_s, decode_timing)
    search_id = f"{spec.task_id}-{mode}-{proposer}-{uuid.uuid4().hex[:8]}"
    archive_dir = Path(data_dir) / "searches" / search_id
    cand_dir = Path(data_dir) / "candidates" / spec.task_id
    cand_dir.mkdir(parents=True, exist_ok=True)
    search_kw = {}
    llm_backed = hasattr(prop, "on_call")  # LLMProposer, or HybridProposer (forwards to its LLM)
    if llm_backed:
        search_kw["samples_per_step"] = prop.config.samples_per_step
        if not prop.config.transcript_path:  # the LLM's JSONL transcripts sit next to the episode archive
            escaped = str(archive_dir).replace("{", "{{").replace("}", "}}")
            prop.transcript_path = f"{escaped}/llm-e{{episode}}.jsonl"

    def verify(task_path, source):
        with lock:
            return pool.verify(task_path, source)

    with Database(db_path) as db:
        repo.record_search_start(db, search_row(search_id, spec.task_id, run_id, mode, prop.name, budget))
        if llm_backed:  # every request attempt is an llm_calls row, written as it happens (from worker threads)
            prop.on_call = lambda call: repo.record_llm_call(db, llm_call_row(call, search_id, spec.task_id))
        counts = {"trials": 0, "passed": 0}

        def on_trial(candidate, verdict, episode, iteration):
            src = cand_dir / f"{candidate.id}.py"
            src.write_text(candidate.source)
            row = candidate_row(candidate, verdict, spec.task_id, search_id, episode, iteration, str(src))
            repo.record_candidate(db, row)
            progress.advance(search_id)
            counts["trials"] += 1
            counts["passed"] += int(row["passed"])

        progress.start(search_id, f"search {spec.task_id} ({mode})", budget)
        # earlier searches and acceptance rejections of this task (off for controlled comparisons, e.g. ablations)
        prior = prior_experience(db, spec.task_id) if use_prior else []
        try:
            result = run_search(Path(task_dir), prop, verify, mode=mode, budget=budget, seed=seed,
                                on_trial=on_trial, archive_dir=archive_dir, prior=prior, **search_kw)
        except BaseException:  # e.g. LLMConfigError (bad key or model): the search row is closed with what it did
            repo.record_search_end(db, search_id, counts["trials"], counts["passed"], None, None)
            raise
        finally:
            if llm_backed:
                prop.on_call = None  # the database closes with this block
        for row, experience in episode_rows(result, search_id):
            repo.record_episode(db, row, experience, spec.task_id)
        end = search_end(result)
        repo.record_search_end(db, search_id, end["trials"], end["passed"], end["best_candidate_id"],
                               end["best_utility"])
    return search_summary(search_id, spec.task_id, result, prop if llm_backed else None)


def search_summary(search_id: str, task_id: str, result, llm_prop=None) -> dict:
    best = result.best
    summary = {"search_id": search_id, "task_id": task_id, "trials": result.trials_used,
               "pass_rate": result.pass_rate, "best_candidate": best.candidate.id if best else None,
               "best_utility": best.feedback.utility if best else None, "episodes": len(result.episodes),
               "ended_by": result.episodes[-1].ended_by if result.episodes else None}
    if llm_prop is not None:
        llm_prop = getattr(llm_prop, "llm", llm_prop)
        summary.update(llm_calls=len(llm_prop.calls), llm_tokens=llm_prop.tokens_used,
                       llm_cost_usd=llm_prop.cost_used, llm_exhausted=llm_prop.exhausted)
    return summary


# ---- searches away from the flow (a task runner's workers: Ray, one GPU each) ----------------------------------

def remote_search_input(task_dir: str, db_path: str | None) -> dict:
    """What a search away from the flow needs, read in the flow: the task directory as bytes (a worker on another
    machine does not see the flow's data directory) and the task's stored experience (it cannot read DuckDB)."""
    from llm4llm.scale import pack_dir
    from llm4llm.taskspec import load_spec
    from storage.db import Database

    spec = load_spec(Path(task_dir))
    with Database(db_path) as db:
        prior = [json.loads(e.to_json()) for e in prior_experience(db, spec.task_id)]
    return {"task_id": spec.task_id, "task": pack_dir(task_dir), "prior": prior}


def search_rows(task_dir: str, work_dir: str, *, mode: str = "episodic", budget: int = 15,
                proposer: str = "library", device: str = "cpu", timeout_s: float = 120.0, seed: int = 0,
                run_id: str | None = None, llm: dict | None = None, decode_timing: str = "launch",
                prior: list[dict] | None = None) -> dict:
    """Search one task and write nothing to the database: return every row instead (the search, its candidates
    with their sources, its episodes with experience and transcripts, LLM calls), for the flow to write with
    record_search_rows, so DuckDB keeps one writer however many machines evaluate. Verifies on a verifier worker of
    its own, started for this search and closed after it (a pooled Ray worker may hold another GPU next time);
    `work_dir` holds the transcripts until they are read back into the rows."""
    from llm4llm.search.episode import run_search
    from llm4llm.search.types import Experience
    from llm4llm.taskspec import load_spec
    from llm4llm.verify.worker import VerifierPool

    spec = load_spec(Path(task_dir))
    prop = make_proposer(proposer, seed, llm)
    search_id = f"{spec.task_id}-{mode}-{proposer}-{uuid.uuid4().hex[:8]}"
    archive_dir = Path(work_dir) / "archive"
    started = datetime.now(timezone.utc).replace(tzinfo=None)
    search_kw, calls, candidates = {}, [], []
    llm_backed = hasattr(prop, "on_call")
    if llm_backed:
        search_kw["samples_per_step"] = prop.config.samples_per_step
        escaped = str(archive_dir).replace("{", "{{").replace("}", "}}")
        prop.transcript_path = f"{escaped}/llm-e{{episode}}.jsonl"
        prop.on_call = lambda call: calls.append(llm_call_row(call, search_id, spec.task_id))

    def on_trial(candidate, verdict, episode, iteration):
        candidates.append({"row": candidate_row(candidate, verdict, spec.task_id, search_id, episode, iteration, ""),
                           "source": candidate.source})

    pool = VerifierPool(device, timeout_s, decode_timing=decode_timing)
    try:
        result = run_search(Path(task_dir), prop, pool.verify, mode=mode, budget=budget, seed=seed,
                            on_trial=on_trial, archive_dir=archive_dir,
                            prior=[Experience.model_validate(p) for p in prior or []], **search_kw)
    finally:
        pool.close()
    episodes = []
    for row, experience in episode_rows(result, search_id):
        t = Path(row["transcript_path"]) if row["transcript_path"] else None
        episodes.append({"row": row, "experience": experience, "transcript_name": t.name if t else None,
                         "transcript": t.read_text() if t and t.exists() else None})
    files = {f.name: f.read_text() for f in archive_dir.glob("llm-e*.jsonl")}
    finished = datetime.now(timezone.utc).replace(tzinfo=None)
    return {"search": finished_search_row(search_row(search_id, spec.task_id, run_id, mode, prop.name, budget),
                                          started, finished, result),
            "candidates": candidates, "episodes": episodes, "llm_calls": calls, "files": files,
            "summary": search_summary(search_id, spec.task_id, result, prop if llm_backed else None)}


def record_search_rows(rows: dict, db_path: str | None, data_dir: str) -> dict:
    """Write what search_rows returned, in the flow: sources and transcripts under the data dir (where a local
    search puts them), then every row in one transaction. Returns the search's summary."""
    from storage import repo
    from storage.db import Database

    search, task_id = rows["search"], rows["search"]["task_id"]
    cand_dir = Path(data_dir) / "candidates" / task_id
    archive = Path(data_dir) / "searches" / search["search_id"]
    cand_dir.mkdir(parents=True, exist_ok=True)
    archive.mkdir(parents=True, exist_ok=True)
    candidates = []
    for c in rows["candidates"]:
        src = cand_dir / f"{c['row']['candidate_id']}.py"
        src.write_text(c["source"])
        candidates.append({**c["row"], "source_path": str(src)})
    episodes = []
    for e in rows["episodes"]:
        row = dict(e["row"])
        if e["transcript_name"] and e["transcript"] is not None:
            (archive / e["transcript_name"]).write_text(e["transcript"])
            row["transcript_path"] = str(archive / e["transcript_name"])
        episodes.append((row, e["experience"]))
    for name, text in rows.get("files", {}).items():
        (archive / name).write_text(text)
    with Database(db_path) as db:
        repo.record_search_result(db, search, candidates, episodes, rows["llm_calls"])
    return rows["summary"]


def searchable_task_dirs(run_id: str, db_path: str | None, task_ids: list[str] | None, families: list[str] | None,
                         top: int | None, proposer: str = "library", device: str | None = None,
                         timeout_s: float = 120.0, decode_timing: str = "launch",
                         phases: list[str] | None = None) -> list[str]:
    """The task dirs a search fans out to: deployable tasks (of `task_ids`, `families`, `phases`), hottest first, the top
    N of them. With the library proposer alone, tasks no built-in template applies to are left out before the top N
    is taken (a search of them spends no trial: on the H200 two of RecurrentGemma's five searched tasks were such),
    and each is named with why; the LLM proposers can write for any task. With `device`, "applies" is decided by
    computation (`check_applicability`, hottest first until N tasks are covered), else by the templates' scope."""
    from llm4llm.search.builtin import LibraryProposer
    from llm4llm.taskspec import load_spec
    from storage import repo
    from storage.db import Database

    with Database(db_path) as db:
        df = repo.task_rows(db, run_id)
    df = df[df["deployable"] & df["artifact_path"].notna()]
    if task_ids:
        df = df[df["task_id"].isin(task_ids)]
    if families:
        df = df[df["family"].isin(families)]
    if phases:
        df = df[df["phase"].isin(phases)]
    df = df.sort_values("score", ascending=False)
    dirs = list(df["artifact_path"])
    if proposer == "library":
        library, kept = LibraryProposer(), []
        for d in dirs:
            if top and len(kept) >= top:
                break
            spec = load_spec(Path(d))
            if not library.templates_for(spec):
                why = "; ".join(library.skipped(spec).values()) or f"no template for {spec.family}/{spec.phase}"
                print(f"search: {spec.task_id} left out, no built-in template applies ({why[:300]})")
                continue
            if device is not None:
                checks = check_applicability(d, db_path, run_id, device, timeout_s, decode_timing)
                if not any(c["applicable"] for c in checks):
                    why = "; ".join(f"{c['template']}: {c['reason']}" for c in checks)
                    print(f"search: {spec.task_id} left out, no built-in template computes what it does "
                          f"({why[:300]})")
                    continue
            kept.append(d)
        dirs = kept
    return dirs[:top] if top else dirs


def check_applicability(task_dir: str, db_path: str | None, run_id: str | None, device: str,
                        timeout_s: float = 120.0, decode_timing: str = "launch") -> list[dict]:
    """The task's template checks (llm4llm.search.applicability): recorded ones of this code version when every
    template of its family has one, else run now in the device's verifier worker (correctness on the captured
    cases only: no budget) and written to `template_checks`. Returns one dict per template of the family."""
    from llm4llm.search.applicability import check_templates
    from llm4llm.search.templates import TEMPLATES
    from llm4llm.taskspec import load_spec
    from storage import repo
    from storage.db import Database

    spec = load_spec(Path(task_dir))
    names = {t.name for t in TEMPLATES if t.family == spec.family and spec.phase in t.phases}
    with Database(db_path) as db:
        df = repo.template_check_rows(db, [spec.task_id], code_version())
    if names <= set(df["template"]):
        return [{**r, "pinned": json.loads(r["pinned_json"] or "{}")} for r in df.to_dict("records")
                if r["template"] in names]
    pool, lock = isolation.verifier_pool(device, timeout_s, decode_timing)

    def verify(path, source):
        with lock:
            return pool.verify(path, source, draws=0, timing=False)

    rows = [{**c.row(spec.task_id, run_id), "code_version": code_version()}
            for c in check_templates(Path(task_dir), spec, TEMPLATES, verify)]
    with Database(db_path) as db:
        repo.record_template_checks(db, rows)
    for r in rows:
        if not r["applicable"] and r["stage"] == "computation":
            print(f"applicability: {r['template']} inapplicable to {spec.task_id}: {r['reason'][:300]}")
    return rows


def applicable_templates_of(templates, checks: list[dict]) -> list:
    """The templates whose check passed, pinned to the option values that matched."""
    from llm4llm.search.applicability import TemplateCheck, applicable_templates

    fields = ("template", "applicable", "stage", "failure_class", "reason", "pinned")
    return applicable_templates(templates, [TemplateCheck(**{k: c.get(k) for k in fields}) for c in checks])


def coverage_table(run_id: str, db_path: str | None) -> dict:
    """Per deployable task of a run: the built-in templates that compute what its module does, those found
    inapplicable and why, the templates tried, trials (and wrong-output trials), whether a patch was accepted, and
    the task's share of its phase's time; per phase, the share some accepted patch covers (instances of an accepted
    task nested in another accepted task's instances are counted once). {"tasks": [...], "phases": {...}}."""
    from llm4llm.search.applicability import NOT_COVERED
    from llm4llm.taskspec import load_spec
    from storage import repo
    from storage.db import Database

    with Database(db_path) as db:
        cov = repo.coverage_rows(db, run_id)
        checks = repo.template_check_rows(db, list(cov["task_id"]))
    by_task: dict[str, list[dict]] = {}
    for r in checks.to_dict("records"):
        by_task.setdefault(r["task_id"], []).append(r)
    rows, covered_paths = [], {}
    for r in cov.to_dict("records"):
        if not r["deployable"]:
            continue
        cs = by_task.get(r["task_id"], [])
        ok = [c["template"] for c in cs if c["applicable"]]
        bad = [f"{c['template']} ({c['reason'][:160]})" for c in cs if not c["applicable"] and c["stage"] == "computation"]
        share = float(r["time_ms"] or 0.0) / float(r["phase_ms"]) if r["phase_ms"] else 0.0
        status = "accepted" if r["accepted"] else ("searched" if r["trials"] else
                                                    ("not checked" if not cs else (NOT_COVERED if not ok else "")))
        rows.append({"task_id": r["task_id"], "family": r["family"], "phase": r["phase"],
                     "applicable": ", ".join(ok), "inapplicable": "; ".join(bad), "tried": r["templates_tried"],
                     "trials": int(r["trials"]), "wrong_output": int(r["wrong_output"]), "accepted": bool(r["accepted"]),
                     "phase_share": round(share, 4), "status": status})
        if r["accepted"] and r["artifact_path"]:
            try:
                insts = load_spec(Path(r["artifact_path"])).instances
            except Exception:  # noqa: BLE001 - a deleted artifact: its share is still the task's own
                insts = [r["task_id"]]
            covered_paths.setdefault(r["phase"], []).append((insts, float(r["time_ms"] or 0.0), r["phase_ms"]))
    phases = {}
    for phase, items in covered_paths.items():
        outer = [i for i in items if not any(o is not i and all(any(p.startswith(q + ".") for q in o[0])
                                                                for p in i[0]) for o in items)]
        phases[phase] = round(sum(t for _, t, _ in outer) / float(items[0][2]), 4) if items[0][2] else 0.0
    return {"tasks": rows, "phases": phases}

