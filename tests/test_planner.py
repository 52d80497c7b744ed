"""The planner (llm4llm/planner.py) on recorded profiles: a decode-bound workload (qwen3-4b, the README's command on
the H100, 2026-12-06) and a prefill-bound one (qwen3-4b-long, a 16k prompt, 2026-12-04-h200-b); its stop rules, its
clock, and the lines a run ends with (llm4llm/outcome.py)."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from llm4llm import planner
from llm4llm.outcome import result_line, summary_lines

DATA = Path(__file__).parent / "data" / "planner"


def _tasks(name: str) -> list[planner.TaskView]:
    return [planner.TaskView.of(t) for t in json.loads((DATA / f"{name}.json").read_text())["tasks"]]


def _by_family(plan: planner.Plan, family: str, phase: str, n: int | None = None) -> planner.PlanItem:
    items = [i for i in plan.items if i.family == family and i.phase == phase]
    return items[0] if n is None else sorted(items, key=lambda i: -i.score)[n]


def test_decode_bound_searches_the_layer_alone_and_gives_it_the_search():
    """qwen3-4b: the decode layer is 94 % of the time; the five tasks inside it (attention, MLP, three norms) are
    fall-backs, not targets (the old defaults searched all six); what cannot save delta is left out. With the
    H100 run's numbers (8 min, 71 s spent before the plan, a 2.68 s eager run) it gets the 5 trials it got there."""
    plan = planner.make_plan(_tasks("qwen3-4b-decode"), device="cuda", run_s=2.676, delta=0.02, budget_s=480,
                             elapsed_s=71)
    targets = plan.targets()
    assert [t.family for t in targets] == ["decoder_layer"] and targets[0].phase == "decode"
    assert targets[0].trials == 5
    inside = [i for i in plan.items if i.action == "fallback"]
    assert {i.family for i in inside} == {"attention", "mlp", "norm"} and len(inside) == 5
    assert all(i.parent == targets[0].task_id for i in inside)
    lm_head = _by_family(plan, "lm_head", "decode")
    assert lm_head.action == "skip" and "below delta" in lm_head.reason
    # the final norm is outside the layers: the 73-instance norm task is still a fall-back (72 of 73 inside)
    assert _by_family(plan, "norm", "decode", 0).action == "fallback"
    assert plan.search_s == pytest.approx(480 * 0.95 - 71 - plan.estimates.accept_s - plan.estimates.evaluate_s)


def test_prefill_bound_puts_prefill_attention_first_and_splits_trials_by_saving():
    plan = planner.make_plan(_tasks("qwen3-4b-long-prefill"), device="cuda", run_s=0.58, delta=0.02,
                             budget_s=900, elapsed_s=60)
    targets = plan.targets()
    assert [(t.family, t.phase) for t in targets] == [("attention", "prefill"), ("decoder_layer", "decode"),
                                                      ("mlp", "prefill"), ("norm", "prefill")]
    savings = [t.saving for t in targets]
    assert savings == sorted(savings, reverse=True)
    trials = [t.trials for t in targets]
    assert trials[0] >= trials[1] >= trials[2] >= trials[3] >= planner.MIN_TRIALS and trials[0] > trials[3]
    assert sum(trials) <= plan.search_s / plan.estimates.trial_s + len(targets)  # rounding, MIN_TRIALS
    # q/k norms of the prompt sit inside the prompt's attention, searched whole
    q_norm = next(i for i in plan.items if i.family == "norm" and i.phase == "prefill" and i.action == "fallback")
    assert q_norm.parent == targets[0].task_id


def test_children_become_targets_when_the_whole_fails_or_is_not_covered():
    tasks = _tasks("qwen3-4b-decode")
    layer = next(t for t in tasks if t.family == "decoder_layer").task_id
    for kw in ({"excluded": [layer]}, {"covers": {layer: False}}):
        plan = planner.make_plan(tasks, device="cuda", run_s=2.7, delta=0.02, budget_s=480, elapsed_s=60, **kw)
        fams = [t.family for t in plan.targets()]
        assert "decoder_layer" not in fams and fams[0] in ("attention", "norm") and "norm" in fams
        assert "mlp" not in fams  # its family usually loses to cuBLAS: not worth a trial without evidence
    uncovered = planner.make_plan(tasks, device="cuda", run_s=2.7, delta=0.02, budget_s=480, elapsed_s=60,
                                  covers={layer: False})
    assert "not covered" in next(i for i in uncovered.items if i.task_id == layer).reason


