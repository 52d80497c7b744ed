"""Acceptance decisions are recorded as they are made (llm4llm.stages.accept.DecisionJournal): the child appends
each to its journal, the parent's poll records it, so a step stopped by Ctrl-C or a time limit keeps what it decided
(on the H100 a call's limit once ended a step after the layer kernel's +47.8 % acceptance, and the row was lost)."""
from __future__ import annotations

import textwrap

import pytest

from llm4llm.accept import Decision
from llm4llm.outcomes import DecidedBy
from llm4llm.stages.accept import DecisionJournal


def _decision(task: str, verdict: str = "rejected", by: DecidedBy = DecidedBy.LATENCY) -> Decision:
    return Decision(task, f"c-{task}", verdict, f"reason of {task}", "logits_rel_l2_floor", 0.01, 10.0, 9.0, 0.1,
                    0.3, {"kernel": {"x": 2}}, decided_by=by)


def test_a_decision_comes_back_from_its_journal_line_as_it_was():
    d = _decision("t", "accepted")
    back = Decision.from_json(d.to_json())
    assert back == d and back.decided_by is DecidedBy.LATENCY and back.accepted


def test_the_journal_hands_on_each_complete_line_once_in_order(tmp_path, capsys):
    got: list[Decision] = []
    j = DecisionJournal(tmp_path / "accept" / "run.jsonl", got.append)
    j.read()  # nothing written yet
    a, b, c = _decision("a"), _decision("b"), _decision("c", by=DecidedBy.TIME_BUDGET)
    with open(j.path, "a") as f:
        f.write(a.to_json() + "\n" + b.to_json()[:20])  # b still being written
    j.read()
    assert got == [a]
    with open(j.path, "a") as f:
        f.write(b.to_json()[20:] + "\n" + '{"task_id": "forged"}\n' + c.to_json() + "\n")
    j.read()
    j.read()
    assert got == [a, b, c]  # the unreadable line is skipped with a line saying so, the rest kept
    assert "accept: journal line 3 unreadable, skipped: TypeError" in capsys.readouterr().out


