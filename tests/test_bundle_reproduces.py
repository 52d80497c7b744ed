"""The bundle alone reproduces the configuration it was made with: saved to disk, loaded by the serving code's
`kernels_runtime.apply` into a freshly built model, `generate` runs the fused decode kernels (decoder layer, MLP,
lm_head templates over kernels_runtime.ops.gemv) on every decode call, none falls back, and the tokens are eager's.
Tiny Qwen3 in float32 on the CPU (Triton's interpreter)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels_runtime
from kernels_runtime.bundle import PatchBundle, PatchSpec, load_bundle, save_bundle
from llm4llm.search.templates import TEMPLATES
from llm4llm.taskspec import TaskSpec
from llm4llm.workload import load_script, load_workload

WORKLOAD = Path(__file__).resolve().parents[1] / "examples" / "workloads" / "tiny-qwen3.toml"
QWEN3 = "transformers.models.qwen3.modeling_qwen3"


def _source(template: str, family: str, module_class: str) -> str:
    t = next(t for t in TEMPLATES if t.name == template)
    spec = TaskSpec(family=family, module_class=module_class, instances=[], phase="decode", input_names=[],
                    weight_names=[], output_names=["out"], cases=[], dtype="float32")
    return t.render(spec, {**t.default(spec), **({"qkv_SPLIT_K": 2, "dn_SPLIT_K": 2} if family == "decoder_layer"
                                                  else {})})


@pytest.mark.slow
def test_saved_bundle_applied_to_a_fresh_model_reproduces_eager_generate(tmp_path):
    wl = load_workload(str(WORKLOAD))
    script = load_script(wl)
    bundle = PatchBundle(name="decode-fused")
    # layer 0: the whole decoder layer; layer 1: its MLP alone (the finer task beside it); the lm_head
    bundle.add_patch(PatchSpec(patch_id="layer", module_class=f"{QWEN3}.Qwen3DecoderLayer", phase="decode",
                               instances=["model.layers.0"], kernel=""),
                     source=_source("decoder_layer.decode_fused", "decoder_layer", f"{QWEN3}.Qwen3DecoderLayer"))
    bundle.add_patch(PatchSpec(patch_id="mlp", module_class=f"{QWEN3}.Qwen3MLP", phase="decode",
                               instances=["model.layers.1.mlp"], kernel=""),
                     source=_source("mlp.decode_gemv", "mlp", f"{QWEN3}.Qwen3MLP"))
    bundle.add_patch(PatchSpec(patch_id="lm_head", module_class="torch.nn.modules.linear.Linear", phase="decode",
                               instances=["lm_head"], kernel=""),
                     source=_source("lm_head.gemv", "lm_head", "torch.nn.modules.linear.Linear"))
    path = save_bundle(bundle, tmp_path / "bundle")
    del bundle

    eager_model = script.build(wl)
    prompt = script.inputs(wl)
    with torch.no_grad():
        expected = script.run(eager_model, wl, prompt)
    model = script.build(wl)  # the serving code: a fresh model, the bundle from disk
    report = kernels_runtime.apply(model, load_bundle(path), strict=True)
    with torch.no_grad():
        got = script.run(model, wl, prompt)
    assert torch.equal(got, expected)
    steps = wl.decode_len - 1  # generate's first token comes from prefill
    assert report.calls_of("layer") == steps and report.calls_of("mlp") == steps
    assert report.calls_of("lm_head") == steps
    for path, c in report.counters().items():  # the only fallbacks: prefill calls, which have no kernel here
        assert set(c["fallback"]) <= {"phase: no kernel for prefill"}, (path, c)
    kernels_runtime.revert(model)
