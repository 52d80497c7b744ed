"""Experience flows between rounds: a rejection at deployment becomes experience that the next search of the task
starts from (the built-in proposer never proposes the rejected point again)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm4llm import isolation
from llm4llm.accept import Decision, Proposal
from llm4llm.config import SearchSettings
from llm4llm.search.builtin import LibraryProposer
from llm4llm.stages.experience import rejection_experience
from llm4llm.stages.extract import run_extract
from llm4llm.stages.profile import run_profile
from llm4llm.taskspec import load_spec
from storage import repo
from storage.db import Database
from llm4llm.stages.search import prior_experience, search_recorded
from storage.store import Store

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "workloads"


@pytest.fixture(scope="module")
def norm_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("exp")
    wl = str(EXAMPLES / "tiny-llama.toml")
    prof = run_profile(wl, str(root))
    index = json.loads(Path(run_extract(wl, prof, str(root))).read_text())
    task = next(t for t in index if t["family"] == "norm" and t["deployable"])
    return root, task["artifact_path"]


def test_rejection_becomes_experience_and_prunes_the_next_search(norm_task):
    root, task_dir = norm_task
    spec = load_spec(Path(task_dir))
    first = LibraryProposer(seed=0).propose(spec, [], [], 1)[0]
    decision = Decision(spec.task_id, first.id, "rejected", "in-model correctness: logits_rel_l2_floor 0.2 (limit 0.03)",
                        "logits_rel_l2_floor", 0.2, None, None, None, 0.1, decided_by="in_model")
    exp = rejection_experience(decision, Proposal(task_dir, first.id, first.source, 1.5, dict(first.config),
                                                 first.template))
    assert exp.failing and exp.failing[0].template == first.template and "rejected at deployment" in exp.notes[0]
    db_path = str(root / "db.duckdb")
    with Database(db_path) as db:
        repo.record_episode(db, {"search_id": "accept-r1", "episode": 0, "trials": 1, "passed": 0,
                                 "best_utility": None, "transcript_path": None}, json.loads(exp.to_json()),
                            spec.task_id)
    prior = prior_experience(Store(db_path), spec.task_id)
    assert len(prior) == 1 and prior[0].failure_for(first.template, first.config)
    again = LibraryProposer(seed=0).propose(spec, prior, [], 1)[0]
    assert (again.template, again.config) != (first.template, first.config)
    out = search_recorded(task_dir, Store(db_path), str(root), SearchSettings(mode="sample", budget=2, seed=0),
                          device="cpu")
    with Database(db_path) as db:
        tried = repo.candidate_rows(db, task_id=spec.task_id, search_id=out.search_id)
    assert first.id not in set(tried["candidate_id"]) and len(tried) == 2
    isolation.close_pools()
