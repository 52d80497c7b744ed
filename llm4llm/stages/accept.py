"""The acceptance stage: the run's best candidates, accepted or rejected inside the model (in a sandboxed
subprocess). It returns an AcceptOutcome: the decisions, the bundle's manifest and the rejections as experience;
accept_recorded reads the proposals from, and writes the outcome through, the repository it is handed
(storage.store.Store on DuckDB)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from pydantic import BaseModel, ConfigDict

from llm4llm import isolation
from llm4llm.config import AcceptSettings
from llm4llm.outcomes import AcceptDecision, AcceptTiming, DecidedBy
from llm4llm.stages.common import describe_workload
from llm4llm.stages.experience import proposal_of, rejection_experience

if TYPE_CHECKING:
    from llm4llm.accept import GraphPlan


class AcceptSummary(BaseModel):
    """What one acceptance step did, as the stage returns it to the flow, the CLI and storage (frozen: handed on
    unchanged). bundle: the bundle this step wrote (None: none written); accepted, rejected: how many decisions went
    each way; accepted_tasks: the tasks accepted in this step; retry_tasks: the rejected tasks worth searching again
    (Decision.retried: not the CPU's skipped latency gate); timing: how latency was judged (an AcceptTiming; None:
    not said); baseline_ms, final_ms: the model unpatched and with the bundle; metric: the in-model metric applied;
    floor: how the noise floor was measured; graphs: the decode-graphs decision ("" when not asked for)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bundle: str | None = None
    accepted: int = 0
    rejected: int = 0
    accepted_tasks: tuple[str, ...] = ()
    retry_tasks: tuple[str, ...] = ()
    timing: AcceptTiming | None = None
    baseline_ms: float | None = None
    final_ms: float | None = None
    metric: str = ""
    floor: str = ""
    graphs: str = ""


@dataclass
class AcceptOutcome:
    """What one acceptance step decided. `result`: the llm4llm.accept.AcceptanceResult (its bundle_dir and the
    decisions' task dirs are the caller's paths, not the sandbox's); `rejections`: (index of the decision, task id,
    experience record) per rejected decision; `manifest`: the bundle's manifest.json, None without a bundle."""
    run_id: str
    workload_hash: str
    result: Any
    rejections: list[tuple[int, str, dict]] = field(default_factory=list)
    manifest: dict | None = None

    def summary(self) -> AcceptSummary:
        r = self.result
        return AcceptSummary(bundle=r.bundle_dir, accepted=sum(d.accepted for d in r.decisions),
                             rejected=sum(d.decision == AcceptDecision.REJECTED for d in r.decisions),
                             accepted_tasks=tuple(d.task_id for d in r.decisions if d.accepted),
                             retry_tasks=tuple(sorted({d.task_id for d in r.decisions if d.retried()})),
                             timing=r.timing, baseline_ms=r.baseline_ms, final_ms=r.final_ms, metric=r.metric,
                             floor=r.floor_note, graphs=r.graphs)


class AcceptRepository(Protocol):
    """What acceptance reads and writes (storage.store.Store on DuckDB): the stage opens no database."""

    def best_candidates(self, run_id: str, min_utility: float = 0.0):
        """Each searched task's best passing candidate (storage.repo.best_candidates), a DataFrame."""

    def record_acceptance(self, outcome: AcceptOutcome) -> None:
        """One row per decision, one `episodes` row with its experience per rejection, and the bundle."""

    def record_decision(self, run_id: str, decision) -> None:
        """One decision's row as it is made (record_acceptance writes the same row again at the step's end)."""

    def record_bundle(self, run_id: str, workload_hash: str, bundle_path: str, manifest: dict) -> None:
        """The run's bundle as written so far (record_acceptance writes the step's final one over it)."""


def best_proposals(run_id: str, repo: AcceptRepository, min_utility: float = 0.0,
                   task_ids: list[str] | None = None) -> list:
    """Each searched task's best passing candidate (of `task_ids` alone when given), ranked against its search's
    pooled reference, as Proposals."""
    df = repo.best_candidates(run_id, min_utility)
    if task_ids is not None:
        df = df[df["task_id"].isin(task_ids)]
    return proposals_of(df)


