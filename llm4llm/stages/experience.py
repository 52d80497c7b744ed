"""Experience between search rounds: a task's stored experience records (earlier searches, acceptance rejections) as
Experience, and an acceptance rejection turned into experience for the task's next search. The records are read
through the search's repository (stages.search.prior_experience)."""
from __future__ import annotations


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


def experience_of(records: list[dict]) -> list:
    """A task's stored experience records (earlier searches and acceptance rounds, oldest first) as Experience;
    invalid records are skipped."""
    from pydantic import ValidationError

    from llm4llm.search.types import Experience

    out = []
    for rec in records:
        try:
            out.append(Experience.model_validate(rec))
        except ValidationError:
            continue
    return out
