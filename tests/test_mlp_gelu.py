"""mlp.gelu: GELU MLPs with bias (GPT-NeoX, Phi, GPT-J, GPT-2's Conv1D, StarCoder2, Falcon without bias).

The name pre-filter on synthetic specs; the default rendering against transformers' own MLP modules (seeded random
weights, fp32 and bf16, against the module and against a float64 copy of it); and tiny GPT-NeoX and Phi models
through optimize, where the applicability check (llm4llm/search/applicability.py) runs the template on the
captured calls and a trial passes the verifier."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_generality import _toml

from kernels_runtime.boundary import module_static, weights_of
from kernels_runtime.tolerances import assert_close, compare_floor
from llm4llm.search.templates import TEMPLATES
from llm4llm.taskspec import TaskSpec
from storage import repo
from storage.db import Database

GELU = next(t for t in TEMPLATES if t.name == "mlp.gelu")
SWIGLU = next(t for t in TEMPLATES if t.name == "mlp.swiglu")


def _spec(weight_names, static, phase="prefill", dtype="float32") -> TaskSpec:
    return TaskSpec(task_id="t", workload="w", run_id="r", family="mlp", module_class="m.MLP", instances=["a"],
                    phase=phase, input_names=["hidden_states"], weight_names=list(weight_names), output_names=["out"],
                    static=dict(static), dtype=dtype, cases=[])


def _names(up, down, bias=True):
    return [f"{p}.{k}" for p in (up, down) for k in (("weight", "bias") if bias else ("weight",))]


# ---- the name pre-filter -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("up,down,act_key,act,form", [
    ("dense_h_to_4h", "dense_4h_to_h", "act.__class__", "GELUActivation", "none"),  # GPT-NeoX, Falcon
    ("fc1", "fc2", "activation_fn.__class__", "NewGELUActivation", "tanh"),  # Phi
    ("fc_in", "fc_out", "act.__class__", "NewGELUActivation", "tanh"),  # GPT-J, CodeGen
    ("c_fc", "c_proj", "act.__class__", "GELUTanh", "tanh"),  # StarCoder2, GPT-BigCode
])
def test_gelu_mlps_pass_the_prefilter_and_swiglu_does_not_claim_them(up, down, act_key, act, form):
    from llm4llm.search.templates.mlp import _gelu_form

    for phase in ("prefill", "decode"):
        spec = _spec(_names(up, down), {act_key: act}, phase)
        assert GELU.why_not(spec) is None and _gelu_form(spec) == form
        assert SWIGLU.why_not(spec) is not None
        src = GELU.render(spec, GELU.default(spec))
        assert f"up={up!r}, down={down!r}, form={form!r}" in src and "transpose_up=False, transpose_down=False" in src


def test_prefilter_reads_nn_gelu_and_conv1d_and_rules_out_the_rest():
    from llm4llm.search.templates.mlp import _gelu_form

    assert _gelu_form(_spec(_names("dense_h_to_4h", "dense_4h_to_h"), {"act.__class__": "GELU",
                                                                        "act.approximate": "tanh"})) == "tanh"
    conv1d = _spec(_names("c_fc", "c_proj"), {"act.__class__": "NewGELUActivation", "c_fc.nf": 128, "c_proj.nf": 32})
    src = GELU.render(conv1d, GELU.default(conv1d))
    assert "up='c_fc', down='c_proj'" in src and "transpose_up=True, transpose_down=True" in src
    bias_free = _spec(_names("dense_h_to_4h", "dense_4h_to_h", bias=False), {"act.__class__": "GELUActivation"})
    assert GELU.why_not(bias_free) is None
    assert "GELU activation" in GELU.why_not(_spec(_names("fc1", "fc2"), {"activation_fn.__class__": "SiLU"}))
    assert "GELU activation" in GELU.why_not(_spec(_names("fc1", "fc2"), {}))
    swiglu = _spec(["gate_proj.weight", "up_proj.weight", "down_proj.weight"], {"act_fn.__class__": "GELUActivation"})
    assert "up/down pairs" in GELU.why_not(swiglu)
    extra = _spec([*_names("fc1", "fc2"), "ln.weight"], {"activation_fn.__class__": "GELUActivation"})
    assert "got also ['ln.weight']" in GELU.why_not(extra)


# ---- the rendering against transformers' modules ----------------------------------------------------------------

def _mlp(model_type: str, cfg: dict) -> torch.nn.Module:
    import transformers

    from kernels_runtime.families import family_of

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **cfg))
    mlp = next(m for n, m in model.named_modules() if family_of(m, name=n, root=model) == "mlp")
    with torch.no_grad():  # HF initialises biases to zero: random ones, so the biases are tested
        for name, p in mlp.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if name.endswith("bias") else p.shape[-1] ** -0.5))
    return mlp.eval()


MODULES = {
    "gpt_neox": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=128),
    "phi": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=128),
    "gptj": dict(n_embd=32, n_layer=1, n_head=2, vocab_size=128, rotary_dim=8, n_positions=64, n_inner=64),
    "gpt2": dict(n_embd=32, n_layer=1, n_head=2, vocab_size=128, n_positions=64, n_inner=64),
    "starcoder2": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                       intermediate_size=64, vocab_size=128),
    "falcon": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=128, ffn_hidden_size=64),
}


def _entry(source: str, tmp_path: Path, name: str):
    from llm4llm.verify.candidate import load_candidate

    return load_candidate(source, tmp_path, name).entry


# both dtypes for the two architectures that also go through optimize; bf16 (the rounding-sensitive path) for the rest
@pytest.mark.parametrize("model_type,dtype", [(m, d) for m in MODULES for d in (torch.float32, torch.bfloat16)
                                              if d == torch.bfloat16 or m in ("gpt_neox", "phi")])
def test_default_rendering_computes_what_the_hf_module_does(tmp_path, model_type, dtype):
    """Prefill (M = 14, the dot path) and decode (M = 2, the GEMV path) calls of the default config against the
    module: fp32 within the table of the module and of its float64 copy; bf16 within the verifier's rounding floor
    (no farther from the fp32 and the float64 module than twice the bf16 module is)."""
    mlp = _mlp(model_type, MODULES[model_type])
    static, weights = module_static(mlp), weights_of(mlp)
    exact = mlp.double()
    w64 = {k: v.detach().clone() for k, v in weights_of(exact).items()}
    g = torch.Generator().manual_seed(1)
    for phase, lead in (("prefill", (2, 7)), ("decode", (2, 1))):
        spec = _spec(list(weights), static, phase, str(dtype).removeprefix("torch."))
        assert GELU.why_not(spec) is None
        entry = _entry(GELU.render(spec, GELU.default(spec)), tmp_path, f"gelu_{model_type}_{phase}_{str(dtype)[6:]}")
        x64 = torch.randn(*lead, 32, generator=g, dtype=torch.float64) * 2
        x = x64.to(dtype)
        with torch.no_grad():
            ref64 = exact(x.double())
            ref = mlp.to(dtype)(x)
            ref32 = mlp.float()(x.float())
            mlp.double()
        out = entry({"hidden_states": x}, {k: v.to(dtype) for k, v in w64.items()}, {}, static)["out"]
        assert out.shape == ref.shape and out.dtype == dtype
        if dtype == torch.float32:
            assert_close(out, ref, name=f"{model_type} {phase} vs the module")
            assert_close(out, ref64.float(), name=f"{model_type} {phase} vs float64")
        else:  # within the verifier's rounding floor of the fp32 module, and of the float64 one
            for name, exact_ref in (("fp32", ref32), ("float64", ref64)):
                rep = compare_floor(out, ref, exact_ref, dtype)
                assert rep.ok, f"{model_type} {phase} vs the {name} module: {rep.reason}"


# ---- tiny models through optimize -------------------------------------------------------------------------------

ARCHS = {
    "gpt_neox": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                     vocab_size=128, rotary_pct=0.5, max_position_embeddings=64),
    "phi": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=128,
                partial_rotary_factor=0.5, max_position_embeddings=64),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gelu_mlp_through_optimize(prefect_harness, tmp_path, arch):
    """The MLP tasks of both phases: mlp.gelu judged applicable by running it, mlp.swiglu not a candidate, and the
    trial on each passes the verifier."""
    from flows.optimize import optimize_workload
    from llm4llm.config import STAGES, OptimizeConfig

    db_path = str(tmp_path / "l4l.duckdb")
    run_cfg = OptimizeConfig(stages=list(STAGES[:STAGES.index("search") + 1]),
                             search={"budget": 1, "top": 1, "families": ["mlp"]})
    optimize_workload(str(_toml(tmp_path / "w.toml", arch, ARCHS[arch])), run_cfg, db_path=db_path,
                      data_dir=str(tmp_path / "data"))
    with Database(db_path) as db:
        checks = repo.template_check_rows(db).to_dict("records")
        cands = repo.candidate_rows(db).to_dict("records")
    gelu = [c for c in checks if c["template"] == "mlp.gelu"]
    assert len(gelu) == 1 and all(c["applicable"] and c["stage"] == "computation" for c in gelu), checks
    assert not any(c["applicable"] for c in checks if c["template"] == "mlp.swiglu"), checks
    assert {c["template"] for c in cands} == {"mlp.gelu"} and len(cands) == 1, cands
    assert all(c["passed"] for c in cands), [c["message"][:300] for c in cands]