def test_history_overrides_the_priors():
    tasks = _tasks("qwen3-4b-decode")
    layer = next(t for t in tasks if t.family == "decoder_layer").task_id
    hist = planner.history_speedups([{"family": "mlp", "phase": "decode", "best": 1.6},
                                     {"family": "mlp", "phase": "decode", "best": 1.4}])
    assert hist == {("mlp", "decode"): 1.5}
    plan = planner.make_plan(tasks, device="cuda", run_s=2.7, delta=0.02, budget_s=480, elapsed_s=60,
                             history=hist, excluded=[layer])
    assert "mlp" in [t.family for t in plan.targets()]


def test_user_overrides_top_family_and_budget():
    tasks = _tasks("qwen3-4b-long-prefill")
    top = planner.make_plan(tasks, device="cuda", run_s=0.58, delta=0.02, budget_s=None, elapsed_s=0, top=2,
                            trials=4)
    assert [(t.family, t.phase) for t in top.targets()] == [("attention", "prefill"), ("decoder_layer", "decode")]
    assert [t.trials for t in top.targets()] == [4, 4] and top.search_s is None
    norms = planner.make_plan(tasks, device="cuda", run_s=0.58, delta=0.02, budget_s=None, elapsed_s=0,
                              families=["norm"], phases=["prefill"])
    assert {t.family for t in norms.targets()} == {"norm"} and all(t.trials == planner.MAX_TRIALS
                                                                   for t in norms.targets())


def test_plan_lines_name_every_target_and_the_reasons():
    plan = planner.make_plan(_tasks("qwen3-4b-decode"), device="cuda", run_s=2.676, delta=0.02, budget_s=480,
                             elapsed_s=71)
    text = "\n".join(plan.lines(71))
    assert text.startswith("plan: 1 task(s) to search, expected end-to-end saving")
    assert "5 trials  decoder_layer-decode" in text and "searched only if that fails" in text
    assert "below delta 2%" in text and "budget 8:00" in text
    nothing = planner.make_plan(_tasks("qwen3-4b-decode"), device="cuda", run_s=2.7, delta=0.99, budget_s=480,
                                elapsed_s=60)
    assert not nothing.targets() and "nothing to search" in "\n".join(nothing.lines())


def test_estimates_from_the_last_run_of_the_workload():
    est = planner.estimates_for("cuda", 2.7, {"search": 80.0, "trial": 16.0, "accept": 54.0, "evaluate": 97.0})
    assert (est.trial_s, est.accept_s, est.evaluate_s) == (16.0, 54.0, 97.0)
    assert est.source == "this workload's last run"
    assert planner.estimates_for("cpu", 0.01).source.startswith("defaults for cpu")


def test_a_trial_over_a_serving_regime_is_expected_to_verify_every_batch_size():
    """A decode task whose cases hold six batch sizes (a serving regime's buckets 1-32) is verified at each: without
    an earlier run the plan expects PER_BATCH_S more a further size (32 + 5 x 20 = 132 s; the H200 took 142 s, where
    the plan said 32), and says so; an earlier run's measured trial time still wins."""
    entries = json.loads((DATA / "qwen3-4b-decode.json").read_text())["tasks"]
    layer = next(e for e in entries if e["family"] == "decoder_layer" and e["phase"] == "decode")
    layer["input_names"] = ["hidden_states"]
    layer["cases"] = [{"inputs": {"hidden_states": {"shape": [b, 1, 2560], "dtype": "bfloat16"}}}
                      for b in (8, 1, 1, 2, 4, 8, 16, 32)]
    tasks = [planner.TaskView.of(e) for e in entries]
    assert next(t for t in tasks if t.task_id == layer["task_id"]).batches == 6
    plan = planner.make_plan(tasks, device="cuda", run_s=4.9, delta=0.02, budget_s=480, elapsed_s=251)
    assert plan.estimates.trial_s == planner.TRIAL_S["cuda"] + 5 * planner.PER_BATCH_S
    assert "a trial ~132 s" in plan.lines(251)[0] and "6 batch sizes" in plan.lines(251)[0]
    one = planner.make_plan(_tasks("qwen3-4b-decode"), device="cuda", run_s=4.9, delta=0.02, budget_s=480,
                            elapsed_s=251)
    assert one.estimates.trial_s == planner.TRIAL_S["cuda"]
    past = planner.make_plan(tasks, device="cuda", run_s=4.9, delta=0.02, budget_s=480, elapsed_s=251,
                             past={"trial": 142.0})
    assert past.estimates.trial_s == 142.0


