"""decoder_layer.decode_static: a whole Llama / Qwen3 decoder layer in the decode step on transformers' static KV
cache (what decode graphs run on). The layer tasks of tiny-qwen3 (q/k norms, GQA 4/2) and tiny-llama, extracted on
the static cache (conftest's `+static`), fp32, Triton interpreter: the template's default rendering matches the
module on the captured call (the cache written in place at the device-side length, the length advanced) and passes
the verifier's gates; the dynamic-cache layer template still refuses these tasks and the new one refuses the
dynamic-cache task; in the model, every decode call of both layers takes the kernel, eagerly and from (emulated)
graphs."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels_runtime.boundary import STATE_OUT
from kernels_runtime.tolerances import assert_close
from llm4llm.taskspec import TaskSpec, load_task

WORKLOADS = Path(__file__).resolve().parents[1] / "examples" / "workloads"
NAME = "decoder_layer.decode_static"


def _template(name):
    from llm4llm.search.templates import TEMPLATES

    return next(t for t in TEMPLATES if t.name == name)


@pytest.fixture(scope="module")
def layer_task(tiny_extracted):
    """workload name (`tiny-qwen3+static`, ...) -> (the decoder-layer decode task dir, its Task)."""
    def get(name):
        d = next(d for d in tiny_extracted(name) if d.name.startswith("decoder_layer-decode-"))
        return d, load_task(d)

    return get


def test_only_the_static_layer_template_takes_the_static_layer_task(layer_task):
    """Scope: on the static cache the layer task carries an attention mask and the length as state, which the
    dynamic-cache template refuses and the static one takes; the static one refuses the dynamic-cache layer task."""
    static_spec = layer_task("tiny-qwen3+static")[1].spec
    dynamic_spec = layer_task("tiny-qwen3")[1].spec
    assert static_spec.recipe["state"]["adapter"] == "StaticLayer"
    assert static_spec.state_names == ["key_cache", "value_cache", "cache_len"] and static_spec.deployable
    assert "attention_mask" in static_spec.input_names
    assert _template(NAME).why_not(static_spec) is None
    assert _template(NAME).why_not(layer_task("tiny-llama+static")[1].spec) is None
    assert "key_cache and value_cache as state" in _template("decoder_layer.decode_fused").why_not(static_spec)
    assert _template("decoder_layer.decode_fused").why_not(dynamic_spec) is None
    assert "expected a static KV cache task" in _template(NAME).why_not(dynamic_spec)
    # out of scope: a weight the template does not read (StableLM's q/k LayerNorms), a soft-cap
    odd = static_spec.model_copy(update={"weight_names": [*static_spec.weight_names, "self_attn.q_layernorm.weight"]})
    assert "does not read" in _template(NAME).why_not(odd)
    capped = static_spec.model_copy(update={"static": {**static_spec.static, "self_attn.attn_logit_softcapping": 50.}})
    assert "soft-capping" in _template(NAME).why_not(capped)


@pytest.mark.parametrize("workload", ["tiny-qwen3+static", "tiny-llama+static"])
def test_static_layer_template_matches_the_module(layer_task, workload, tmp_path):
    """The default rendering on the captured call: the layer's output, and the cache written in place (state_out
    is the state-in tensors) at the device-side length only (16: the prompt), the length advanced to 17, as the
    module's own forward does; then the verifier's gates (captured case + a fresh draw) pass."""
    from llm4llm.verify.candidate import load_candidate, unload_candidate
    from llm4llm.verify.gates import run_gates

    task_dir, task = layer_task(workload)
    tpl = _template(NAME)
    source = tpl.render(task.spec, tpl.default(task.spec))
    mod = load_candidate(source, tmp_path, "static_layer_candidate")
    try:
        case = task.cases[0]
        assert int(case.state["cache_len"]) == 16
        state = {n: t.clone() for n, t in case.state.items()}
        out = mod.entry(dict(case.inputs), dict(case.weights), state, dict(task.spec.static))
    finally:
        unload_candidate("static_layer_candidate")
    for name in ("key_cache", "value_cache", "cache_len"):
        assert out[STATE_OUT + name] is state[name]
    assert_close(out["out"], case.ref["out"])
    for name in ("key_cache", "value_cache"):
        got, before = out[STATE_OUT + name], case.state[name]
        assert_close(got, case.ref[STATE_OUT + name], name=name)
        assert not torch.equal(got[:, :, 16], before[:, :, 16]), name  # written at the device-side position
        assert torch.equal(got[:, :, :16], before[:, :, :16]) and torch.equal(got[:, :, 17:], before[:, :, 17:])
    assert int(out[STATE_OUT + "cache_len"]) == 17
    v, _ = run_gates(str(task_dir), source, device="cpu", draws=1, timing=False)
    assert v.passed, f"{v.failure_class}: {v.message}"
    assert v.max_abs_err is not None and v.max_abs_err < 1e-4


def test_static_layer_fewest_launches_with_pdl_and_prefetch_pass(layer_task):
    """The seed with the fewest launches (unsplit: q/k/v written by its GEMV, gate/up paired in one launch, the
    post norm in gate/up's prologue), PDL on (the interpreter runs it as PREFETCH) and the prefetching loop on every
    stage: the gates pass."""
    from llm4llm.verify.gates import run_gates

    task_dir, task = layer_task("tiny-qwen3+static")
    tpl = _template(NAME)
    config = {**tpl.default(task.spec), "pdl": True, "attn_num_splits": 4, "attn_BLOCK_N": 16}
    config.update({p + "PREFETCH": True for p in ("qkv_", "o_", "gu_", "dn_")})
    assert config["pdl"] and config["post_norm"] == "gate_up_prologue"
    v, _ = run_gates(str(task_dir), tpl.render(task.spec, config), device="cpu", draws=1, timing=False)
    assert v.passed, f"{v.failure_class}: {v.message}"


def test_static_layer_with_tma_gate_up_and_down_passes(layer_task):
    """gate/up (norm prologue, SwiGLU, 64-row programs) and down (+ residual) with their weight tiles by TMA (the
    interpreter's tensor descriptors): the gates pass."""
    from llm4llm.verify.gates import run_gates

    task_dir, task = layer_task("tiny-qwen3+static")
    tpl = _template(NAME)
    config = {**tpl.default(task.spec), "attn_num_splits": 4, "attn_BLOCK_N": 16, "gu_TMA": 4, "gu_BLOCK_N": 64,
              "gu_BLOCK_K": 128, "gu_TMA_PRE": True, "dn_TMA": 3, "dn_BLOCK_N": 8, "dn_BLOCK_K": 128}
    source = tpl.render(task.spec, config)
    assert "'gu_TMA': 4" in source and "'dn_TMA': 3" in source  # the CONFIG line the host factory reads
    from kernels_runtime.ops import gemv as G

    launched = []
    real = G._gemv_tma_kernel
    G._gemv_tma_kernel = type("Spy", (), {"__getitem__": lambda self, grid: (launched.append(grid), real[grid])[1]})()
    try:
        v, _ = run_gates(str(task_dir), source, device="cpu", draws=1, timing=False)
    finally:
        G._gemv_tma_kernel = real
    assert v.passed, f"{v.failure_class}: {v.message}"
    assert launched, "the TMA pass never ran"


def test_static_layer_other_fusion_and_splits_pass(layer_task):
    """The other post_attention_layernorm boundary (gate/up's prologue), every GEMV stage split along K, two on the
    tl.dot path, the cache in 4 splits of 16 positions: the gates pass."""
    from llm4llm.verify.gates import run_gates

    task_dir, task = layer_task("tiny-qwen3+static")
    tpl = _template(NAME)
    config = {**tpl.default(task.spec), "post_norm": "gate_up_prologue", "attn_num_splits": 4, "attn_BLOCK_N": 16}
    for p in ("qkv_", "o_", "gu_", "dn_"):
        config.update({p + "SPLIT_K": 4, p + "BLOCK_K": 128, p + "BLOCK_N": 8})
    config.update({"qkv_DOT": True, "gu_DOT": True})
    v, _ = run_gates(str(task_dir), tpl.render(task.spec, config), device="cpu", draws=1, timing=False)
    assert v.passed, f"{v.failure_class}: {v.message}"


def test_static_layer_default_and_seeds_on_qwen3_4b_shapes():
    """qwen3-4b's layer shape, 132 SMs, an sm_90 task: the default is the four-GEMV layer (the post norm in gate/up's
    prologue) with PDL and the cache in 32 splits (8 KV heads x 32 >= 132, as attention.decode_static's seed); the
    seeds each change what runs and keep that split. Its GEMV stages already cover the SMs unsplit, so no
    occupancy seed. On an sm_80 task PDL is neither the default nor in the space."""
    from llm4llm.taskspec import CaseSig, TensorSig

    tpl = _template(NAME)
    static = {"self_attn.head_dim": 128, "self_attn.q_proj.in_features": 2560, "self_attn.q_proj.out_features": 4096,
              "self_attn.k_proj.out_features": 1024, "mlp.hidden_size": 2560, "mlp.intermediate_size": 9728}
    spec = TaskSpec(family="decoder_layer", module_class="x.Qwen3DecoderLayer", instances=["l"], phase="decode",
                    input_names=["hidden_states"], weight_names=["self_attn.q_proj.weight"], output_names=["out"],
                    cases=[CaseSig(inputs={}, outputs={"out": TensorSig(shape=[1, 1, 2560], dtype="bfloat16")})],
                    dtype="bfloat16", static=static, hardware={"sm_count": 132, "capability": "9.0"})
    default, seeds = tpl.default(spec), tpl.seeds(spec)
    assert default["post_norm"] == "gate_up_prologue" and default["pdl"] is True
    assert all(c["attn_num_splits"] == 32 and c["attn_BLOCK_N"] == 32 for c in [default, *seeds])
    assert all(default[p + "SPLIT_K"] == 1 for p in ("qkv_", "o_", "gu_", "dn_"))
    assert len({tuple(sorted(c.items())) for c in [default, *seeds]}) == 1 + len(seeds)  # each seed runs another point
    *tma, pipelined, o_reduce, first, second = seeds
    assert len(tma) == 3 and all(c["gu_TMA"] and c["gu_TMA_PRE"] and not c["dn_TMA"] for c in tma)
    assert [c["gu_BLOCK_N"] for c in tma] == [16, 32, 32] and tma[0]["gu_TMA_LATE"]
    assert pipelined["num_stages"] == 3 and o_reduce["post_norm"] == "o_reduce"
    assert first["qkv_BLOCK_N"] == 8 and first["qkv_BLOCK_K"] == 512
    assert all(second[p + "SPLIT_K"] == 2 for p in ("qkv_", "o_", "gu_", "dn_"))
    # on a GPU with more SMs than o_proj's 640 four-row programs, the occupancy split comes after the TMA seeds
    wide = spec.model_copy(update={"hardware": {"sm_count": 1024, "capability": "9.0"}})
    assert any(v > 1 for k, v in tpl.seeds(wide)[4].items() if k.endswith("SPLIT_K")), tpl.seeds(wide)[4]
    ampere = spec.model_copy(update={"hardware": {"sm_count": 108, "capability": "8.0"}})
    assert tpl.default(ampere)["pdl"] is False and tpl.space(ampere)["pdl"] == [False]
    assert not any(c["pdl"] or c["gu_TMA"] or c["dn_TMA"] for c in tpl.seeds(ampere))
    assert tpl.space(ampere)["gu_TMA"] == [0] and tpl.space(ampere)["dn_TMA"] == [0]
    assert tpl.space(ampere)["gu_TMA_PRE"] == [False] == tpl.space(ampere)["dn_TMA_LATE"]


def test_patched_model_runs_the_static_layer_in_every_decode_step(layer_task):
    """In the model: generate on the static cache with the layer candidate installed: every decode call of both
    layers takes the kernel (none falls back), the teacher-forced logits match the unpatched model's, eagerly and
    with the decode steps replayed from (emulated: closure re-run) graphs."""
    from static_patched import check_static_decode_in_model

    task = layer_task("tiny-qwen3+static")[1]
    tpl = _template(NAME)
    # 32-row GEMV blocks: a quarter of the default's programs to interpret (0.26 s a layer call against 0.65 s)
    config = {**tpl.default(task.spec), **{p + "BLOCK_N": 32 for p in ("qkv_", "o_", "gu_", "dn_")}}
    check_static_decode_in_model(str(WORKLOADS / "tiny-qwen3.toml"), task.spec, tpl.render(task.spec, config),
                                 "static-layer", modules=["model.layers.0", "model.layers.1"])
