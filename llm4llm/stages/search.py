"""The search stage: proposers, one task's search (locally, each row handed to a SearchRecorder as it happens; or away
from the flow, on a verifier worker of its own), which tasks a search fans out to, the built-in templates'
applicability checks (the run's template coverage is llm4llm.coverage). It opens no database: the caller hands in a repository
(SearchRepository: storage.store.Store) that reads what was stored (experience, recorded checks, the run's tasks)
and gives the recorder that writes the rows (storage/recorders.py)."""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol

from pydantic import BaseModel, ConfigDict

from llm4llm import isolation
from llm4llm.config import SearchSettings
from llm4llm.outcomes import EpisodeEnd
from llm4llm.planner import PER_BATCH_S
from llm4llm.stages.common import code_version


class SearchSummary(BaseModel):
    """What one task's search did, as the stage returns it to the flow, the CLI and storage (frozen: handed on
    unchanged). ended_by: why its last episode ended (None: no episode ran, e.g. a task no built-in template covers,
    `skipped` then says why); ended_detail: that ending with its detail, for people ("stopped: time share spent").
    The llm_* fields are set when the proposer is LLM-backed. placement: where a search away from the flow ran
    (record_packed_search; None for a local search). A search away from the flow crosses to the flow as
    model_dump(mode="json") and is rebuilt with model_validate."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    search_id: str | None
    task_id: str
    trials: int = 0
    pass_rate: float = 0.0
    best_candidate: str | None = None
    best_utility: float | None = None
    episodes: int = 0
    ended_by: EpisodeEnd | None = None
    ended_detail: str | None = None
    skipped: str | None = None
    llm_calls: int | None = None
    llm_tokens: int | None = None
    llm_cost_usd: float | None = None
    llm_exhausted: str | None = None
    placement: dict[str, Any] | None = None

    @property
    def llm_backed(self) -> bool:
        return self.llm_calls is not None

    @property
    def ended_text(self) -> str | None:
        """How it ended, for people: the last episode's ending with its detail, or why no episode ran."""
        return self.ended_detail or self.skipped


class SearchRecorder(Protocol):
    """Where a search's rows go as it runs: storage/recorders.py writes them to DuckDB as they happen (a local
    search) or collects them for the flow to write (a search away from the flow)."""

    def start(self, search_id: str, task_id: str, run_id: str | None, mode: str, proposer: str,
              budget: int) -> None: ...

    def trial(self, candidate, verdict, task_id: str, search_id: str, episode: int, iteration: int,
              source_path: str) -> bool:
        """Record one verified candidate; returns whether it passed."""

    def llm_call(self, call, search_id: str, task_id: str) -> None: ...

    def end(self, search_id: str, task_id: str, result) -> None:
        """Record the search's episodes (with their experience) and its end."""

    def abort(self, search_id: str, trials: int, passed: int) -> None:
        """Close the search's row with what it did before it failed."""


class SearchRepository(Protocol):
    """What a search reads and writes, handed in (storage.store.Store on DuckDB): the stage opens no database."""

    def search_recorder(self) -> ContextManager[SearchRecorder]: ...

    def experience_records(self, task_id: str) -> list[dict]: ...

    def template_check_records(self, task_ids: list[str], code_version: str | None = None) -> list[dict]: ...

    def record_template_checks(self, rows: list[dict]) -> None: ...

    def task_rows(self, run_id: str | None = None): ...

    def record_search_rows(self, rows: dict, data_dir: str) -> dict:
        """Write the rows a search away from the flow returned; returns the search's summary as the rows carry it
        (SearchSummary.model_dump(mode="json"))."""