@pytest.mark.parametrize("text,seconds", [("8m", 480), ("90s", 90), ("1h30m", 5400), ("600", 600), ("2.5m", 150),
                                          ("off", None), ("0", None), (None, None)])
def test_parse_duration(text, seconds):
    assert planner.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["8 minutes", "m8", "-3m", "1x"])
def test_parse_duration_refuses_what_it_cannot_read(text):
    with pytest.raises(ValueError, match="expected a duration"):
        planner.parse_duration(text)


def _trial(passed: bool, utility: float = 0.0, ctx_ms: float | None = None, floor_ms: float | None = None):
    from llm4llm.verdict import Latency, Verdict

    lat = Latency(p20=ctx_ms, p50=ctx_ms, p80=ctx_ms) if ctx_ms else None
    verdict = Verdict(source_hash="h", task_id="t", candidate_in_context=lat, floor_ms=floor_ms)
    return SimpleNamespace(feedback=SimpleNamespace(passed=passed, utility=utility), verdict=verdict)


def test_search_stops_near_the_floor_on_a_plateau_and_at_its_deadline():
    stop = planner.search_stop(None)
    assert stop([_trial(True, 2.0, ctx_ms=0.068, floor_ms=0.046)]) is None  # 1.48x its floor: go on
    why = stop([_trial(True, 2.0, ctx_ms=0.068, floor_ms=0.046), _trial(True, 2.5, ctx_ms=0.050, floor_ms=0.046)])
    assert why and "its floor" in why
    flat = [_trial(True, 2.60)] + [_trial(True, 2.605)] * planner.PLATEAU_TRIALS
    assert "no gain" in stop(flat)
    assert stop([_trial(True, 2.0)] + [_trial(True, 2.5)] * planner.PLATEAU_TRIALS) is None  # it improved
    assert stop([_trial(False)] * 10) is None  # the CPU (nothing timed): only the count and the deadline
    late = planner.search_stop(time.time() + 5, started_wall=time.time() - 30)  # 30 s a trial, 5 s left
    assert "time budget is spent" in late([_trial(True, 1.5)])
    assert planner.search_stop(time.time() + 600, started_wall=time.time() - 30)([_trial(True, 1.5)]) is None


def test_run_search_ends_early_when_the_stop_says_so(tmp_path):
    """The stop is asked before every trial but the first; its reason ends the episode and the search."""
    from llm4llm.config import SearchSettings
    from llm4llm.search.episode import run_search
    from llm4llm.search.types import Candidate
    from llm4llm.taskspec import TaskSpec

    spec = TaskSpec(family="norm", module_class="torch.nn.Identity", instances=["x"], phase="decode",
                    input_names=["x"], weight_names=[], output_names=["out"], cases=[], dtype="float32")
    seen = []

    class Prop:
        name = "fake"

        def propose(self, spec, experiences, feedback, n):
            k = len(seen)
            return [Candidate(id=f"c{k + i}", source=f"# {k + i}", template="t", config={}) for i in range(n)]

    def verify(task_dir, source):
        seen.append(source)
        return {"passed": True, "utility": 1.0, "speedup_in_context": 1.0}

    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    result = run_search(tmp_path, Prop(), verify, SearchSettings(budget=10),
                        stop=lambda trials: "enough" if len(trials) >= 3 else None)
    assert result.trials_used == 3
    assert result.episodes[-1].ended_by == "stopped: enough"


