"""TileMix as a searchable, lossy kernel family: its template applies only to prefill attention tasks of workloads
that opted in; the verifier judges an opted-in TileMix candidate by the lossy bound and by the table otherwise; in
the model, a lossy candidate is never accepted without the opt-in, and with it answers to the workload's budget,
its coverage walked down until the budget holds (tiny Qwen3 on the CPU, Triton's interpreter)."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from kernels_runtime.bundle import PatchBundle, PatchSpec
from llm4llm import accept as acc
from llm4llm.accept import Proposal, budget_check, lossy_descent, lossy_of
from llm4llm.config import AcceptSettings
from llm4llm.search.builtin import LibraryProposer
from llm4llm.search.templates import TEMPLATES
from llm4llm.search.templates.tilemix import NAME
from llm4llm.taskspec import load_spec, seal_artifacts
from llm4llm.verify.gates import run_gates

ROOT = Path(__file__).resolve().parents[1]
TILEMIX = next(t for t in TEMPLATES if t.name == NAME)
BUDGET = {"max_logit_deviation": 0.5}


@pytest.fixture(scope="module")
def prefill_task(tiny_extracted) -> Path:
    """tiny-qwen3's prefill attention task (fp32: the interpreter's bf16 dot is wrong, see ops/_common.py)."""
    return next(d for d in tiny_extracted("tiny-qwen3")
                if load_spec(d).family == "attention" and load_spec(d).phase == "prefill")


def _with_budget(task_dir: Path, tmp_path: Path, budget: dict | None) -> Path:
    dst = tmp_path / task_dir.name
    shutil.copytree(task_dir, dst)
    spec = load_spec(dst)
    spec.accuracy_budget = budget
    (dst / "spec.json").write_text(spec.model_dump_json())
    seal_artifacts(dst)  # as an extraction with the budget would have written it
    return dst


def _config(spec, **over) -> dict:
    return {**TILEMIX.default(spec), "attn_BLOCK_M": 64, "attn_BLOCK_N": 64, "attn_num_warps": 4, **over}


def test_template_applies_only_to_opted_in_16bit_prefill_attention(prefill_task):
    spec = load_spec(prefill_task)
    assert "has not opted in" in TILEMIX.why_not(spec)
    opted = spec.model_copy(update={"accuracy_budget": BUDGET, "dtype": "bfloat16"})
    assert TILEMIX.why_not(opted) is None
    assert "bfloat16/float16" in TILEMIX.why_not(spec.model_copy(update={"accuracy_budget": BUDGET}))
    assert "not decode" in TILEMIX.why_not(opted.model_copy(update={"phase": "decode"}))
    proposer = LibraryProposer()
    assert NAME not in {t.name for t in proposer.templates_for(spec.model_copy(update={"dtype": "bfloat16"}))}
    assert NAME in {t.name for t in proposer.templates_for(opted)}
    # the search's configs carry the routing template and the coverage; the rendering declares them
    space = TILEMIX.space(opted)
    assert space["tm_template"] == ["sink_local", "bigbird", "row_random"] and 1.0 in space["tm_coverage"]
    src = TILEMIX.render(opted, _config(opted, tm_template="bigbird", tm_coverage=0.9))
    assert "'tm_coverage': 0.9" in src and "LOSSY = {" in src
    # an opted-in task is another task (its templates differ); the others keep their ids
    assert opted.content_id() != opted.model_copy(update={"accuracy_budget": None}).content_id()
    assert spec.task_id.startswith(spec.content_id())


@pytest.mark.parametrize("coverage", [1.0])
def test_verifier_judges_an_opted_in_candidate_by_the_lossy_bound_only(prefill_task, tmp_path, coverage):
    spec = load_spec(prefill_task)
    src = TILEMIX.render(spec, _config(spec, tm_coverage=coverage))
    plain, _ = run_gates(str(prefill_task), src, device="cpu", draws=1, timing=False)
    assert not plain.passed and plain.failure_class == "wrong_output", plain.message  # the table: INT8 is off
    opted = _with_budget(prefill_task, tmp_path, BUDGET)
    v, _ = run_gates(str(opted), src, device="cpu", draws=1, timing=False)
    assert v.passed, v.message
    assert any("lossy: rel-L2 vs" in g.detail for g in v.gates), [g.detail for g in v.gates]
    # the output attends over V replaced by K's projection (the cache as it should be): far outside the bound
    broken = src.replace("    return _entry(inputs, weights, state, static)",
                         '    bad = _entry(inputs, {**weights, "v_proj.weight": weights["k_proj.weight"]}, state, static)\n'
                         '    return {**_entry(inputs, weights, state, static), "out": bad["out"]}')
    assert broken != src
    v, _ = run_gates(str(opted), broken, device="cpu", draws=1, timing=False)
    assert not v.passed and v.failure_class == "wrong_output" and "lossy: rel-L2" in v.message


def test_the_sandboxed_verifier_judges_an_opted_in_candidate_by_the_lossy_bound(prefill_task, tmp_path):
    """The search verifies through the sandboxed worker, whose parent never imports the candidate: it reads the
    declared LOSSY routing from the source, and judges the draws (and, rehearsed here, the sampled timed calls)
    by the lossy bound, as the in-process path does. Before, the parent judged them by the table: every TileMix
    candidate of an opted-in workload failed wrong_output in `optimize`."""
    from llm4llm.verify import VerifierPool
    from llm4llm.verify.gates import lossy_of_source
    from llm4llm.taskspec import load_task

    spec = load_spec(prefill_task)
    src = TILEMIX.render(spec, _config(spec, tm_coverage=1.0))
    opted = _with_budget(prefill_task, tmp_path, BUDGET)
    assert lossy_of_source(src, load_task(opted)) == {"kind": "tilemix", "template": "sink_local", "coverage": 1.0}
    assert lossy_of_source(src, load_task(prefill_task)) is None  # not opted in: judged by the table
    with VerifierPool("cpu", timeout_s=300.0, draws=1) as pool:
        v = pool.verify(opted, src, rehearse_timing=True)
    assert v.passed, v.message
    assert any("lossy: rel-L2 vs" in g.detail for g in v.gates), [g.detail for g in v.gates]
    assert any(g.name == "timed_outputs" and "match the reference" in g.detail for g in v.gates)


def test_lossy_of_and_the_coverage_descent(prefill_task):
    spec = load_spec(prefill_task).model_copy(update={"accuracy_budget": BUDGET})
    config = _config(spec, tm_coverage=0.75)
    p = Proposal(str(prefill_task), "c1", TILEMIX.render(spec, config), 1.3, config, NAME)
    assert lossy_of(p) == {"template": "sink_local", "coverage": 0.75}
    assert lossy_of(Proposal("t", "c2", "from kernels_runtime.ops.tilemix_attention import x", 1.0)) == {}
    assert lossy_of(Proposal("t", "c3", "def entry(): ...", 1.0)) is None
    steps = lossy_descent(p, spec)
    assert [q.config["tm_coverage"] for q in steps] == [0.75, 0.5, 0.25]
    assert [q.candidate_id for q in steps] == ["c1", "c1@0.5", "c1@0.25"]
    assert "'tm_coverage': 0.25" in steps[-1].source and steps[-1].template == NAME


def test_a_rejected_coverage_step_is_remembered_at_its_coverage():
    from llm4llm.stages.experience import proposal_of, rejection_experience

    p = Proposal("t", "c1", "src", 1.2, {"tm_template": "bigbird", "tm_coverage": 0.9, "attn_BLOCK_M": 128}, NAME)
    step = proposal_of({"c1": p}, "c1@0.5")
    assert step.config == {**p.config, "tm_coverage": 0.5} and step.candidate_id == "c1@0.5"
    assert proposal_of({"c1": p}, "c1") is p and proposal_of({"c1": p}, "c2@0.5") is None
    d = acc.Decision("t", "c1@0.5", "rejected", "in-model correctness: accuracy_budget: ...", "", None, None, None,
                     None, 0.0, decided_by="in_model")
    [failing] = rejection_experience(d, step).failing
    assert failing.template == NAME and failing.config["tm_coverage"] == 0.5


def test_budget_check():
    ref = [torch.randn(1, 50) for _ in range(3)]
    new = [r + 0.01 * torch.randn(1, 50) for r in ref]
    agree = []
    both = {"max_logit_deviation": 0.05, "min_token_agreement": 0.9}
    ok = budget_check(ref, new, both, lambda: agree.append(1) or 1.0)
    assert ok.ok and ok.metric == "accuracy_budget" and ok.agreement == 1.0 and agree == [1]
    assert not budget_check(ref, new, {"max_logit_deviation": 1e-4}, lambda: 1.0).ok
    low = budget_check(ref, new, {"min_token_agreement": 0.9}, lambda: 0.5)
    assert not low.ok and "greedy token agreement 0.500 < 0.9" in low.detail
    bad = [n.clone() for n in new]
    bad[1][0, 3] = math.nan
    assert not budget_check(ref, bad, {"max_logit_deviation": 10.0}, lambda: 1.0).ok


def _workload(tmp_path: Path, budget: str | None) -> str:
    """tiny-qwen3's TOML in tmp_path, opted in with `budget` (the [accuracy_budget] table's lines) when given."""
    script = f'script = "{ROOT / "examples" / "scripts" / "hf_generate.py"}"'
    text = (ROOT / "examples" / "workloads" / "tiny-qwen3.toml").read_text()
    text = text.replace('script = "../scripts/hf_generate.py"', script + ("\nallow_lossy = true" if budget else ""))
    path = tmp_path / "w.toml"
    path.write_text(text + (f"\n[accuracy_budget]\n{budget}" if budget else ""))
    return str(path)


def test_acceptance_never_keeps_a_lossy_candidate_without_the_opt_in(prefill_task, tmp_path, capsys):
    spec = load_spec(prefill_task)
    config = _config(spec)
    p = Proposal(str(prefill_task), "c1", TILEMIX.render(spec, config), 5.0, config, NAME)
    res = acc.accept(_workload(tmp_path, None), [p], str(tmp_path / "bundle"), cfg=AcceptSettings())
    [d] = res.decisions
    assert d.decision == "rejected" and "has not opted in" in d.reason and res.bundle_dir is None
    # each decision is printed as it is made (a run stopped later still shows it)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith(f"accept: {d.task_id} c1: ")]
    assert lines == [f"accept: {d.task_id} c1: rejected ({d.decided_by}): {d.reason[:400]}"], lines


def test_acceptance_holds_a_lossy_candidate_to_the_budget_walking_the_coverage_down(prefill_task, tmp_path):
    spec = load_spec(prefill_task)
    config = _config(spec, tm_coverage=0.5)
    p = Proposal(str(prefill_task), "c1", TILEMIX.render(spec, config), 5.0, config, NAME)
    # an opted-in run whose budget nothing lossy can meet: every coverage from the proposed one down is tried
    tight = _workload(tmp_path, "max_logit_deviation = 1e-9\n")
    res = acc.accept(tight, [p], str(tmp_path / "b1"), cfg=AcceptSettings())
    assert [d.candidate_id for d in res.decisions] == ["c1", "c1@0.25"]  # 0.5, then the space's next lower
    for d in res.decisions:
        assert d.decision == "rejected" and d.reason.startswith("in-model correctness: accuracy_budget: logits")
        assert d.lossy["max_logit_deviation"] > 1e-9
    assert res.bundle_dir is None
    # within a budget, a trial goes on to the latency gate, which the CPU never passes: test_cpu_latency_gate_*
    # in test_accept.py; budget_check's own numbers: test_budget_check


def test_bundle_records_the_routing_and_the_budget():
    ps = PatchSpec(patch_id="t:c", module_class="m.C", kernel="", lossy={
        "template": "sink_local", "coverage": 0.75, "budget": {"max_logit_deviation": 0.06},
        "measured": {"max_logit_deviation": 0.05, "token_agreement": 1.0}})
    bundle = PatchBundle(name="b")
    bundle.add_patch(ps, source="def entry(inputs, weights, state, static):\n    return {}\n")
    again = PatchBundle.from_json(bundle.to_json())
    assert again.patches[0].lossy == ps.lossy


def _copied_past(state, k, v):
    """The host's past step as it was first written: past ++ new into fresh buffers, a prompt without a past too."""
    from kernels_runtime.hosts.attention_common import with_past

    k_all, sp = with_past(state.get("key_cache"), k)  # [B, Hkv, S_past + S, D]
    v_all, _ = with_past(state.get("value_cache"), v)
    return k_all, v_all, sp