class TemplateCheckRecord(BaseModel):
    """One template's applicability check on one task (llm4llm.search.applicability.TemplateCheck, with the task,
    run and code version it was checked under), as check_applicability returns it: frozen, its `template_checks`
    row dumped (model_dump) only where the repository writes it. pinned: the option values that matched."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_id: str
    run_id: str | None = None
    template: str
    applicable: bool
    stage: str
    failure_class: str | None = None
    reason: str = ""
    pinned: dict[str, Any] = {}
    code_version: str | None = None


# task dir -> the task's template checks (one TemplateCheckRecord per template of its family): check_applicability
CheckFn = Callable[[str], list]


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


def run_task_search(task_dir: str, data_dir: str, recorder: SearchRecorder, settings: SearchSettings, *,
                    device: str = "cpu", run_id: str | None = None, llm: dict | None = None,
                    prior: list | None = None, proposer_obj=None, check: CheckFn | None = None,
                    deadline: float | None = None, planned: bool = False) -> SearchSummary:
    """Search one task under `settings` (its mode, proposer, trials, seed, per-candidate timeout and decode
    timing); every trial goes to `recorder` as it is verified (its source under the data dir), every episode with
    its experience at the end. Returns its SearchSummary. prior: the task's stored experience (Experience records,
    oldest first). check: the task's template checks, which pick the built-in templates the library and hybrid
    proposers may use (needed for them unless proposer_obj is given). planned: a search the run's plan sized (llm4llm.planner): it ends early when its best is near the
    task's physical floor or stops improving, or by `deadline` (Unix time, its share of the time budget: no trial
    starts that would end after it at the search's pace so far; the first always runs) (llm4llm.planner.search_stop).
    Unplanned searches (`llm4llm search`, ablations) spend their whole budget."""
    from llm4llm import progress
    from llm4llm.planner import search_stop
    from llm4llm.search.episode import run_search
    from llm4llm.search.applicability import NOT_COVERED
    from llm4llm.taskspec import load_spec

    spec = load_spec(Path(task_dir))
    mode, budget, proposer, templates = settings.mode, settings.trials(), settings.proposer, None
    if proposer_obj is None and proposer in ("library", "hybrid"):  # the built-in templates that compute what this module does
        from llm4llm.search.templates import TEMPLATES

        templates = applicable_templates_of(TEMPLATES, check(task_dir))
        if not templates and proposer == "library":
            print(f"search: {spec.task_id} {NOT_COVERED} (no trial spent)")
            return SearchSummary(search_id=None, task_id=spec.task_id, skipped=NOT_COVERED)
        if not templates:  # hybrid: the LLM writes for it alone
            proposer = "llm"
    prop = proposer_obj if proposer_obj is not None else make_proposer(proposer, settings.seed, llm, templates)
    pool, lock = isolation.verifier_pool(device, settings.timeout_s, settings.decode_timing)
    search_id = f"{spec.task_id}-{mode}-{proposer}-{uuid.uuid4().hex[:8]}"
    archive_dir = Path(data_dir) / "searches" / search_id
    cand_dir = Path(data_dir) / "candidates" / spec.task_id
    cand_dir.mkdir(parents=True, exist_ok=True)
    search_kw = _llm_search_kw(prop, archive_dir, only_unset=True)
    llm_backed = bool(search_kw)  # LLMProposer, or HybridProposer (forwards to its LLM)

    limit = verify_limit(spec, settings.timeout_s)

    def verify(task_path, source):
        checked = isolation.take_verdict(trial_key(device, settings, task_path, source))
        if checked is not None:  # verified in full by the task's template check in this process
            return checked.model_copy(update={"message": (checked.message + "; " if checked.message else "")
                                                         + VERIFIED_IN_CHECK})
        with lock:
            return pool.verify(task_path, source, timeout_s=limit)

    recorder.start(search_id, spec.task_id, run_id, mode, prop.name, budget)
    if llm_backed:  # every request attempt is recorded as it happens (from worker threads)
        prop.on_call = lambda call: recorder.llm_call(call, search_id, spec.task_id)
    counts = {"trials": 0, "passed": 0, "best": None}

    def on_trial(candidate, verdict, episode, iteration):
        src = cand_dir / f"{candidate.id}.py"
        src.write_text(candidate.source)
        passed = recorder.trial(candidate, verdict, spec.task_id, search_id, episode, iteration, str(src))
        progress.advance(search_id)
        counts["trials"] += 1
        counts["passed"] += int(passed)
        progress.note(_trial_line(spec.task_id, candidate, verdict, passed, counts, budget))

    progress.start(search_id, f"search {spec.task_id} ({mode})", budget)
    try:
        result = run_search(Path(task_dir), prop, verify, settings, on_trial=on_trial, archive_dir=archive_dir,
                            prior=list(prior or []),
                            stop=search_stop(deadline) if planned else None, **search_kw)
    except BaseException:  # e.g. LLMConfigError (bad key or model): the search row is closed with what it did
        recorder.abort(search_id, counts["trials"], counts["passed"])
        raise
    finally:
        if llm_backed:
            prop.on_call = None  # the recorder's database may close after this search
    recorder.end(search_id, spec.task_id, result)
    return search_summary(search_id, spec.task_id, result, prop if llm_backed else None)


def _verdict_get(verdict, key: str):
    return verdict.get(key) if isinstance(verdict, dict) else getattr(verdict, key, None)


def trial_speedup(verdict) -> float | None:
    """A verified trial's speedup: in context where it was timed there, else cold (None: untimed, the CPU)."""
    x = _verdict_get(verdict, "speedup_in_context") or _verdict_get(verdict, "speedup_cold")
    return float(x) if x else None


