"""`llm4llm export`: a bundle as a Hugging Face `kernels` package, loaded back through `kernels` itself (kernelize on
a tiny HF Llama, Triton under its interpreter), and apply's checks of where a bundle was verified."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from kernels_runtime.bundle import Guard, PatchSpec, load_bundle, save_bundle
from kernels_runtime.hub_export import ExportError, Outcome, export_bundle
from kernels_runtime.patch import BundleMismatchError, VERSION_CHANGE_ENV, apply, verified_on
from kernels_runtime.tolerances import assert_close
from tests.test_runtime import ATTENTION, ATTENTION_SOURCE, rmsnorm_bundle, tiny_llama

kernels = pytest.importorskip("kernels")  # a dev dependency: present wherever the suite runs


@pytest.fixture
def hub_rmsnorm(monkeypatch):
    """LlamaRMSNorm marked as kernels' `RMSNorm` seam (transformers 5.17 marks it only with kernels < 0.17)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    monkeypatch.setattr(LlamaRMSNorm, "kernel_layer_name", "RMSNorm", raising=False)
    monkeypatch.setattr(LlamaRMSNorm, "kernel_condition", staticmethod(lambda module: True), raising=False)
    return LlamaRMSNorm


def _mixed_bundle():
    """Two RMSNorm patches (prefill, decode) and a stateful attention patch."""
    bundle = rmsnorm_bundle()
    bundle.add_patch(PatchSpec(patch_id="attn-decode", module_class=ATTENTION, phase="decode",
                               guard=Guard(dtypes=["float32"], state_adapter="DynamicLayer"), kernel=""),
                     source=ATTENTION_SOURCE)
    return bundle


def test_exported_rmsnorm_runs_through_kernelize(tmp_path, hub_rmsnorm):
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
    from kernels._rust import Build

    out = export_bundle(save_bundle(_mixed_bundle(), tmp_path / "b"), tmp_path / "hub")
    assert out.layers == {"RMSNorm": ["rmsnorm-prefill", "rmsnorm-decode"]}
    attn = next(p for p in out.patches if p.patch_id == "attn-decode")
    assert attn.outcome is Outcome.NOT_A_LAYER and "kernels_runtime.apply" in attn.reason
    assert Build.open(out.path).general.backends  # build.toml parses as kernel-builder's config
    assert "attn-decode" in (out.path / "README.md").read_text()

    model, eager = tiny_llama(), tiny_llama()
    mapping = {"RMSNorm": {"cpu": LocalLayerRepository(out.path, layer_name="RMSNorm")}}
    with use_kernel_mapping(mapping):
        kernelize(model, mode=Mode.INFERENCE, device="cpu")
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = model(ids).logits, eager(ids).logits
    assert_close(got, want, torch.float32)
    norm = model.model.layers[0].input_layernorm
    assert type(norm).__name__ == "LlamaRMSNorm" and "1 kernel / 0 fallback" in repr(norm)
    assert sum(d.kernel_calls["prefill"] for d in _dispatches(model)) == 5  # 2 layers x 2 norms + the final norm


def _dispatches(model):
    return [m.__dict__["_llm4llm_hub_dispatch"] for m in model.modules() if "_llm4llm_hub_dispatch" in m.__dict__]


def test_exported_files_match_their_digest(tmp_path, hub_rmsnorm):
    from kernels._internals.digest import DigestVerificationResult, verify_digest
    from kernels._rust import Metadata

    out = export_bundle(rmsnorm_bundle(), tmp_path / "hub")
    variant = out.path / "build" / "torch-universal"
    meta = Metadata.read_from_file(variant / "metadata.json")
    assert str(meta.name) == "llm4llm-tiny-rmsnorm"
    assert isinstance(verify_digest(variant, metadata=meta, location=None), DigestVerificationResult.Success)
    layers = json.loads((variant / "llm4llm_tiny_rmsnorm" / "layers.json").read_text())
    forward = [["self", "POSITIONAL_OR_KEYWORD"], ["hidden_states", "POSITIONAL_OR_KEYWORD"]]
    assert layers["RMSNorm"]["forward"] == forward


