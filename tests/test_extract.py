"""Task extraction on tiny HF models: phase-split tasks, grouping, sibling dispatch, artifacts that reproduce, and
non-deployable modules with their reasons."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP

from kernels_runtime.boundary import call_reference
from kernels_runtime.families import family_of
from llm4llm.extract import extract_tasks
from llm4llm.records import ModuleRecord, PhaseInfo, ProfileResult
from llm4llm.taskspec import load_task
from test_boundary import generate, tiny_model


def profile_of(model: torch.nn.Module) -> ProfileResult:
    """Every module in both phases, each with the same score: extraction decides on the captured calls alone."""
    records = [ModuleRecord(module_path=name, class_name=type(m).__name__, phase=phase, calls=1, time_ms=1.0,
                            share=0.1, hotspot_score=0.05, family=family_of(m, name=name, root=model))
               for phase in ("prefill", "decode") for name, m in model.named_modules()]
    phases = {p: PhaseInfo(phase=p, forwards=1, time_ms=10.0, weight=0.5) for p in ("prefill", "decode")}
    return ProfileResult(phases=phases, records=records, hardware={"device": "cpu"}, timer="perf_counter")


def extract(model, tmp_path, **kw):
    return extract_tasks(model, lambda: generate(model), profile_of(model), tmp_path, workload_name="tiny",
                         run_id="r1", **kw)


def find(specs, cls: str, phase: str, **match):
    found = [s for s in specs if s.module_class.endswith("." + cls) and s.phase == phase
             and all(getattr(s, k) == v for k, v in match.items())]
    assert found, f"no {cls} {phase} task among {[(s.module_class, s.phase) for s in specs]}"
    return found


def assert_task_reproduces(path):
    task = load_task(path)
    module = task.load_module()
    assert task.cases
    for case in task.cases:
        got = call_reference(module, case.weights, case.inputs, case.state, task.spec.static, task.spec.recipe)
        assert set(got) == set(case.ref)
        for name, ref in case.ref.items():
            assert torch.equal(got[name], ref), name
    return task


def test_qwen3_tasks_split_by_phase_grouped_and_round_trip(tmp_path):
    model = tiny_model("qwen3")
    specs = extract(model, tmp_path)

    prefill, = find(specs, "Qwen3Attention", "prefill")
    decode, = find(specs, "Qwen3Attention", "decode")
    for spec in (prefill, decode):
        assert spec.deployable, spec.reason
        assert spec.instances == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
        assert spec.hotspot_score == pytest.approx(0.1)
        assert spec.input_names == ["hidden_states", "position_ids", "position_embeddings.0", "position_embeddings.1"]
        assert spec.output_names == ["out", "state_out.key_cache", "state_out.value_cache"]
        assert "layer_idx" not in spec.static and spec.static["head_dim"] == 16
        assert {"q_proj.weight", "q_norm.weight", "k_norm.weight", "o_proj.weight"} <= set(spec.weight_names)
    assert prefill.state_names == [] and decode.state_names == ["key_cache", "value_cache"]
    assert prefill.dispatch.sibling_tasks == [decode.task_id] and decode.dispatch.sibling_tasks == [prefill.task_id]
    assert prefill.dispatch.phase == "prefill" and prefill.task_id != decode.task_id
    # 3 decode steps, one signature each (the cache grows): all captured, counted over both layers
    assert [c.state["key_cache"].shape for c in decode.cases] == [[1, 2, 16, 16], [1, 2, 17, 16], [1, 2, 18, 16]]
    assert [c.calls for c in decode.cases] == [2, 2, 2]

    # Qwen3RMSNorm: the hidden-size norms (4 per-layer + final) group apart from q_norm [B, S, 4, D] and
    # k_norm [B, S, 2, D]: same class and weights, different shapes
    norms = find(specs, "Qwen3RMSNorm", "prefill")
    assert sorted(len(s.instances) for s in norms) == [2, 2, 5]
    assert all(s.deployable for s in norms)
    mlp, = find(specs, "Qwen3MLP", "decode")
    assert mlp.input_names == ["x"] and len(mlp.instances) == 2

    for spec in specs:
        assert spec.deployable, (spec.module_class, spec.phase, spec.reason)
        task = assert_task_reproduces(tmp_path / spec.task_id)
        assert task.spec == spec
    ref = load_task(tmp_path / decode.task_id).reference()
    case = load_task(tmp_path / decode.task_id).cases[0]
    assert torch.equal(ref(case.inputs, case.weights, case.state, decode.static)["out"], case.ref["out"])


def test_max_cases_caps_captured_signatures_and_keeps_counts(tmp_path):
    model = tiny_model("llama")
    specs = extract(model, tmp_path, families=["attention"], max_cases=2)
    decode, = find(specs, "LlamaAttention", "decode")
    assert len(decode.cases) == 2 and len(decode.observed) == 3
    assert sum(c.calls for c in decode.observed) == 6
    assert len(load_task(tmp_path / decode.task_id).cases) == 2
    assert {s.family for s in specs} == {"attention"}


@pytest.mark.parametrize("model_type,cls,state", [
    ("mamba", "MambaMixer", ["conv_state", "ssm_state"]),
    ("mamba2", "Mamba2Mixer", ["conv_state", "ssm_state"]),
    ("recurrent_gemma", "RecurrentGemmaRecurrentBlock", ["conv_state", "rg_lru_state"]),
])
def test_stateful_mixers_extract_and_reproduce(tmp_path, model_type, cls, state):
    model = tiny_model(model_type)
    specs = extract(model, tmp_path, families=["ssm_mixer", "recurrent_block", "attention"])
    prefill, = find(specs, cls, "prefill")
    decode, = find(specs, cls, "decode")
    assert prefill.deployable and decode.deployable, (prefill.reason, decode.reason)
    assert decode.state_names == state
    assert decode.output_names == ["out"] + [f"state_out.{n}" for n in state]
    assert len(decode.instances) == 2 and decode.dispatch.sibling_tasks == [prefill.task_id]
    assert_task_reproduces(tmp_path / prefill.task_id)
    assert_task_reproduces(tmp_path / decode.task_id)
    if model_type == "recurrent_gemma":
        # the RG-LRU keeps its state on itself and no adapter owns it alone: not a boundary of its own
        lru = [s for s in specs if s.module_class.endswith(".RecurrentGemmaRglru")]
        assert lru and all(not s.deployable and "writes state kept on the module" in s.reason for s in lru)
        attn, = find(specs, "RecurrentGemmaAttention", "decode")
        assert attn.deployable and attn.recipe["state"]["adapter"] == "DynamicSlidingWindowLayer"


@pytest.mark.parametrize("model_type,cls", [("mamba", "MambaBlock"), ("mamba2", "Mamba2Block")])
def test_ssm_blocks_extract_and_reproduce(tmp_path, model_type, cls):
    """Mamba's and Mamba2's residual blocks (norm -> mixer -> residual add) are tasks of their own: the mixer's
    cache state through the block's boundary, the norm's epsilon and residual_in_fp32 as static values; a
    transformer's decoder layer stays a container."""
    model = tiny_model(model_type)
    assert family_of(tiny_model("llama").model.layers[0]) == "decoder_layer"
    specs = extract(model, tmp_path, families=["ssm_block"])
    prefill, = find(specs, cls, "prefill")
    decode, = find(specs, cls, "decode")
    assert {s.family for s in specs} == {"ssm_block"}
    assert prefill.deployable and decode.deployable, (prefill.reason, decode.reason)
    assert decode.state_names == ["conv_state", "ssm_state"]
    assert {"norm.weight", "mixer.in_proj.weight", "mixer.out_proj.weight"} <= set(decode.weight_names)
    assert "norm.variance_epsilon" in decode.static and "residual_in_fp32" in decode.static
    assert len(decode.instances) == 2
    assert_task_reproduces(tmp_path / decode.task_id)