VERIFIED_IN_CHECK = "verified once, in the task's template check"


def _trial_line(task_id: str, candidate, verdict, passed: bool, counts: dict, budget: int) -> str:
    """One verified trial as a progress line: what it was, how it did, the search's best so far."""
    x = trial_speedup(verdict)
    if passed and x:
        counts["best"] = max(counts["best"] or 0.0, float(x))
    what = (f"passed, {float(x):.2f}x" if passed and x else "passed (untimed on the CPU)" if passed
            else f"failed: {_verdict_get(verdict, 'failure_class')}")
    best = f"; best {counts['best']:.2f}x" if counts["best"] else ""
    reused = f" ({VERIFIED_IN_CHECK})" if VERIFIED_IN_CHECK in (_verdict_get(verdict, "message") or "") else ""
    return (f"search {task_id}: trial {counts['trials']}/{budget} {candidate.template or 'candidate'} {what}"
            f"{best}{_seconds_note(_verdict_get(verdict, 'seconds'))}{reused}")


def _seconds_note(seconds: dict | None) -> str:
    """Where the trial's verification time went, where it took long enough to ask (a serving regime's decode
    layer: 142 s a trial): ' (142 s: checks 80, timing 40, ...)', the larger phases first."""
    if not seconds or (seconds.get("total") or 0.0) < 30:
        return ""
    parts = sorted(((k, v) for k, v in seconds.items() if k != "total" and v >= 1), key=lambda kv: -kv[1])
    return f" ({seconds['total']:.0f} s: " + ", ".join(f"{k} {v:.0f}" for k, v in parts) + ")"


def _llm_search_kw(prop, archive_dir: Path, only_unset: bool) -> dict:
    """An LLM-backed proposer's search options ({} for the others); its JSONL transcripts go next to the episode
    archive (only_unset: unless its config names a transcript path)."""
    if not hasattr(prop, "on_call"):  # LLMProposer, or HybridProposer (forwards to its LLM)
        return {}
    if not (only_unset and prop.config.transcript_path):
        escaped = str(archive_dir).replace("{", "{{").replace("}", "}}")
        prop.transcript_path = f"{escaped}/llm-e{{episode}}.jsonl"
    return {"samples_per_step": prop.config.samples_per_step}


def search_summary(search_id: str, task_id: str, result, llm_prop=None) -> SearchSummary:
    """The SearchSummary of a finished search (llm4llm.search.episode.SearchResult); llm_prop: its LLM-backed
    proposer (an LLMProposer, or a HybridProposer with its `llm`), None for the others."""
    best, last = result.best, result.episodes[-1] if result.episodes else None
    llm = {}
    if llm_prop is not None:
        llm_prop = getattr(llm_prop, "llm", llm_prop)
        llm = dict(llm_calls=len(llm_prop.calls), llm_tokens=llm_prop.tokens_used, llm_cost_usd=llm_prop.cost_used,
                   llm_exhausted=llm_prop.exhausted)
    return SearchSummary(search_id=search_id, task_id=task_id, trials=result.trials_used, pass_rate=result.pass_rate,
                         best_candidate=best.candidate.id if best else None,
                         best_utility=best.feedback.utility if best else None, episodes=len(result.episodes),
                         ended_by=last.ended if last else None, ended_detail=last.ended_by if last else None, **llm)