def accept_recorded(workload_path: str, run_id: str, repo: AcceptRepository, data_dir: str,
                    cfg: AcceptSettings | None = None, task_ids: list[str] | None = None,
                    base_bundle: str | None = None, graphs: GraphPlan | None = None,
                    deadline: float | None = None, bundle_deadline: float | None = None) -> AcceptSummary:
    """Deployment-time acceptance of the run's best candidates (run_accept), of `task_ids` alone when given, on top
    of `base_bundle` when given, inside `deadline` and `bundle_deadline` (Unix times; llm4llm.accept.accept says
    what each shortens);
    decisions, the bundle and rejected reasons (as experience for the next search round) written through `repo`.
    Returns its AcceptSummary."""
    proposals = best_proposals(run_id, repo, min_utility=0.0, task_ids=task_ids)

    def on_bundle(path: str, manifest: dict) -> None:
        repo.record_bundle(run_id, describe_workload(workload_path)["workload_hash"], path, manifest)

    outcome = run_accept(workload_path, run_id, proposals, data_dir, cfg, base_bundle=base_bundle, graphs=graphs,
                         deadline=deadline, bundle_deadline=bundle_deadline,
                         on_decision=lambda d: repo.record_decision(run_id, d),
                         on_bundle=on_bundle)
    repo.record_acceptance(outcome)
    return outcome.summary()


def proposals_of(rows) -> list:
    """Proposals from the run's best candidates (storage.repo.best_candidates: each searched task's best passing
    candidate, ranked against its search's pooled reference)."""
    from llm4llm.accept import Proposal

    return [Proposal(task_dir=r.artifact_path, candidate_id=r.candidate_id, source=Path(r.source_path).read_text(),
                     speedup=float(r.pooled or 0.0), config=json.loads(r.config_json or "{}"),
                     template=r.template or "")
            for r in rows.itertuples()]


def run_accept(workload_path: str, run_id: str, proposals: list, data_dir: str, cfg: AcceptSettings | None = None,
               base_bundle: str | None = None, graphs: GraphPlan | None = None,
               deadline: float | None = None, bundle_deadline: float | None = None,
               on_decision: Callable[[Any], None] | None = None,
               on_bundle: Callable[[str, dict], None] | None = None) -> AcceptOutcome:
    """Deployment-time acceptance of `proposals` (the run's best candidates) under `cfg` (the run's
    AcceptSettings; default: their defaults) and the run's CUDA-graph plan `graphs` (default: none). base_bundle:
    the bundle an earlier acceptance step of this run wrote; the trials start on top of it, and the bundle this
    step writes (a directory of its own, `<run id>.<k>`) holds it plus what is accepted now. on_decision: called
    with each decision (llm4llm.accept.Decision) within a second of the child making it, and for the last ones when
    the child ends however it ends (a step stopped by Ctrl-C or a time limit keeps them); on_bundle the same with
    (path, manifest) each time the child writes its bundle (after each accepted trial: what a stopped step ships)."""
    from llm4llm.accept import accept
    from llm4llm.taskspec import check_artifacts
    from llm4llm.verify.sandbox import copy_readonly, make_box

    bundle_dir = _step_dir(Path(data_dir) / "bundles", run_id, Path(data_dir) / "accept")
    journal = DecisionJournal(Path(data_dir) / "accept" / f"{bundle_dir.name}.jsonl", on_decision)
    watch = BundleWatch(bundle_dir, on_bundle)
    # the trials see read-only, hash-checked copies of the tasks in their private dir
    box, local = make_box("llm4llm-accept-"), {}
    inside_base = str(copy_readonly(Path(base_bundle), box / "ro" / "base-bundle")) if base_bundle else None
    for p in proposals:
        if p.task_dir not in local:
            check_artifacts(Path(p.task_dir))
            local[p.task_dir] = str(copy_readonly(Path(p.task_dir), box / "ro" / f"{len(local)}-{Path(p.task_dir).name}"))
    inside = [replace(p, task_dir=local[p.task_dir]) for p in proposals]
    # Candidates run inside the model here, so this runs in a spawned process: a GPU fault or hang costs the
    # acceptance step (the task retries), never the flow process or its database connection.
    # the child runs in its sandbox's private dir: a path relative to the caller's directory would not resolve there
    result = isolation.in_subprocess(accept, str(Path(workload_path).resolve()), inside,
                                     outputs={"bundle_dir": str(bundle_dir), "journal": str(journal.path)},
                                     poll=lambda: (journal.read(), watch.check()),
                                     readable=isolation.workload_paths(workload_path), box=box,
                                     cfg=cfg, graphs=graphs, run_id=run_id,
                                     base_bundle=inside_base, deadline=deadline,
                                     bundle_deadline=bundle_deadline)
    if result.bundle_dir:  # written in the sandbox's dir, copied here by isolation.in_subprocess
        result.bundle_dir = str(bundle_dir)
    back = {v: k for k, v in local.items()}
    for d in getattr(result, "decisions", []):
        if getattr(d, "task_dir", None) in back:
            d.task_dir = back[d.task_dir]
    return _outcome(workload_path, run_id, proposals, result)