class NoisyMLP(LlamaMLP):
    """Hidden randomness: noise drawn inside forward."""

    def forward(self, x):
        return super().forward(x) + torch.rand_like(x)


class DropoutMLP(LlamaMLP):
    """Hidden randomness: dropout left in train mode."""

    def __init__(self, config):
        super().__init__(config)
        self.drop = torch.nn.Dropout(0.5).train()

    def forward(self, x):
        return self.drop(super().forward(x))


def test_hidden_randomness_is_not_deployable(tmp_path):
    model = tiny_model("llama")
    layers = model.model.layers
    layers[0].mlp.__class__ = NoisyMLP
    dropout = DropoutMLP(model.config)
    dropout.load_state_dict(layers[1].mlp.state_dict())
    layers[1].mlp = dropout.train()
    specs = extract(model, tmp_path, families=["mlp", "norm"])
    for cls in ("NoisyMLP", "DropoutMLP"):
        for phase in ("prefill", "decode"):
            spec, = find(specs, cls, phase)
            assert not spec.deployable and spec.reason.startswith("not reproducible:"), spec.reason
            assert spec.cases == [] and spec.observed and not (tmp_path / spec.task_id).exists()
    assert all(s.deployable for s in specs if "MLP" not in s.module_class)


class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8))

    def forward(self, x, eps=1e-6):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weight


