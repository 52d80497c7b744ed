"""One typed result per stage, frozen, handed on unchanged (issue 41): the search stage's SearchSummary (its
`ended_by` an EpisodeEnd; serialized only where it crosses from a Ray worker to the flow, and rebuilt there), the
evaluate stage's E2ERow measurements (parsed from the sandboxed child's JSON lines), and a search Trial's Verdict
(typed on the trial, dumped only into the transcript)."""
import json
from types import SimpleNamespace

import pydantic
import pytest
import torch

from llm4llm import isolation
from llm4llm.config import SearchSettings
from llm4llm.outcomes import EpisodeEnd
from llm4llm.search import LibraryProposer, run_search
from llm4llm.search.templates.base import Template, header
from llm4llm.stages import evaluate as evaluate_stage
from llm4llm.stages.evaluate import E2ERow, run_evaluate
from llm4llm.stages.search import SearchSummary, record_packed_search, search_summary
from llm4llm.taskspec import TaskSpec, write_task
from llm4llm.verdict import Latency, Verdict


def _finished_search(ended: EpisodeEnd, detail: str):
    """A SearchResult's shape as search_summary reads it: trials, pass rate, best trial, episodes."""
    best = SimpleNamespace(candidate=SimpleNamespace(id="c1"), feedback=SimpleNamespace(utility=1.7))
    episode = SimpleNamespace(ended=ended, ended_by=f"{ended}: {detail}")
    return SimpleNamespace(best=best, trials_used=4, pass_rate=0.5, episodes=[episode, episode])


def test_a_search_summary_is_frozen_and_ends_by_an_episode_end():
    s = search_summary("s1", "t1", _finished_search(EpisodeEnd.STOPPED, "time share spent"))
    assert isinstance(s.ended_by, EpisodeEnd) and s.ended_by == EpisodeEnd.STOPPED == "stopped"
    assert s.ended_text == "stopped: time share spent"
    assert (s.trials, s.pass_rate, s.best_candidate, s.best_utility, s.episodes) == (4, 0.5, "c1", 1.7, 2)
    assert not s.llm_backed and s.llm_calls is None and s.placement is None
    with pytest.raises(pydantic.ValidationError):
        s.trials = 5
    with pytest.raises(pydantic.ValidationError):
        SearchSummary(search_id="s", task_id="t", ended_by="bored")  # not an EpisodeEnd


def test_a_search_summary_round_trips_through_its_serialized_form():
    llm = SimpleNamespace(calls=[1, 2, 3], tokens_used=450, cost_used=0.0125, exhausted="token budget spent")
    s = search_summary("s1", "t1", _finished_search(EpisodeEnd.EXHAUSTED, "x"), SimpleNamespace(llm=llm))
    assert s.llm_backed and (s.llm_calls, s.llm_tokens, s.llm_cost_usd) == (3, 450, 0.0125)
    wire = json.loads(json.dumps(s.model_dump(mode="json")))  # as a Ray worker's rows carry it
    assert wire["ended_by"] == "exhausted"
    back = SearchSummary.model_validate(wire)
    assert back == s and isinstance(back.ended_by, EpisodeEnd)

    class Repo:  # storage.store.Store.record_search_rows hands back the summary the rows carried
        def record_search_rows(self, rows, data_dir):
            return rows["summary"]

    where = {"gpu_ids": ["0"], "started": 1.0, "finished": 2.0}
    recorded = record_packed_search({"summary": wire, "placement": where}, Repo(), "data")
    assert isinstance(recorded, SearchSummary) and recorded.placement == where
    assert recorded.model_copy(update={"placement": None}) == s


def test_run_evaluate_returns_typed_rows_parsed_from_the_childs_json_lines(tmp_path, monkeypatch):
    from llm4llm.evaluate import E2EResult
    from llm4llm.verify import sandbox

    def row(variant, batch, total):
        r = E2EResult(variant, 1.0, 2.0, total, 50.0, 10.0, batch_size=batch, prompt_len=8).to_row()
        return {**r, "gpu_name": None, "versions_json": {"torch": torch.__version__}}

    lines = [row("eager", 1, 30.0), row("patched", 1, 20.0), row("eager", 1, 29.0)]  # eager measured again

    def child(fn, *args, outputs, poll, **kw):
        with open(outputs["results_path"], "w") as f:
            f.write("\n".join(json.dumps(r) for r in lines) + "\n")
        poll()

    monkeypatch.setattr(isolation, "in_subprocess", child)
    monkeypatch.setattr(isolation, "workload_paths", lambda p: [])
    monkeypatch.setattr(sandbox, "make_box", lambda prefix: tmp_path)
    seen = []
    out = run_evaluate(str(tmp_path / "wl.toml"), on_measured=seen.extend)
    assert all(isinstance(r, E2ERow) for r in out + seen) and len(seen) == 3
    assert [(r.variant, r.total_ms) for r in out] == [("eager", 29.0), ("patched", 20.0)]  # the newest per point
    with pytest.raises(pydantic.ValidationError):
        out[0].total_ms = 1.0
    # every field llm4llm.evaluate writes, no more: the e2e_results row is the typed row serialized
    assert set(E2ERow.model_fields) == set(lines[0])
    from storage.store import Store

    [stored] = Store.e2e_rows("r1", "h1", out[:1])
    assert stored == {"run_id": "r1", "workload_hash": "h1", **json.loads(json.dumps(lines[2]))}
    assert evaluate_stage.E2ERow is E2ERow


def _render(spec, config):
    return header("fake.tiles", spec, ["from kernels_runtime.ops.linear import linear"], config) + \
        "\ndef entry(inputs, weights, state, static):\n    return {}\n"


FAKE = Template(name="fake.tiles", family="norm", phases=("prefill", "decode"), requires=(),
                space_fn=lambda spec: {"BLOCK": [32, 64, 128], "num_warps": [1, 2, 4, 8]}, render_fn=_render,
                default_fn=lambda spec: {"BLOCK": 64, "num_warps": 4})


def test_a_trial_keeps_its_verdict_typed_and_its_transcript_holds_it_as_json(tmp_path):
    spec = TaskSpec(family="norm", module_class="fake.Norm", instances=["model.norm"], phase="prefill",
                    input_names=["hidden_states"], weight_names=["weight"], output_names=["out"], cases=[],
                    dtype="float32")
    task_dir = write_task(tmp_path / "tasks", spec, torch.nn.Identity(), [])
    lat = Latency(p20=1.0, p50=1.0, p80=1.0, reps=5)

    def verify(_task_dir, source):  # the verifier's Verdict, or a stand-in's dict of its fields
        if "'num_warps': 8" in source:
            return {"passed": False, "failure_class": "compile", "message": "out of resources"}
        return Verdict(source_hash="h", task_id=spec.task_id, passed=True, candidate_in_context=lat,
                       reference_in_context=lat, speedup_in_context=1.0, utility=1.0)

    res = run_search(task_dir, LibraryProposer(seed=0, templates=[FAKE]), verify,
                     SearchSettings(mode="sample", budget=6), archive_dir=tmp_path / "archive")
    assert res.trials and all(isinstance(t.verdict, Verdict) for t in res.trials)
    failed = [t for t in res.trials if not t.verdict.passed]
    assert failed and all(t.verdict.failure_class == "compile" and t.verdict.task_id == spec.task_id
                          for t in failed)
    [transcript] = (tmp_path / "archive").glob("*.json")
    trials = json.loads(transcript.read_text())["trials"]
    assert [t["verdict"] for t in trials] == [t.verdict.model_dump(mode="json") for t in res.trials]