# ---- searches away from the flow (a task runner's workers: Ray, one GPU each) ----------------------------------

def search_away(task_dir: str, work_dir: str, recorder: SearchRecorder, settings: SearchSettings, *,
                device: str = "cpu", run_id: str | None = None, llm: dict | None = None,
                prior: list[dict] | None = None) -> tuple[SearchSummary, dict]:
    """Search one task under `settings` away from the flow: every row goes to `recorder` (storage.recorders.SearchRows collects them
    for the flow to write, so DuckDB keeps one writer however many machines evaluate). Verifies on a verifier worker
    of its own, started for this search and closed after it (a pooled Ray worker may hold another GPU next time);
    `work_dir` holds the transcripts until they are read back. prior: the task's experience records. Returns (the
    search's summary, the LLM's transcript files by name)."""
    from llm4llm.search.episode import run_search
    from llm4llm.search.types import Experience
    from llm4llm.taskspec import load_spec
    from llm4llm.verify.worker import VerifierPool

    spec = load_spec(Path(task_dir))
    prop = make_proposer(settings.proposer, settings.seed, llm)
    search_id = f"{spec.task_id}-{settings.mode}-{settings.proposer}-{uuid.uuid4().hex[:8]}"
    archive_dir = Path(work_dir) / "archive"
    recorder.start(search_id, spec.task_id, run_id, settings.mode, prop.name, settings.trials())
    search_kw = _llm_search_kw(prop, archive_dir, only_unset=False)
    llm_backed = bool(search_kw)
    if llm_backed:
        prop.on_call = lambda call: recorder.llm_call(call, search_id, spec.task_id)

    def on_trial(candidate, verdict, episode, iteration):
        recorder.trial(candidate, verdict, spec.task_id, search_id, episode, iteration, "")

    pool = VerifierPool(device, settings.timeout_s, decode_timing=settings.decode_timing)
    try:
        result = run_search(Path(task_dir), prop, pool.verify, settings, on_trial=on_trial, archive_dir=archive_dir,
                            prior=[Experience.model_validate(p) for p in prior or []], **search_kw)
    finally:
        pool.close()
    recorder.end(search_id, spec.task_id, result)
    files = {f.name: f.read_text() for f in archive_dir.glob("llm-e*.jsonl")}
    return search_summary(search_id, spec.task_id, result, prop if llm_backed else None), files


def search_packed(task: bytes, recorder: SearchRecorder, settings: SearchSettings, *, device: str,
                  run_id: str | None = None, llm: dict | None = None, prior: list | None = None) -> dict:
    """One task's search away from the flow (a Ray worker holding one GPU): the task arrives as bytes
    (llm4llm.scale.pack_dir), is searched on this worker's own device (Ray shows it only its GPUs, so `cuda` is the
    one it was given) and comes back as `recorder`'s rows (storage.recorders.SearchRows) for the flow to write, with
    where and when it ran; nothing here touches DuckDB."""
    import tempfile
    import time

    from llm4llm.scale import placement, unpack_dir

    where, started = placement(), time.time()
    with tempfile.TemporaryDirectory(prefix="llm4llm-remote-") as tmp:
        task_dir = unpack_dir(task, Path(tmp) / "task")
        summary, files = search_away(str(task_dir), tmp, recorder, settings,
                                     device="cuda" if device.startswith("cuda") else device, run_id=run_id, llm=llm,
                                     prior=prior)
        rows = recorder.rows(summary.model_dump(mode="json"), files)  # JSON-able: the rows cross to the flow
    rows["placement"] = {**where, "started": started, "finished": time.time()}
    return rows