def test_a_stale_journal_of_the_same_name_is_not_read_again(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text(_decision("old").to_json() + "\n")
    got: list[Decision] = []
    DecisionJournal(path, got.append).read()
    assert got == []


def test_a_stopped_child_keeps_the_decisions_it_journalled(tmp_path):
    """The child journals two decisions and then never returns: the parent stops it at its time limit and still
    records both (the poll after it ends, however it ends), in order."""
    import runpy

    from llm4llm.isolation import in_subprocess

    first, second = _decision("first", "accepted"), _decision("second")
    # runpy.run_path's `run_name` is the kwarg the journal output maps to: the child's script reads it as __name__
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import time
        with open(__name__, "a") as f:
            f.write({first.to_json()!r} + "\\n")
        with open(__name__, "a") as f:
            f.write({second.to_json()!r} + "\\n")
        time.sleep(600)
    """))
    got: list[Decision] = []
    journal = DecisionJournal(tmp_path / "data" / "accept" / "run.jsonl", got.append)
    with pytest.raises(RuntimeError, match="no result within"):
        in_subprocess(runpy.run_path, str(script), timeout_s=8.0, outputs={"run_name": str(journal.path)},
                      readable=[str(tmp_path)], poll=journal.read, poll_every_s=0.2)
    assert got == [first, second]


# ------------------------------------------------------------------ the bundle a stopped step leaves (provisional)

def _serving(buckets=(1, 2, 4, 8, 16, 32)):
    from kernels_runtime.bundle import Guard, PatchBundle, PatchSpec

    bundle = PatchBundle(name="serving", batch_buckets=list(buckets))
    bundle.add_patch(PatchSpec(patch_id="layer", module_class="m.Layer", phase="decode", instances=["l.0"],
                               kernel="", guard=Guard(batch_buckets=list(buckets))), source="# kernel\n")
    return bundle


def _run(regime: bool):
    from types import SimpleNamespace

    from llm4llm.accept import GraphPlan, _Run
    from llm4llm.config import AcceptSettings

    wl = SimpleNamespace(device="cpu", regime=object() if regime else None, batch_size=8, name="serving")
    return _Run(wl, None, None, {}, AcceptSettings(), None, [], None, "m", GraphPlan(), None)


def test_while_a_regime_check_is_to_come_the_provisional_bundle_serves_the_measured_batches_only():
    from llm4llm.accept import provisional

    bundle = _serving()
    cut = provisional(_run(regime=True), bundle)
    assert cut.batch_buckets == [1, 2, 4, 8] and cut.patches[0].guard.batch_buckets == [1, 2, 4, 8]
    assert provisional(_run(regime=False), bundle) is bundle
    small = _serving((1, 2, 4, 8))
    assert provisional(_run(regime=True), small) is small  # nothing larger than the workload's batch to check


def test_a_step_stopped_in_its_regime_check_has_already_written_the_accepted_bundle(tmp_path, monkeypatch):
    """The trial is accepted, then the step is stopped (Ctrl-C) in the regime's check at batch 32: the bundle
    directory already holds the accepted kernel, its buckets cut to the batches measured."""
    from types import SimpleNamespace

    from kernels_runtime.bundle import PatchBundle, load_bundle
    from llm4llm import accept as acc

    r = _run(regime=True)
    monkeypatch.setattr(acc, "_prepare", lambda *a: r)
    monkeypatch.setattr(acc, "_start_fresh", lambda *a: (PatchBundle(name="serving"), None, "", None))
    monkeypatch.setattr(acc, "rank", lambda ps: [(p, SimpleNamespace(task_id="layer-task"), 0.6) for p in ps])
    monkeypatch.setattr(acc, "_task_trials", lambda *a: ([_decision("layer-task", "accepted")], _serving()))

    def stopped(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(acc, "_regime_gate", stopped)
    with pytest.raises(KeyboardInterrupt):
        acc.accept("wl.toml", [SimpleNamespace(candidate_id="c1")], str(tmp_path / "bundle"))
    kept = load_bundle(tmp_path / "bundle")
    assert kept.batch_buckets == [1, 2, 4, 8] and [p.patch_id for p in kept.patches] == ["layer"]


def test_the_bundle_watch_reports_each_new_manifest_once(tmp_path):
    import json

    from llm4llm.stages.accept import BundleWatch

    got = []
    w = BundleWatch(tmp_path / "b", lambda path, manifest: got.append((path, manifest["n"])))
    w.check()  # nothing yet
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "manifest.json").write_text('{"n": 1')  # copied mid-write: wait
    w.check()
    assert got == []
    (tmp_path / "b" / "manifest.json").write_text(json.dumps({"n": 1}))
    w.check()
    w.check()
    (tmp_path / "b" / "manifest.json").write_text(json.dumps({"n": 2}))
    w.check()
    assert got == [(str(tmp_path / "b"), 1), (str(tmp_path / "b"), 2)]


def test_a_stopped_child_leaves_its_bundle_recorded(tmp_path):
    """The child writes its bundle directory and never returns: stopped at its limit, the parent has the copy and
    has handed its path and manifest on."""
    import runpy

    from llm4llm.isolation import in_subprocess
    from llm4llm.stages.accept import BundleWatch

    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent("""
        import json, os, time
        os.makedirs(__name__, exist_ok=True)
        with open(os.path.join(__name__, "manifest.json"), "w") as f:
            json.dump({"name": "serving", "batch_buckets": [1, 2, 4, 8]}, f)
        time.sleep(600)
    """))
    got = []
    real = tmp_path / "data" / "bundles" / "run-1"
    watch = BundleWatch(real, lambda path, manifest: got.append((path, manifest["batch_buckets"])))
    with pytest.raises(RuntimeError, match="no result within"):
        in_subprocess(runpy.run_path, str(script), timeout_s=8.0, outputs={"run_name": str(real)},
                      readable=[str(tmp_path)], poll=watch.check, poll_every_s=0.2)
    assert got == [(str(real), [1, 2, 4, 8])] and (real / "manifest.json").is_file()


def test_a_recorded_bundle_is_what_an_interrupted_command_names(tmp_path):
    """Store.record_bundle is the row `llm4llm optimize` reads on Ctrl-C (repo.newest_bundle_since)."""
    import time

    from storage import repo
    from storage.db import Database
    from storage.store import Store

    db_path = str(tmp_path / "db.duckdb")
    started = time.time() - 1
    Store(db_path).record_bundle("run-1", "h", str(tmp_path / "b1"), {"name": "serving"})
    Store(db_path).record_bundle("run-1", "h", str(tmp_path / "b2"), {"name": "serving"})  # the step's later write
    with Database(db_path) as d:
        assert repo.newest_bundle_since(d, started) == str(tmp_path / "b2")
        assert d.query("select count(*) from patches")[0][0] == 1
