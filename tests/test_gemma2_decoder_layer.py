"""Gemma-2's decoder layer (Gemma2DecoderLayer: sandwich norms, Gemma's fp32 (1 + w) RMSNorm, a gelu-tanh gated MLP,
the query_pre_attn_scalar scaling, sliding and global layers) fused whole on transformers' static KV cache by
decoder_layer.decode_static_gemma2, where decoder_layer.decode_static refuses it (its pre/post feedforward norms).

A seeded tiny Gemma-2 (hidden 64, GQA, layer 0 sliding, layer 1 global; random norm weights so that 1 + w is not
1) is profiled and extracted in-process with static_cache=True, at batch 1 and at a left-padded batch of 2; the
applicability check must judge the template applicable and a trial of its default must pass the verifier's gates
against the module's own output."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_hosts_decode import _check_source

GEMMA2 = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=128, sliding_window=16, query_pre_attn_scalar=24, layer_types=None)


def _layer_tasks(out: Path, batch: int) -> list:
    """The model's deployable decoder-layer decode tasks on the static cache (prompt 6, 2 new tokens)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llm4llm.extract import extract_tasks
    from llm4llm.profiler import profile_model

    config = AutoConfig.for_model("gemma2", vocab_size=128, max_position_embeddings=64, eos_token_id=None,
                                  bos_token_id=None, pad_token_id=0, **{k: v for k, v in GEMMA2.items() if v})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # Gemma initialises its norms at 0 (a scale of 1): random ones test the 1 + w
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    ids = torch.randint(1, 128, (batch, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding: row 1 two tokens shorter
        ids[1, :2], mask[1, :2] = 0, 0

    def run():
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2,
                                  do_sample=False, pad_token_id=0)

    profile = profile_model(model, run, device="cpu")
    specs = extract_tasks(model, run, profile, out, workload_name=f"tiny-gemma2-b{batch}",
                          families=["decoder_layer"], static_cache=True)
    return [(s, out / s.task_id) for s in specs if s.deployable and s.phase == "decode"]


def _verify(task_dir: Path, source: str, draws: int):
    from llm4llm.verify.gates import run_gates

    return run_gates(str(task_dir), source, device="cpu", draws=draws, timing=False)[0]


@pytest.mark.parametrize("batch", [1, 2])
def test_gemma2_decoder_layer_fused_on_the_static_cache(tmp_path, batch):
    from llm4llm.search.applicability import applicable_templates, check_templates
    from llm4llm.search.templates import TEMPLATES

    by_name = {t.name: t for t in TEMPLATES}
    template = by_name["decoder_layer.decode_static_gemma2"]
    tasks = _layer_tasks(tmp_path, batch)
    kinds = sorted(str(s.static.get("self_attn.sliding_window")) for s, _ in tasks)
    assert kinds == ["16", "None"], [s.task_id for s, _ in tasks]  # a sliding and a global layer
    for spec, task_dir in tasks:
        assert spec.recipe["state"]["adapter"] in ("StaticLayer", "StaticSlidingWindowLayer")
        # what covered it before: nothing (the Llama-style layer refuses the sandwich norms)
        assert "pre_feedforward_layernorm" in by_name["decoder_layer.decode_static"].why_not(spec)
        assert template.why_not(spec) is None, template.why_not(spec)
        checks = check_templates(task_dir, spec, [template], lambda path, source: _verify(path, source, draws=0))
        assert [(c.applicable, c.failure_class) for c in checks] == [(True, None)], checks
        (pinned,) = applicable_templates([template], checks)
        source = pinned.render(spec, pinned.default(spec))
        _check_source(source, template.name)  # a short source importing its host factory, as decode_static's
        assert "import decode_static_gemma2_layer" in source
        v = _verify(task_dir, source, draws=1)
        assert v.passed, f"{spec.task_id}: {v.failure_class}: {v.message}"
        assert v.max_abs_err is not None and v.max_abs_err < 1e-4, v.max_abs_err


def test_gemma2_template_refuses_what_it_does_not_compute():
    """Another layer class, another activation, Gemma-3's q/k norms: refused with the reason, never run."""
    from llm4llm.search.templates import TEMPLATES
    from llm4llm.taskspec import TaskSpec

    template = {t.name: t for t in TEMPLATES}["decoder_layer.decode_static_gemma2"]
    norms = [n + ".weight" for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                     "post_feedforward_layernorm")]
    weights = [f"self_attn.{n}_proj.weight" for n in "qkvo"] + [f"mlp.{n}_proj.weight" for n in ("gate", "up",
                                                                                                 "down")]
    static = {"mlp.act_fn.__class__": "GELUTanh", **{n.replace(".weight", ".eps"): 1e-6 for n in norms}}

    def spec(module="transformers.models.gemma2.modeling_gemma2.Gemma2DecoderLayer", extra=(), **st):
        return TaskSpec.model_construct(module_class=module, weight_names=weights + norms + list(extra),
                                        static={**static, **st}, state_names=[], cases=[],
                                        input_names=["hidden_states", "position_embeddings.0",
                                                     "position_embeddings.1"],
                                        recipe={}, phase="decode", family="decoder_layer")

    assert "Gemma2DecoderLayer" in template.applies_fn(spec("x.LlamaDecoderLayer"))
    assert "gelu-tanh" in template.applies_fn(spec(**{"mlp.act_fn.__class__": "NewGELUActivation"}))
    assert "q/k norms" in template.applies_fn(spec(extra=["self_attn.q_norm.weight", "self_attn.k_norm.weight"]))
    assert "static KV cache" in template.applies_fn(spec())  # no recipe: not a static-cache task