def searchable_task_dirs(tasks, settings: SearchSettings, task_ids: list[str] | None = None,
                         check: CheckFn | None = None) -> list[str]:
    """The task dirs a search fans out to, from the run's `tasks` rows (a DataFrame): deployable tasks (of
    `task_ids`, the settings' `families` and `phases`), hottest first, the settings' `top` N of them. With the library proposer alone, tasks no
    built-in template applies to are left out before the top N is taken (a search of them would spend no trial),
    and each is named with why; the LLM proposers can write for any task. With `check` (the task's template
    checks), "applies" is decided by computation (hottest first until N tasks are covered), else by the templates'
    scope."""
    from llm4llm.search.builtin import LibraryProposer
    from llm4llm.taskspec import load_spec

    families, phases, top = settings.families, settings.phases, settings.top
    df = tasks[tasks["deployable"] & tasks["artifact_path"].notna()]
    if task_ids:
        df = df[df["task_id"].isin(task_ids)]
    if families:
        df = df[df["family"].isin(families)]
    if phases:
        df = df[df["phase"].isin(phases)]
    df = df.sort_values("score", ascending=False)
    dirs = list(df["artifact_path"])
    if settings.proposer == "library":
        library, kept = LibraryProposer(), []
        for d in dirs:
            if top and len(kept) >= top:
                break
            spec = load_spec(Path(d))
            if not library.templates_for(spec):
                why = "; ".join(library.skipped(spec).values()) or f"no template for {spec.family}/{spec.phase}"
                print(f"search: {spec.task_id} left out, no built-in template applies ({why[:300]})")
                continue
            if check is not None:
                checks = check(d)
                if not any(c.applicable for c in checks):
                    why = "; ".join(f"{c.template}: {c.reason}" for c in checks)
                    print(f"search: {spec.task_id} left out, no built-in template computes what it does "
                          f"({why[:300]})")
                    continue
            kept.append(d)
        dirs = kept
    return dirs[:top] if top else dirs


def family_templates(spec) -> set[str]:
    """The names of the built-in templates of the task's family and phase (each gets an applicability check)."""
    from llm4llm.search.templates import TEMPLATES

    return {t.name for t in TEMPLATES if t.family == spec.family and spec.phase in t.phases}


def _null(v):
    """A column's value as read back, a missing one (None, or NaN through pandas) as None."""
    return None if v is None or (isinstance(v, float) and v != v) else v


def recorded_checks(records: list[dict], names: set[str]) -> list[TemplateCheckRecord] | None:
    """The task's recorded template checks (`template_checks` rows of this code version), when every template of
    its family has one; else None (they are run again)."""
    import json

    if not names <= {r["template"] for r in records}:
        return None
    return [TemplateCheckRecord(task_id=r["task_id"], run_id=_null(r.get("run_id")), template=r["template"],
                                applicable=bool(r["applicable"]), stage=r["stage"],
                                failure_class=_null(r.get("failure_class")), reason=_null(r.get("reason")) or "",
                                pinned=json.loads(_null(r.get("pinned_json")) or "{}"),
                                code_version=_null(r.get("code_version")))
            for r in records if r["template"] in names]




def verify_limit(spec, base_s: float) -> float:
    """One candidate's verification limit on this task: `base_s` (the settings' timeout) plus PER_BATCH_S for each
    batch size past the first among its cases. A serving regime's task holds every decode bucket, and a GEMV is
    compiled once per bucket's row tile: qwen3-4b's decode layer over batches 1-32 passed 120 s in compiles and
    checks alone, where the same layer at one batch took 37 s."""
    return base_s + PER_BATCH_S * max(0, len(spec.batches()) - 1)


def trial_key(device: str, settings: SearchSettings, task_dir: str | Path, source: str) -> tuple:
    """The key of a verification a search's trial may take from its task's template check (isolation's
    remember_verdict / take_verdict): the same pool, task and source."""
    from llm4llm.verdict import source_hash

    return (device, settings.timeout_s, str(settings.decode_timing), str(Path(task_dir).resolve()),
            source_hash(source))