def test_a_prompt_without_a_past_is_not_copied_and_gives_the_same_bits(monkeypatch):
    """The template's prompt path hands k, v to the kernel and the cache as they are: the same output and state
    bits as the host that first copied them into fresh buffers (its past step swapped back in), and the state-out is
    the rotary's own k and the projection's own v."""
    from types import SimpleNamespace

    import kernels_runtime.hosts.tilemix as host

    spec = SimpleNamespace(family="attention", phase="prefill", dtype="float32", static={}, hardware={})
    cfg = {**TILEMIX.default_fn(spec), "attn_BLOCK_M": 64, "attn_BLOCK_N": 64, "attn_num_warps": 4,
           "tm_coverage": 0.5}
    src = TILEMIX.render_fn(spec, cfg)
    assert "from kernels_runtime.hosts.tilemix import prefill_tilemix" in src
    g = torch.Generator().manual_seed(0)
    B, S, H, hq, hkv, D = 1, 96, 64, 4, 2, 32
    w = lambda o, i: torch.randn(o, i, generator=g) * i ** -0.5  # noqa: E731
    weights = {"q_proj.weight": w(hq * D, H), "k_proj.weight": w(hkv * D, H), "v_proj.weight": w(hkv * D, H),
               "o_proj.weight": w(H, hq * D), "q_norm.weight": torch.rand(D, generator=g) + 0.5,
               "k_norm.weight": torch.rand(D, generator=g) + 0.5}
    ang = torch.arange(S)[:, None] * 0.05 * torch.arange(1, D + 1)[None, :] / D
    inputs = {"hidden_states": torch.randn(B, S, H, generator=g), "position_embeddings.0": ang.cos()[None],
              "position_embeddings.1": ang.sin()[None]}
    static = {"head_dim": D, "scaling": D ** -0.5, "q_norm.variance_epsilon": 1e-6}
    outs = []
    for past in (host.prompt_or_past, _copied_past):
        monkeypatch.setattr(host, "prompt_or_past", past)
        ns: dict = {"__name__": "tilemix_candidate"}
        exec(compile(src, "<attention.prefill_tilemix>", "exec"), ns)  # noqa: S102
        outs.append(ns["entry"](inputs, weights, {}, static))
    new, old = outs
    for key in ("out", "state_out.key_cache", "state_out.value_cache"):
        assert torch.equal(new[key], old[key]), key
    assert old["state_out.value_cache"].is_contiguous() and not new["state_out.value_cache"].is_contiguous()
    assert new["state_out.value_cache"].shape == (B, hkv, S, D)