def test_clock_spans_and_status():
    clock = planner.Clock(480, started=time.monotonic() - 90)
    span = clock.start("search", "t1")
    clock.end(span)
    assert clock.status().startswith("[1:30 / 8:00]")
    assert 380 < clock.remaining() < 391 and "search" in clock.seconds()
    assert planner.Clock(None).remaining() is None and planner.Clock(None).deadline_wall() is None


E2E = [  # the H100 run's rows (docs/results/2026-12-06-h100, call 1), as storage.rows.e2e_row writes them
    {"variant": "eager", "total_ms": 1631.2, "vs_compile": 0.257, "vs_compile_p20": 0.257, "vs_compile_p80": 0.26,
     "repeats": 7},
    {"variant": "patched_graphs", "total_ms": 274.5, "vs_compile": 1.532, "vs_compile_p20": 1.527,
     "vs_compile_p80": 1.533, "vs_eager": 5.937, "vs_eager_p20": 5.91, "vs_eager_p80": 5.97, "repeats": 7},
    {"variant": "torch_compile", "total_ms": 420.1, "vs_eager": 3.885, "repeats": 7},
]


def test_the_run_ends_with_what_the_user_got():
    lines = summary_lines(E2E, "/data/bundles/qwen3-4b-x", ["decoder_layer-decode-d3d2"],
                          {"profile": 17.2, "search": 79.7}, 302.0, 480.0, "cuda")
    assert lines[0] == ("result: patched_graphs 274.5 ms a request, 1.53x (p20-p80 1.53-1.53) torch.compile "
                        "(420.1 ms), 5.94x (p20-p80 5.91-5.97) eager (1631.2 ms), 7 interleaved rounds")
    assert lines[1] == "bundle: /data/bundles/qwen3-4b-x (decoder_layer-decode-d3d2)"
    assert lines[2].startswith("install: kernels_runtime.apply(model, '/data/bundles/qwen3-4b-x')")
    assert lines[3] == "time: 5:02 of the 8:00 budget (profile 0:17, search 1:20)"
    cpu = summary_lines([{"variant": "eager", "total_ms": 9.0}, {"variant": "patched", "total_ms": None,
                                                                 "notes": "skipped: no bundle"}],
                        None, [], {}, 380.0, 480.0, "cpu")
    assert cpu[0].startswith("result: no patched run to compare (skipped: no bundle)")
    assert "on a CPU the latency gate never accepts" in cpu[1]
    assert "torch.compile: failed" in result_line([E2E[1] | {"vs_compile": None},
                                                    {"variant": "torch_compile", "total_ms": None,
                                                     "notes": "failed: x"}])


def test_a_plan_says_when_acceptance_and_evaluation_will_end_past_the_budget():
    """llama-2-7b-serving's README run (H100, 2026-12-08): the check took the plan to 6:03 of 8:00 and acceptance
    plus evaluation were expected to need 4:51 more; the run ended near 10:00 and said so only by its clock. The plan
    now says it, with the budget that fits; a plan that fits says nothing."""
    late = planner.make_plan(_tasks("qwen3-4b-decode"), device="cuda", run_s=5.2, delta=0.02, budget_s=480,
                             elapsed_s=363)
    end = 363 + late.search_s + late.estimates.accept_s + late.estimates.evaluate_s
    assert end > 480
    note = next(ln for ln in late.lines(363) if "past the 8:00 budget" in ln)
    assert f"expected to end near {planner.fmt_s(end)}" in note
    assert f"--time-budget {math.ceil(end / 60)}m" in note
    early = planner.make_plan(_tasks("qwen3-4b-decode"), device="cuda", run_s=2.676, delta=0.02, budget_s=480,
                              elapsed_s=71)
    assert not any("past the" in ln for ln in early.lines(71))
    free = planner.make_plan(_tasks("qwen3-4b-decode"), device="cuda", run_s=2.676, delta=0.02, budget_s=None,
                             elapsed_s=363)
    assert free.overrun_note(363) is None