def first_trial_source(spec, templates) -> str | None:
    """The source a library search of the task tries first where it has no experience: the default of the first of
    its family's in-scope templates written for the fewest phases (llm4llm.search.builtin's starting points)."""
    from llm4llm.search.builtin import first_start

    fits = {t.name: t for t in templates if t.family == spec.family and spec.phase in t.phases and not t.why_not(spec)}
    start = first_start(fits, spec)
    return fits[start[0]].render(spec, start[1]) if start else None


def run_template_checks(task_dir: str, run_id: str | None, device: str, settings: SearchSettings,
                        full_first: bool = False) -> list[TemplateCheckRecord]:
    """Run the task's template checks (llm4llm.search.applicability) in the device's verifier worker (the
    settings' timeout and decode timing pick it): correctness on the captured cases only, no budget. Returns one
    TemplateCheckRecord (a `template_checks` row) per template of its family. full_first: the template default the
    search will try first (`first_trial_source`) is verified as a trial is (fresh draws, timing), and where it
    passes its verdict is kept for that trial (`trial_key`): the check and the first trial are then one
    verification, not two."""
    from llm4llm.search.applicability import check_templates
    from llm4llm.search.templates import TEMPLATES
    from llm4llm.taskspec import load_spec

    spec = load_spec(Path(task_dir))
    pool, lock = isolation.verifier_pool(device, settings.timeout_s, settings.decode_timing)

    limit = verify_limit(spec, settings.timeout_s)
    first = first_trial_source(spec, TEMPLATES) if full_first else None

    def verify(path, source):
        with lock:
            if first is None or source != first:
                return pool.verify(path, source, draws=0, timing=False, timeout_s=limit)
            v = pool.verify(path, source, timeout_s=limit)
            if _verdict_get(v, "passed"):
                isolation.remember_verdict(trial_key(device, settings, path, source), v)
            elif any(g.name == "does_the_work" and g.passed for g in v.gates):
                # correct on every judged call, failed in the timing phase: for the check (does the template compute
                # the module?) that is a pass; the trial verifies it again
                return v.model_copy(update={"passed": True, "message": f"correct; failed in timing: {v.message}"})
            return v

    return [TemplateCheckRecord(**c.row(spec.task_id, run_id), code_version=code_version())
            for c in check_templates(Path(task_dir), spec, TEMPLATES, verify)]


def report_inapplicable(task_id: str, checks: list[TemplateCheckRecord]) -> None:
    for c in checks:
        if not c.applicable and c.stage == "computation":
            print(f"applicability: {c.template} inapplicable to {task_id}: {c.reason[:300]}")


def applicable_templates_of(templates, checks: list[TemplateCheckRecord]) -> list:
    """The templates whose check passed, pinned to the option values that matched."""
    from llm4llm.search.applicability import TemplateCheck, applicable_templates

    fields = ("template", "applicable", "stage", "failure_class", "reason", "pinned")
    return applicable_templates(templates, [TemplateCheck(**c.model_dump(include=set(fields))) for c in checks])



def search_recorded(task_dir: str, repo: SearchRepository, data_dir: str, settings: SearchSettings | None = None, *,
                    device: str = "cpu", run_id: str | None = None, llm: dict | None = None, proposer_obj=None,
                    trials: int | None = None, deadline: float | None = None,
                    wrap: Callable[[SearchRecorder], SearchRecorder] | None = None) -> SearchSummary:
    """Search one task in this process under `settings` (default: SearchSettings' defaults) (run_task_search);
    every trial goes to `repo`'s recorder as it is verified, every episode with its experience at the end.
    settings.warm_start: start from the task's stored experience (earlier searches and acceptance rejections; off
    for controlled comparisons, e.g. ablations). trials, deadline: the plan's (trials default the settings'
    budget); either makes it a planned search. wrap: a recorder around the repository's (e.g. a progress view).
    Returns the search's summary."""
    from llm4llm.taskspec import load_spec

    settings = settings if settings is not None else SearchSettings()
    planned = trials is not None or deadline is not None
    settings = settings.model_copy(update={"budget": trials}) if trials else settings
    task_id = load_spec(Path(task_dir)).task_id

    def check(d: str) -> list[TemplateCheckRecord]:
        return check_applicability(d, repo, run_id, device, settings)

    prior = prior_experience(repo, task_id) if settings.warm_start else []
    with repo.search_recorder() as recorder:
        return run_task_search(task_dir, data_dir, wrap(recorder) if wrap else recorder, settings, device=device,
                               run_id=run_id, llm=llm, prior=prior, proposer_obj=proposer_obj, check=check,
                               deadline=deadline, planned=planned)


