"""Pure stage functions that the Prefect tasks wrap. Each takes and returns paths, ids and small dicts, never tensors
or modules, so Prefect can hash, cache and retry them."""
from __future__ import annotations

import gc
import hashlib
import json
import tempfile
import uuid
from dataclasses import asdict
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

from llm4llm import isolation
from llm4llm.records import ModuleRecord, PhaseInfo, ProfileResult
from storage.rows import (candidate_row, e2e_row, episode_rows, finished_search_row, llm_call_row, patch_row,
                          profile_row, rejection_episode_row, run_row, search_end, search_row, task_row)

PACKAGES = ("llm4llm", "kernels_runtime")


@lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of the project's own source (part of every cache key: a code change re-runs the stages)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def hardware_fingerprint(device: str) -> str:
    from llm4llm.profiler import hardware_info

    info = hardware_info(device)
    keys = ("device", "gpu_name", "capability", "torch", "triton", "transformers")
    return "|".join(str(info.get(k, "")) for k in keys)


def describe_workload(workload_path: str) -> dict:
    """Validate a workload file (raises WorkloadError) and return its identity."""
    from llm4llm.workload import load_workload

    wl = load_workload(workload_path)
    return {
        "workload_hash": wl.content_hash(),
        "name": wl.name,
        "path": str(Path(workload_path).resolve()),
        "device": wl.device,
        "config": json.loads(wl.model_dump_json()),
    }


def new_run_id(name: str) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{name}-{stamp}-{uuid.uuid4().hex[:6]}"


def _build(workload_path: str, corners: bool = False):
    """(workload, model, run_fn). corners: run_fn runs the representative point, then every corner of the
    workload's serving regime (llm4llm/regime.py), so extraction captures each task's calls at those shapes too."""
    from llm4llm.workload import call_script, load_script, load_workload

    wl = load_workload(workload_path)
    script = load_script(wl)
    model = call_script(script.build, wl)
    points = [wl]
    if corners and wl.regime is not None:
        points += [wl.model_copy(update={"batch_size": b, "prompt_len": n, "decode_len": d})
                   for b, n, d in wl.regime.corners(wl.decode_len)
                   if (b, n, d) != (wl.batch_size, wl.prompt_len, wl.decode_len)]
    batches = [call_script(script.inputs, w) for w in points]

    def run_fn():
        out = None
        for w, batch in zip(points, batches):
            result = call_script(script.run, model, w, batch)
            out = result if out is None else out  # the representative point's result
        return out

    return wl, model, run_fn


