"""Architectures nobody tuned for: templates decided applicable by running them (llm4llm/search/applicability.py),
Falcon-Mamba's dt/B/C norms as a Mamba template option, LayerNorm and fused gate_up MLPs, and tiny transformers
models of six architectures beyond the examples through optimize (search and acceptance)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llm4llm.search.applicability import check_templates
from llm4llm.search.templates.base import Template
from llm4llm.taskspec import TaskSpec
from storage import repo
from storage.db import Database

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "scripts" / "hf_generate.py"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "workloads"


# ---- the check itself, with a fake verifier ----------------------------------------------------------------------

def _spec(**kw) -> TaskSpec:
    base = dict(task_id="t", workload="w", run_id="r", family="norm", module_class="m.X", instances=["a"],
                phase="decode", input_names=["x"], weight_names=["weight"], state_names=[], output_names=["out"],
                dtype="float32", cases=[])
    return TaskSpec.model_validate({**base, **kw})


def _template(name: str, options=()) -> Template:
    return Template(name=name, family="norm", phases=("decode",), requires=(),
                    space_fn=lambda s: {"w": [1, 2], "opt": [False, True]},
                    render_fn=lambda s, c: f"{name}:{c['opt']}", options=options)


def test_check_rules_out_mismatch_pins_a_matching_option_and_keeps_inconclusive(tmp_path):
    verdicts = {"same:False": {"passed": True}, "other:False": {"passed": False, "failure_class": "wrong_output",
                                                                 "message": "max abs err 3.1"},
                "other:True": {"passed": False, "failure_class": "wrong_output", "message": "max abs err 2.0"},
                "opt:False": {"passed": False, "failure_class": "wrong_output", "message": "off by the norm"},
                "opt:True": {"passed": True}, "slow:False": {"passed": False, "failure_class": "timeout",
                                                             "message": "no verdict"}}
    seen = []

    def verify(path, source):
        seen.append(source)
        return verdicts[source]

    spec = _spec()
    checks = {c.template: c for c in check_templates(
        tmp_path, spec, [_template("same"), _template("other"), _template("opt", ("opt",)), _template("slow")],
        verify)}
    assert checks["same"].applicable and checks["same"].pinned == {}
    assert not checks["other"].applicable and checks["other"].failure_class == "wrong_output"
    assert "computes something else" in checks["other"].reason and "3.1" in checks["other"].reason
    assert "other:True" not in seen  # "opt" is no option of "other": only its default is run
    assert checks["opt"].applicable and checks["opt"].pinned == {"opt": True}
    assert checks["slow"].applicable and "inconclusive" in checks["slow"].reason
    pinned = _template("opt", ("opt",)).pinned({"opt": True})
    assert pinned.space(spec)["opt"] == [True] and pinned.default(spec)["opt"] is True


# ---- Falcon-Mamba's norms, op level -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bcdt_rmsnorm_matches_falcon_mambas_weightless_norms(dtype):
    from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaWeightlessRMSNorm

    from kernels_runtime.ops.bcdt_rmsnorm import bcdt_rmsnorm

    R, N, eps = 5, 12, 1e-6
    p = (torch.randn(3, 7, R + 2 * N) * 3).to(dtype)
    dt, b, c = torch.split(p, [R, N, N], dim=-1)
    ref = torch.cat([FalconMambaWeightlessRMSNorm(R, eps)(dt), FalconMambaWeightlessRMSNorm(N, eps)(b),
                     FalconMambaWeightlessRMSNorm(N, eps)(c)], dim=-1)
    out = bcdt_rmsnorm(p, R, N, eps)
    assert out.dtype == dtype and out.shape == p.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)


@pytest.mark.parametrize("fused_xproj", [False, True])
def test_fused_state_update_applies_the_norms_as_hf(fused_xproj):
    """mamba_dt_state_update(rms_eps=...) against HF's FalconMambaMixer decode arithmetic in fp32 (dt, B, C normed
    after x_proj), both with x_proj's output given and computed inside the kernel."""
    from kernels_runtime.ops.mamba_decode import mamba_dt_state_update

    torch.manual_seed(1)
    Bsz, I, N, R, eps = 2, 24, 8, 3, 1e-6
    xw, dtw, dtb = torch.randn(R + 2 * N, I), torch.randn(I, R) * 0.5, torch.randn(I) * 0.1
    A_log, D = torch.log(torch.arange(1, N + 1).float()).expand(I, N).contiguous(), torch.randn(I)
    xc, z, h0 = torch.randn(Bsz, I), torch.randn(Bsz, I), torch.randn(Bsz, I, N)
    p = xc @ xw.T
    norm = lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)  # noqa: E731
    dt_low, Bm, Cm = norm(p[:, :R]), norm(p[:, R:R + N]), norm(p[:, R + N:])
    dt = torch.nn.functional.softplus(dt_low @ dtw.T + dtb)
    h = torch.exp(dt[..., None] * -torch.exp(A_log)) * h0 + dt[..., None] * Bm[:, None, :] * xc[..., None]
    y = ((h * Cm[:, None, :]).sum(-1) + xc * D) * torch.nn.functional.silu(z)
    out, state = mamba_dt_state_update(None if fused_xproj else p, dtw, dtb, A_log, D, xc, z, h0, BLOCK_D=8,
                                       x_proj_w=xw if fused_xproj else None, rms_eps=eps)
    torch.testing.assert_close(out, y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, h, atol=1e-4, rtol=1e-4)