def prior_experience(repo: SearchRepository, task_id: str) -> list:
    """The task's experience from earlier searches and acceptance rounds, oldest first (invalid records skipped)."""
    from llm4llm.stages.experience import experience_of

    return experience_of(repo.experience_records(task_id))


def packed_task_input(task_dir: str, repo: SearchRepository) -> dict:
    """What a search away from the flow (search_packed, on a worker that sees neither the flow's data directory nor
    DuckDB) takes for one task, read where the flow runs: the task id, the task directory as bytes and the task's
    stored experience as JSON-ready dicts."""
    import json

    from llm4llm.scale import pack_dir
    from llm4llm.taskspec import load_spec

    spec = load_spec(Path(task_dir))
    prior = [json.loads(e.to_json()) for e in prior_experience(repo, spec.task_id)]
    return {"task_id": spec.task_id, "task": pack_dir(task_dir), "prior": prior}


def record_packed_search(rows: dict, repo: SearchRepository, data_dir: str) -> SearchSummary:
    """Write the rows search_packed returned (in the flow's process: DuckDB has one writer); returns the search's
    summary, rebuilt from its serialized form, with where the search ran (`placement`, None when the rows do not
    say)."""
    summary = repo.record_search_rows(rows, data_dir)
    return SearchSummary.model_validate({**summary, "placement": rows.get("placement")})


def check_applicability(task_dir: str, repo: SearchRepository, run_id: str | None, device: str,
                        settings: SearchSettings, searched_here: bool = True) -> list[TemplateCheckRecord]:
    """The task's template checks (run, when they must be, under the settings' timeout and decode timing): the
    recorded ones of this code version when every template of its family has one, else run now in the device's
    verifier worker (run_template_checks) and written through `repo` (as `template_checks` rows: dumped here
    alone). Returns one TemplateCheckRecord per template of the family."""
    from llm4llm.taskspec import load_spec

    spec = load_spec(Path(task_dir))
    recorded = recorded_checks(repo.template_check_records([spec.task_id], code_version()), family_templates(spec))
    if recorded is not None:
        return recorded
    # without experience the search starts at the first template's default: the check verifies it as that trial
    # (a search elsewhere, a Ray task, cannot take the verdict: there the check stays a bare check)
    full_first = searched_here and (not settings.warm_start or not repo.experience_records(spec.task_id))
    checks = run_template_checks(task_dir, run_id, device, settings, full_first=full_first)
    repo.record_template_checks([c.model_dump() for c in checks])
    report_inapplicable(spec.task_id, checks)
    return checks


def searchable_of_run(run_id: str, repo: SearchRepository, settings: SearchSettings, device: str | None = None,
                      task_ids: list[str] | None = None, searched_here: bool = True) -> list[str]:
    """The task dirs a search of the run fans out to under `settings` (its families, phases, top and proposer)
    (searchable_task_dirs over the run's `tasks` rows), of `task_ids` alone when given. With `device`, a template
    applies when its check on the device passes (check_applicability), else by the templates' scope.
    searched_here: the searches run in this process (check_applicability's)."""
    def check(d: str) -> list[TemplateCheckRecord]:
        return check_applicability(d, repo, run_id, device, settings, searched_here)

    return searchable_task_dirs(repo.task_rows(run_id), settings, task_ids, check if device is not None else None)
