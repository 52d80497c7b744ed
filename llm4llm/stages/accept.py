"""The acceptance stage: the run's best candidates, accepted or rejected inside the model (in a sandboxed
subprocess); decisions, the bundle and rejections (as experience) go to DuckDB."""
from __future__ import annotations

import json
from pathlib import Path

from llm4llm import isolation
from llm4llm.stages.common import describe_workload
from llm4llm.stages.experience import proposal_of, rejection_experience
from storage.rows import decision_rows, patch_row, rejection_episode_row


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


def run_accept(workload_path: str, run_id: str, db_path: str | None, data_dir: str, cfg=None) -> dict:
    """Deployment-time acceptance of the run's best candidates under `cfg` (an llm4llm.accept.AcceptConfig;
    OptimizeConfig.accept.build() makes one with the run's graph plan); decisions, the bundle and rejected reasons
    (as experience for the next search round) go to DuckDB."""
    from llm4llm.accept import AcceptConfig, accept
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