# ---- six architectures through optimize --------------------------------------------------------------------------

ARCHS = {
    # model_type: (config, families searched, top, stages, templates that must cover, templates found inapplicable)
    "falcon_mamba": (dict(hidden_size=32, num_hidden_layers=1, vocab_size=128, state_size=8, expand=2,
                          conv_kernel=4), ["ssm_block"], 2, "accept",
                     {"ssm_block.mamba", "ssm_block.mamba_decode_fused"}, set()),
    "phi3": (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                  intermediate_size=64, vocab_size=128, max_position_embeddings=64, pad_token_id=0), ["mlp"], 1,
             "accept", {"mlp.swiglu"}, set()),
    "gpt_neox": (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                      vocab_size=128, rotary_pct=0.5, max_position_embeddings=64), ["norm"], 1, "accept",
                 {"norm.layernorm"}, set()),
    "stablelm": (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=128, partial_rotary_factor=0.25, max_position_embeddings=64),
                 ["mlp"], 1, "accept", {"mlp.swiglu"}, set()),  # attention: tests/test_attention_generality.py
    "mistral": (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=64, vocab_size=128, sliding_window=8, max_position_embeddings=64),
                ["norm"], 1, "accept", {"norm.rmsnorm_op"}, set()),  # attention: tests/test_attention_generality.py
    "gemma2": (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    intermediate_size=64, vocab_size=128, sliding_window=8, max_position_embeddings=64),
               ["norm"], 1, "accept", {"norm.rmsnorm_gemma"}, set()),
}


def _toml(path: Path, model_type: str, cfg: dict) -> Path:
    lines = [f'name = "tiny-{model_type}"', f'script = "{SCRIPT}"', 'dtype = "float32"', 'device = "cpu"',
             "batch_size = 1", "prompt_len = 8", "decode_len = 2", "seed = 0", "[model]",
             f'model_type = "{model_type}"', "[model.config]", *(f"{k} = {json.dumps(v)}" for k, v in cfg.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("arch", list(ARCHS))
def test_architecture_through_optimize(prefect_harness, tmp_path, arch):
    """What was covered, found inapplicable (by running it) or rejected; no trial on an inapplicable template."""
    from flows.optimize import optimize_workload
    from llm4llm.config import STAGES, OptimizeConfig
    from llm4llm.coverage import coverage_of_run
    from storage.store import Store

    cfg, families, top, last, must_cover, must_fail = ARCHS[arch]
    db_path = str(tmp_path / "l4l.duckdb")
    run_cfg = OptimizeConfig(stages=list(STAGES[:STAGES.index(last) + 1]),
                             search={"budget": 1, "top": top, "families": families},
                             accept={"repeats": 1, "noisy_rounds": 0})
    out = optimize_workload(str(_toml(tmp_path / "w.toml", arch, cfg)), run_cfg, db_path=db_path,
                            data_dir=str(tmp_path / "data"))
    with Database(db_path) as db:
        checks = repo.template_check_rows(db).to_dict("records")
        cands = repo.candidate_rows(db).to_dict("records")
        acc = db.query_df("SELECT task_id, decision, reason FROM acceptances").to_dict("records")
    ok = {c["template"] for c in checks if c["applicable"]}
    bad = {(c["task_id"], c["template"]) for c in checks if not c["applicable"] and c["stage"] == "computation"}
    assert must_cover <= ok, checks
    assert must_fail <= {t for _, t in bad}, checks
    assert cands and all(c["passed"] for c in cands), [(c["template"], c["message"][:200]) for c in cands]
    assert not {(c["task_id"], c["template"]) for c in cands} & bad  # no budget on an inapplicable template
    assert {c["template"] for c in cands} <= ok
    if arch == "falcon_mamba":
        assert all(json.loads(c["pinned_json"]) == {"xproj_rms": True} for c in checks if c["applicable"])
    if last == "accept":  # the CPU never accepts (no CPU timing may), but the kernel ran in-model and matched
        assert acc and all(a["decision"] == "rejected" and "in-model correctness ok" in a["reason"] for a in acc), acc
    cov = coverage_of_run(out.run_id, Store(db_path))
    searched = [r for r in cov["tasks"] if r["status"] == "searched"]
    assert searched and all(r["wrong_output"] == 0 for r in searched)
    for r in cov["tasks"]:
        if r["inapplicable"]:
            assert all(t not in r["tried"] for t in must_fail)