def test_export_refuses_a_bundle_without_layer_seams(tmp_path):
    bundle = rmsnorm_bundle(instances=("model.layers.0.input_layernorm",))
    with pytest.raises(ExportError, match="expected a patch on a kernels layer seam.*targets instances"):
        export_bundle(bundle, tmp_path / "hub")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="expected a new or empty directory"):
        export_bundle(rmsnorm_bundle(), tmp_path / "taken")


def test_apply_refuses_another_model_config_in_one_line(tmp_path):
    model = tiny_llama()
    bundle = rmsnorm_bundle()
    bundle.model_fingerprint = verified_on(model)["model_fingerprint"]
    other = bundle.model_copy(update={"model_fingerprint": "0123456789abcdef"})
    other._sources = dict(bundle._sources)
    with pytest.raises(BundleMismatchError) as e:
        apply(model, load_bundle(save_bundle(other, tmp_path / "b")))
    assert "\n" not in str(e.value) and "verified on model config 0123456789abcdef" in str(e.value)
    assert not _patched(model)
    assert len(apply(model, bundle).applied) == 2  # the config it was verified on


def _patched(model):
    return [m for m in model.modules() if "_llm4llm_dispatch" in m.__dict__]


def test_apply_falls_back_once_on_a_torch_release_change(monkeypatch, caplog):
    model = tiny_llama()
    bundle = rmsnorm_bundle()
    bundle.library_versions = {"torch": "1.0.0"}
    monkeypatch.delenv(VERSION_CHANGE_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="kernels_runtime.patch"):
        report = apply(model, bundle)
    assert not report.applied and not _patched(model)
    assert len([r for r in caplog.records if "verified with torch 1.0 ->" in r.getMessage()]) == 1
    assert {s.reason.split(":")[0] for s in report.skipped} == {"versions"}
    with pytest.raises(BundleMismatchError, match="verified with torch 1.0"):
        apply(model, bundle, strict=True)
    monkeypatch.setenv(VERSION_CHANGE_ENV, "apply")
    assert len(apply(model, bundle).applied) == 2


def test_export_command(tmp_path, hub_rmsnorm):
    from typer.testing import CliRunner

    from cli.main import app

    path = save_bundle(_mixed_bundle(), tmp_path / "b")
    res = CliRunner().invoke(app, ["export", str(path), str(tmp_path / "hub")])
    assert res.exit_code == 0, res.output
    assert "rmsnorm-decode: layer RMSNorm" in res.output
    assert "attn-decode: not exported, attention boundary with DynamicLayer state" in res.output
    res = CliRunner().invoke(app, ["export", str(tmp_path / "nope"), str(tmp_path / "hub2")])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1 and "manifest.json" in res.output


def test_the_config_fingerprint_ignores_names_and_dtype_not_shapes():
    from kernels_runtime.bundle import config_fingerprint

    a, b = tiny_llama().config, tiny_llama(torch.bfloat16).config
    b._name_or_path, b.transformers_version = "someone/else", "0.0.1"
    assert config_fingerprint(a) == config_fingerprint(b)
    b.intermediate_size = 96
    assert config_fingerprint(a) != config_fingerprint(b)


def test_the_package_readme_snippet_loads_the_layers(tmp_path):
    """The mapping the package's README gives, run as written (the class marked there, not by the test)."""
    import re

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    out = export_bundle(rmsnorm_bundle(), tmp_path / "hub")
    snippet = re.search(r"```python\n(.*?)```", (out.path / "README.md").read_text(), re.S).group(1)
    model = tiny_llama()
    try:
        exec(snippet.replace('"cuda"', '"cpu"').replace("Mode.INFERENCE)", 'Mode.INFERENCE, device="cpu")'),
             {"model": model})
        with torch.no_grad():
            model(torch.ones(1, 3, dtype=torch.long))
    finally:
        for attr in ("kernel_layer_name", "kernel_condition"):
            if attr in vars(LlamaRMSNorm):
                delattr(LlamaRMSNorm, attr)
    assert sum(d.kernel_calls["prefill"] for d in _dispatches(model)) == 5