class DecisionJournal:
    """The decisions an acceptance child appends to its journal (llm4llm.accept.accept, `journal`), handed to
    `on_decision` once each, in order, as complete lines appear (read: the poll of isolation.in_subprocess; a
    failing call is retried by the next poll)."""

    def __init__(self, path: Path, on_decision: Callable[[Any], None] | None):
        self.path, self.on_decision, self.seen = path, on_decision, 0
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)

    def read(self) -> None:
        from llm4llm.accept import Decision

        if self.on_decision is None or not self.path.exists():
            return
        lines = self.path.read_text().split("\n")[:-1]  # a line still being written has no newline yet
        for line in lines[self.seen:]:
            try:
                decision = Decision.from_json(line)
            except (ValueError, TypeError) as e:  # written where candidates run: the step's result still decides
                print(f"accept: journal line {self.seen + 1} unreadable, skipped: {type(e).__name__}: {str(e)[:200]}")
                decision = None
            if decision is not None:
                self.on_decision(decision)
            self.seen += 1


class BundleWatch:
    """Hands `on_bundle` (path, manifest) each time the bundle directory's manifest changes (the child rewrites the
    whole directory atomically after each accepted trial; the parent's copy follows at every poll). A manifest that
    does not parse yet (copied mid-write) waits for the next poll."""

    def __init__(self, path: Path, on_bundle: Callable[[str, dict], None] | None):
        self.path, self.on_bundle, self.seen = path, on_bundle, None

    def check(self) -> None:
        manifest = self.path / "manifest.json"
        if self.on_bundle is None or not manifest.is_file():
            return
        text = manifest.read_text()
        if text == self.seen:
            return
        try:
            parsed = json.loads(text)
        except ValueError:
            return
        self.on_bundle(str(self.path), parsed)
        self.seen = text


def _step_dir(root: Path, run_id: str, journals: Path | None = None) -> Path:
    """The bundle directory of a run's next acceptance step: `<run id>` first, then `<run id>.2`, `.3`, ... (an
    earlier step's bundle, or its decisions' journal `journals/<name>.jsonl` where it wrote no bundle, is never
    overwritten: a run stopped mid-step keeps it)."""
    name, k = run_id, 1
    while (root / name).exists() or (journals is not None and (journals / f"{name}.jsonl").exists()):
        k += 1
        name = f"{run_id}.{k}"
    return root / name


def _outcome(workload_path: str, run_id: str, proposals: list, result) -> AcceptOutcome:
    """The acceptance result with what its rows need: the workload's hash, rejections as experience for the next
    search round, the bundle's manifest."""
    wl = describe_workload(workload_path)
    by_id = {p.candidate_id: p for p in proposals}
    rejections = [(i, d.task_id, json.loads(rejection_experience(d, proposal_of(by_id, d.candidate_id)).to_json()))
                  for i, d in enumerate(result.decisions)
                  if d.decision == AcceptDecision.REJECTED and d.decided_by != DecidedBy.TIME_BUDGET]
    manifest = json.loads((Path(result.bundle_dir) / "manifest.json").read_text()) if result.bundle_dir else None
    return AcceptOutcome(run_id, wl["workload_hash"], result, rejections, manifest)