class _ToyLM(torch.nn.Module):
    """Calls its norm with a different static argument each time: no stable boundary."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.norm = _Norm()

    def forward(self, input_ids):
        h = self.embed(input_ids)
        return self.norm(self.norm(h, eps=1e-6), eps=1e-5)


def test_unstable_call_boundary_is_not_deployable(tmp_path):
    model = _ToyLM().eval()
    profile = ProfileResult(phases={}, records=[ModuleRecord("norm", "_Norm", "norm", "prefill", 2, 1.0,
                                                             hotspot_score=0.5)], hardware={}, timer="perf_counter")
    specs = extract_tasks(model, lambda: model(torch.randint(0, 16, (1, 5))), profile, tmp_path)
    spec, = specs
    assert not spec.deployable and spec.reason.startswith("unstable call boundary")
    assert "static eps" in spec.reason


def test_extract_from_the_real_profiler(tmp_path):
    profiler = pytest.importorskip("llm4llm.profiler")
    model = tiny_model("llama")
    profile = profiler.profile_model(model, lambda: generate(model), device="cpu")
    specs = extract_tasks(model, lambda: generate(model), profile, tmp_path)
    assert [s.hotspot_score for s in specs] == sorted((s.hotspot_score for s in specs), reverse=True)
    for phase in ("prefill", "decode"):
        attn, = find(specs, "LlamaAttention", phase)
        assert attn.deployable and len(attn.instances) == 2 and attn.hardware == profile.hardware


def _masked_or_not(mask: bool, eps: float = 1e-6):
    from kernels_runtime.boundary import BoundaryCall

    node = {"kind": "tensor", "name": "attention_mask"} if mask else {"kind": "none"}
    inputs = {"x": torch.zeros(2, 3), **({"attention_mask": torch.ones(2, 3, dtype=torch.bool)} if mask else {})}
    return BoundaryCall(inputs, {}, {"eps": eps}, {"args": [{"kind": "tensor", "name": "x"}],
                                                   "kwargs": {"attention_mask": node}, "state": None})


def test_a_mask_or_none_is_one_boundary_only_where_each_kind_of_call_was_captured():
    """Calls passing a tensor or None for one argument merge into one structure (the argument optional) when a case
    of each kind was captured and nothing else differs; a kind never captured (the verifier could not judge it), or
    another static value, keeps the phase unstable."""
    from collections import Counter

    from llm4llm.extract import _Observed, check_stable, merge_optional_inputs

    def observed(calls, captured):
        obs = _Observed(structures=Counter(c.structure_key() for c in calls))
        for c in captured:
            obs.calls.append(c.cloned())
            obs.call_structures.append(c.structure_key())
            obs.calls[-1].recipe["outputs"] = {"kind": "tensor", "name": "out"}
        return obs

    masked, plain = _masked_or_not(True), _masked_or_not(False)
    both = observed([masked, plain, plain], [masked, plain])
    merge_optional_inputs(both)
    assert check_stable(both) == "" and sum(both.structures.values()) == 3
    assert [c.recipe["kwargs"]["attention_mask"] for c in both.calls] == \
        [{"kind": "tensor", "name": "attention_mask", "optional": True}] * 2
    unjudged = observed([masked, plain], [masked])
    merge_optional_inputs(unjudged)
    assert check_stable(unjudged).startswith("unstable call boundary: 2 argument structures")
    other = _masked_or_not(False, eps=1e-5)
    static = observed([masked, other], [masked, other])
    merge_optional_inputs(static)
    assert "static eps" in check_stable(static)


def test_one_instance_keeps_each_corner_and_the_task_still_covers_every_shape(tmp_path, monkeypatch):
    """A serving regime's corners (here two prompt lengths) are kept once per class and weight shapes, not once per
    layer: the other layers keep only their own first call (batch 32 x 2048 tokens on every layer of a 4B model is
    more than a host's memory). The task's cases and the counted signatures are the same as before."""
    import llm4llm.extract as extract_mod

    kept: list[tuple[str, str, str]] = []
    original = extract_mod._Recorder._post

    def spy(self, path, module, args, kwargs, output):
        before = {key: len(o.calls) for key, o in self.observed.items()}
        original(self, path, module, args, kwargs, output)
        for (p, phase), o in self.observed.items():
            if p == path and len(o.calls) > before.get((p, phase), 0):
                kept.append((p, phase, o.calls[-1].shape_key()))

    monkeypatch.setattr(extract_mod._Recorder, "_post", spy)
    model = tiny_model("llama")
    layers = [n for n, m in model.named_modules() if type(m).__name__ == "LlamaMLP"]
    assert len(layers) >= 2
    specs = extract_tasks(model, lambda: (generate(model, 16), generate(model, 24)), profile_of(model), tmp_path,
                          workload_name="tiny", run_id="r1", families=["mlp"])
    prefill, = find(specs, "LlamaMLP", "prefill")
    assert len(prefill.cases) == 2 and len(prefill.observed) == 2  # both prompt lengths are cases of the task
    prefill_kept = [(p, k) for p, phase, k in kept if phase == "prefill"]
    assert sum(p == layers[0] for p, _ in prefill_kept) == 2  # the first layer keeps both corners
    for later in layers[1:]:  # every other layer its first call only
        assert sum(p == later for p, _ in prefill_kept) == 1
    assert_task_reproduces(tmp_path / prefill.task_id)


def test_a_16_bit_rerun_within_two_ulps_reproduces_and_more_does_not():
    """A 16-bit module's re-run may move an element by an ulp or two (kernel choice by operand address): two ulps of
    bf16 at 2 (0.03125, over the table's 0.01 + 0.01 x 2) reproduce; four do not, nor does any fp32 change outside
    the table."""
    from kernels_runtime.tolerances import compare
    from llm4llm.extract import _mismatch

    ref = torch.full((4, 8), 2.0, dtype=torch.bfloat16)
    ulp = 2.0 ** (1 - 7)  # bf16's spacing in [2, 4)
    two, four = ref.clone(), ref.clone()
    two[1, 3] += 2 * ulp
    four[1, 3] += 4 * ulp
    assert float(two[1, 3]) - 2.0 == 0.03125
    assert not compare(two, ref).ok and _mismatch(two, ref) == ""
    assert "max abs err" in _mismatch(four, ref)
    ref32 = ref.float()
    assert "max abs err" in _mismatch(ref32 + 0.05, ref32)
    # an element near 0 in an output of RMS 2: a reordered reduction rounds by the terms' size, so its ulps are
    # taken at the RMS (0.03125 passes here, as at 2); a change of 0.0625 there still does not
    small = ref.clone()
    small[0, 0] = 0.25
    near, far = small.clone(), small.clone()
    near[0, 0] += 0.03125
    far[0, 0] += 0.0625
    assert _mismatch(near, small) == "" and "max abs err" in _mismatch(far, small)


def test_the_static_cache_capture_records_decode_calls_only():
    """The second capture (on the static cache) serves the KV decode tasks only; a prompt's calls there carry the
    whole cache in and out at every layer (at a serving regime's largest corner, gigabytes of host memory), so they
    are not captured at all."""
    from kernels_runtime.phase import PhaseTracker
    from llm4llm.extract import _Recorder
    from tests.test_runtime_stateful import tiny

    model = tiny("llama")
    layers = {f"model.layers.{i}": layer for i, layer in enumerate(model.model.layers)}
    prompt = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    with PhaseTracker(model), _Recorder(layers, max_cases=4, phases=("decode",)) as rec, torch.inference_mode():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
                       pad_token_id=0)
    assert {phase for _, phase in rec.observed} == {"decode"}
    assert all(obs.calls for obs in rec.observed.values()) and len(rec.observed) == len(layers)


def test_a_class_whose_whole_share_is_below_delta_is_not_captured(tmp_path):
    """The acceptance's delta bounds what a task can bring end to end: a module class whose whole share in a phase
    is below it is not captured nor written (a serving regime's prefill corners are GBs a task), and its spec says
    why; every other class is extracted as before."""
    model = tiny_model("llama")
    profile = profile_of(model)
    for r in profile.records:  # prefill a sliver of the workload, decode the rest
        r.hotspot_score = 1e-4 if r.phase == "prefill" else 0.05
    specs = extract_tasks(model, lambda: generate(model), profile, tmp_path, workload_name="tiny", run_id="r1",
                          min_share=0.02)
    prefill = [s for s in specs if s.phase == "prefill"]
    assert prefill and not any(s.deployable for s in prefill)
    assert all("below delta: the whole prefill share of " in s.reason for s in prefill)
    assert not any((tmp_path / s.task_id).exists() for s in prefill)
    mlp = find(specs, "LlamaMLP", "decode")[0]
    assert mlp.deployable and (tmp_path / mlp.task_id).exists()
    assert_task_reproduces(tmp_path / mlp.task_id)
    kept = extract_tasks(model, lambda: generate(model), profile, tmp_path / "all", workload_name="tiny",
                         run_id="r1")
    assert any(s.deployable for s in kept if s.phase == "prefill")


def test_the_flow_skips_below_delta_only_where_its_plan_would():
    """The default run (the plan applies delta) captures nothing below it; `--top N` (the N hottest, whatever
    their share) and a run without acceptance capture everything."""
    from flows.optimize import _min_share
    from llm4llm.config import OptimizeConfig

    cfg = OptimizeConfig()
    assert _min_share(cfg) == cfg.accept.delta > 0
    assert _min_share(OptimizeConfig(search={"top": 1})) == 0.0
    assert _min_share(OptimizeConfig(stages=["profile", "extract", "search"])) == 0.0