def _write_json(path: Path, obj) -> Path:
    """Write JSON atomically (temp file + rename): a killed stage never leaves a half-written artifact."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)
    return path


def _free(*objs) -> None:
    del objs
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


def run_profile(workload_path: str, data_dir: str) -> str:
    """Build the model through the user's script, profile it per phase; write `profile.json` under a new run dir
    and return its path. Nothing touches the database here."""
    from llm4llm import progress
    from llm4llm.profiler import profile_model

    progress.start(f"profile:{workload_path}", f"profile {Path(workload_path).stem}", None)
    wl, model, run_fn = _build(workload_path)
    started = datetime.now(timezone.utc).replace(tzinfo=None)
    # On the GPU each phase reports the median of 3 recorded runs: one host stall (seen once: a 0.5 s v_proj call
    # in 63 decode steps of qwen3-4b) must not make one module look like the hotspot.
    repeats = 3 if wl.device.startswith("cuda") else 1
    result = profile_model(model, run_fn, device=wl.device, phase_weights=wl.phase_weights, repeats=repeats)
    run_id = new_run_id(wl.name)
    run_dir = Path(data_dir) / "runs" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "run_id": run_id,
        "workload_hash": wl.content_hash(),
        "workload_name": wl.name,
        "started_at": started.isoformat(),
        "profile": asdict(result),
    }
    path = _write_json(run_dir / "profile.json", payload)
    _free(model, run_fn)
    progress.done(f"profile:{workload_path}")
    return str(path)


def load_profile(profile_path: str) -> tuple[dict, ProfileResult]:
    payload = json.loads(Path(profile_path).read_text())
    p = payload["profile"]
    result = ProfileResult(
        phases={k: PhaseInfo(**v) for k, v in p["phases"].items()},
        records=[ModuleRecord(**r) for r in p["records"]],
        hardware=p["hardware"],
        timer=p["timer"],
    )
    return payload, result


def record_profile(profile_path: str, workload: dict, db_path: str | None, new_run: bool = False) -> str:
    """Write the run and its profile rows to DuckDB in one transaction. Idempotent for a cached profile, unless
    new_run: then a profile whose run is recorded already is recorded again under a new run id (its `profile_of`
    names the run that measured it), so that a run served from the cache still has rows of its own."""
    from storage import repo
    from storage.db import Database

    payload, result = load_profile(profile_path)
    run_id, profile_of = payload["run_id"], None
    started = payload["started_at"]
    with Database(db_path) as db:
        if repo.get_run(db, run_id) is not None:
            if not new_run:
                return run_id
            run_id, profile_of = new_run_id(payload["workload_name"]), run_id
            started = datetime.now(timezone.utc).replace(tzinfo=None).isoformat()
        run = run_row(payload, result, run_id, started, profile_of, str(Path(profile_path).parent))
        repo.record_profile_run(db, run, workload, [profile_row(r) for r in result.records])
    return run_id


def run_extract(workload_path: str, profile_path: str, data_dir: str, min_score: float = 0.0,
                static_cache: bool = False) -> str:
    """Re-run the workload with capture hooks on the profiled hotspots and write task artifacts; returns the path
    of `tasks.json` (the run's task index). static_cache: KV-cache decode tasks captured on transformers' static
    cache, as decode graphs will run them (extract_tasks)."""
    from llm4llm import progress
    from llm4llm.extract import extract_tasks

    progress.start(f"extract:{profile_path}", f"extract tasks {Path(workload_path).stem}", None)
    payload, profile = load_profile(profile_path)
    wl, model, run_fn = _build(workload_path, corners=True)
    # a regime's corners are captured as cases of the same tasks (each corner adds a prefill and a decode shape)
    corners = len(wl.regime.corners(wl.decode_len)) if wl.regime is not None else 0
    specs = extract_tasks(
        model, run_fn, profile, Path(data_dir) / "tasks",
        workload_name=wl.name, run_id=payload["run_id"], hardware=profile.hardware, min_score=min_score,
        max_cases=4 + 2 * corners,
        static_cache=static_cache,
        accuracy_budget=wl.lossy_budget(),
        regime=wl.regime is not None,
    )
    index = [json.loads(s.model_dump_json()) | {"artifact_path": str(Path(data_dir) / "tasks" / s.task_id)
                                                if s.deployable else None} for s in specs]
    path = _write_json(Path(profile_path).parent / "tasks.json", index)
    _free(model, run_fn)
    progress.done(f"extract:{profile_path}")
    return str(path)



def extract_to_temp(workload_path: str, prefix: str = "llm4llm-") -> list:
    """Profile and extract a workload into a fresh temporary directory, without a database: its tasks (specs only,
    cases left on disk), in directory order. For the device scripts that need a workload's tasks outside a run."""
    import tempfile

    from llm4llm.taskspec import load_task

    data = tempfile.mkdtemp(prefix=prefix)
    run_extract(workload_path, run_profile(workload_path, data), data)
    root = Path(data) / "tasks"
    return [load_task(d, with_cases=False) for d in sorted(root.iterdir()) if (d / "spec.json").exists()]

def record_task_index(index_path: str, run_id: str, db_path: str | None) -> int:
    from storage import repo
    from storage.db import Database

    index = json.loads(Path(index_path).read_text())
    with Database(db_path) as db:
        return repo.record_tasks(db, run_id, [task_row(t) for t in index])


def hotspot_rows(result: ProfileResult, top: int | None = None) -> list[ModuleRecord]:
    """Ranked hotspots, leaving out the top-level model (its share is 1 by definition)."""
    rows = [r for r in result.ranked() if r.depth > 0]
    return rows[:top] if top else rows


# ---- search -----------------------------------------------------------------------------------------------------

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


# ---- acceptance and end-to-end evaluation ---------------------------------------------------------------------

def best_proposals(run_id: str, db_path: str | None, min_utility: float = 0.0) -> list:
    """Each searched task's best passing candidate, ranked against its search's pooled reference
    (storage.repo.best_candidates)."""
    from llm4llm.accept import Proposal
    from storage import repo
    from storage.db import Database

    with Database(db_path) as db:
        df = repo.best_candidates(db, run_id, min_utility)
    return [Proposal(task_dir=r.artifact_path, candidate_id=r.candidate_id, source=Path(r.source_path).read_text(),
                     speedup=float(r.pooled or 0.0), config=json.loads(r.config_json or "{}"),
                     template=r.template or "")
            for r in df.itertuples()]


GRAPH_CHOICES = ("auto", "on", "off")


# A KV cache that grows per token: graphable under transformers' static cache (StaticLayer / StaticSlidingWindowLayer)
KV_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")
# The static cache itself (decode tasks extracted with static_cache=True): it asks for the static cache as well
STATIC_KV_LAYERS = ("StaticLayer", "StaticSlidingWindowLayer")


def extract_on_static_cache(device: str, requested: str | bool) -> bool:
    """Whether a run's extraction captures KV-cache decode tasks on transformers' static cache: wherever decode
    graphs may be on (a CUDA device, graphs not off), since graphs generate on it (decode_graphs_plan)."""
    return device.startswith("cuda") and requested not in (False, "off")


def decode_graphs_plan(index_path: str, device: str, requested: str | bool) -> tuple[bool, bool, str]:
    """(graphs, static_cache, why) for a run. `requested`: auto | on | off (bools: on / off).

    auto is on when the extracted tasks keep decode state only in cache layers with static addresses
    (kernels_runtime.graphs.STATIC_LAYERS: Mamba, Mamba2), in a KV cache, which the run then swaps for transformers'
    static cache (static_cache=True: Llama, Qwen3, RecurrentGemma's sliding-window attention; their attention kernels,
    written for the dynamic cache, fall back there), or on modules with a state adapter (RecurrentGemma's recurrent
    blocks: the graph adopts state a module assigns per step). Acceptance still gates them like a patch
    (accept.decide_graphs: the unpatched model's logits with graphs, then a gain of at least delta)."""
    from kernels_runtime.boundary import MODULE_ADAPTERS
    from kernels_runtime.graphs import STATIC_LAYERS

    choice = {True: "on", False: "off"}.get(requested, requested) if isinstance(requested, bool) else requested
    if choice not in GRAPH_CHOICES:
        raise ValueError(f"decode_graphs: expected one of {GRAPH_CHOICES}, got {requested!r}")
    if choice == "off":
        return False, False, "off"
    if not device.startswith("cuda"):
        return False, False, f"off ({choice}): CUDA graphs need a CUDA device, this run is on {device}"
    adapters = state_adapters(index_path)
    static = bool(adapters & set(KV_LAYERS + STATIC_KV_LAYERS))
    cache_note = "; generate with the static KV cache" if static else ""
    if choice == "on":
        return True, static, f"on (asked for){cache_note}"
    if not adapters:
        return False, False, "off (auto): no extracted module keeps decode state, so nothing says the step is static"
    other = sorted(adapters - set(STATIC_LAYERS) - set(KV_LAYERS) - set(MODULE_ADAPTERS))
    if other:
        return False, False, (f"off (auto): decode state in {other}, which graphs cannot hold (static: "
                              f"{sorted(STATIC_LAYERS)}, {list(KV_LAYERS)} under the static cache, or on modules: "
                              f"{sorted(MODULE_ADAPTERS)})")
    return True, static, f"on (auto): decode state only in {sorted(adapters)}{cache_note}"


def prefill_graphed(index_path: str) -> bool:
    """Whether the run's prompt forward replays from a CUDA graph when its decode graphs are on: kernels_runtime
    graphs a prefill only on a cache whose every layer is one of PREFILL_LAYERS (Mamba, Mamba2), so every extracted
    task that keeps state must keep it there, and one must."""
    from kernels_runtime.graphs import PREFILL_LAYERS

    adapters = state_adapters(index_path)
    return bool(adapters) and adapters <= set(PREFILL_LAYERS)


def state_adapters(index_path: str) -> set[str]:
    """The state adapters (cache layer or module kinds) the run's extracted tasks keep decode state in."""
    return {a for t in json.loads(Path(index_path).read_text())
            if (a := ((t.get("recipe") or {}).get("state") or {}).get("adapter"))}


def run_accept(workload_path: str, run_id: str, db_path: str | None, data_dir: str, cfg=None) -> dict:
    """Deployment-time acceptance of the run's best candidates under `cfg` (an llm4llm.accept.AcceptConfig;
    OptimizeConfig.accept.build() makes one with the run's graph plan); decisions, the bundle and rejected reasons
    (as experience for the next search round) go to DuckDB."""
    from llm4llm.accept import AcceptConfig, accept, decision_rows
    from storage import repo
    from storage.db import Database

    from dataclasses import replace

    from llm4llm.taskspec import check_artifacts
    from llm4llm.verify.sandbox import copy_readonly, make_box

    proposals = best_proposals(run_id, db_path, min_utility=0.0)
    bundle_dir = Path(data_dir) / "bundles" / run_id
    # the trials see read-only, hash-checked copies of the tasks in their private dir
    box, local = make_box("llm4llm-accept-"), {}
    for p in proposals:
        if p.task_dir not in local:
            check_artifacts(Path(p.task_dir))
            local[p.task_dir] = str(copy_readonly(Path(p.task_dir), box / "ro" / f"{len(local)}-{Path(p.task_dir).name}"))
    inside = [replace(p, task_dir=local[p.task_dir]) for p in proposals]
    # Candidates run inside the model here, so this runs in a spawned process: a GPU fault or hang costs the
    # acceptance step (the task retries), never the flow process or its database connection.
    # the child runs in its sandbox's private dir: a path relative to the caller's directory would not resolve there
    result = isolation.in_subprocess(accept, str(Path(workload_path).resolve()), inside,
                                     outputs={"bundle_dir": str(bundle_dir)},
                                     readable=isolation.workload_paths(workload_path), box=box,
                                     cfg=cfg if cfg is not None else AcceptConfig(), run_id=run_id)
    if result.bundle_dir:  # written in the sandbox's dir, copied here by isolation.in_subprocess
        result.bundle_dir = str(bundle_dir)
    back = {v: k for k, v in local.items()}
    for d in getattr(result, "decisions", []):
        if getattr(d, "task_dir", None) in back:
            d.task_dir = back[d.task_dir]
    wl = describe_workload(workload_path)
    with Database(db_path) as db:
        for row in decision_rows(result, run_id):
            repo.record_acceptance(db, row)
        by_id = {p.candidate_id: p for p in proposals}
        for i, d in enumerate(result.decisions):
            if d.decision == "rejected":
                repo.record_episode(db, rejection_episode_row(run_id, i),
                                    json.loads(rejection_experience(d, proposal_of(by_id, d.candidate_id)).to_json()),
                                    d.task_id)
        if result.bundle_dir:
            manifest = (Path(result.bundle_dir) / "manifest.json").read_text()
            repo.record_patch_bundle(db, patch_row(run_id, wl["workload_hash"], result.bundle_dir,
                                                   json.loads(manifest)))
    retry = sorted({d.task_id for d in result.decisions if d.decision == "rejected"
                    and not d.reason.startswith("latency gate skipped")})
    return {"bundle": result.bundle_dir, "accepted": sum(d.decision == "accepted" for d in result.decisions),
            "retry_tasks": retry,
            "rejected": sum(d.decision == "rejected" for d in result.decisions), "timing": result.timing,
            "baseline_ms": result.baseline_ms, "final_ms": result.final_ms, "metric": result.metric,
            "floor": result.floor_note, "graphs": result.graphs}


def proposal_of(by_id: dict, candidate_id: str):
    """The proposal an acceptance decision is about; a coverage step of a lossy one (accept.lossy_descent's
    `<id>@<coverage>`) is its original at that coverage, so the next round's search prunes that point too."""
    import dataclasses

    if candidate_id in by_id:
        return by_id[candidate_id]
    base, _, cov = candidate_id.rpartition("@")
    p = by_id.get(base)
    if p is None or "tm_coverage" not in p.config:
        return None
    return dataclasses.replace(p, candidate_id=candidate_id, config={**p.config, "tm_coverage": float(cov)})


def rejection_experience(decision, proposal):
    """An acceptance rejection as experience for the task's next search round: the candidate's point is marked
    failing (the built-in proposer prunes it, an LLM reads it) and the reason is kept as a note."""
    from llm4llm.search.types import Experience, FailingConfig

    failing = []
    if proposal is not None and proposal.template:
        cfg = {k: v for k, v in proposal.config.items() if k not in ("llm_call", "api_corrections", "original_sha")}
        failing.append(FailingConfig(template=proposal.template, config=cfg, failure_class="in_model",
                                     signature=decision.reason[:200]))
    return Experience(task_id=decision.task_id, episode=-1, trials=1, failing=failing,
                      notes=[f"rejected at deployment (in the model, through the script): {decision.reason[:300]}"])


def prior_experience(db, task_id: str) -> list:
    """The task's experience from earlier searches and acceptance rounds, oldest first (invalid records skipped)."""
    from pydantic import ValidationError

    from llm4llm.search.types import Experience
    from storage import repo

    out = []
    for rec in repo.experience_records(db, task_id):
        try:
            out.append(Experience.model_validate(rec))
        except ValidationError:
            continue
    return out


def run_evaluate(workload_path: str, db_path: str | None, *, bundle: str | None = None, repeats: int = 7,
                 variants: tuple[str, ...] = ("eager", "patched", "torch_compile"), run_id: str | None = None) -> dict:
    from llm4llm.evaluate import evaluate_workload
    from storage import repo
    from storage.db import Database

    wl = describe_workload(workload_path)
    run_id = run_id or new_run_id(wl["name"] + "-eval")
    latest: dict[str, dict] = {}  # variant -> its newest row (the child re-sends a variant's row after each round)
    seen = [0]
    with tempfile.TemporaryDirectory(prefix="llm4llm-e2e-") as tmp:
        stream = Path(tmp) / "rows.jsonl"

        def record_new() -> None:  # each variant's row lands in DuckDB as the child measures it
            new = []
            for line in (stream.read_text().splitlines() if stream.exists() else [])[seen[0]:]:
                try:
                    new.append(e2e_row(run_id, wl["workload_hash"], json.loads(line)))
                except json.JSONDecodeError:  # the line being written: the next poll reads it whole
                    break
            if new:
                with Database(db_path) as db:
                    repo.record_e2e(db, new)
                seen[0] += len(new)
                latest.update((r["variant"], r) for r in new)

        # the bundle (candidate code) as a read-only copy in the child's private dir: the bundle store's own dirs
        # need not be reachable by the sandbox's uid (a layer the child would otherwise lose)
        from llm4llm.verify.sandbox import copy_readonly, make_box

        box = make_box("llm4llm-e2e-")
        inside = str(copy_readonly(Path(bundle).resolve(), box / "ro" / "bundle")) if bundle else None
        isolation.in_subprocess(evaluate_workload, str(Path(workload_path).resolve()), bundle=inside,
                                variants=variants, repeats=repeats, outputs={"results_path": str(stream)},
                                poll=record_new, readable=isolation.workload_paths(workload_path), box=box)
    return {"run_id": run_id, "rows": list(latest.values())}
