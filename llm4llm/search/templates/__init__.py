"""Kernel-family templates for the built-in proposer, and the table of what each depends on.

`TEMPLATES` lists every template; a template whose ops do not import is skipped by the proposer (`why_not`), so
templates can be written ahead of their ops. `PENDING` names the family variants without a template yet, and why.
"""
from __future__ import annotations

from llm4llm.search.templates import attention, mlp, norm, ssm
from llm4llm.search.templates.base import Template

TEMPLATES: list[Template] = [*norm.TEMPLATES, *mlp.TEMPLATES, *attention.TEMPLATES, *ssm.TEMPLATES]

PENDING: dict[str, str] = {
    "ssm_mixer.mamba2": "Mamba2Mixer via kernels_runtime.ops.ssd (ssd / ssd_state_update) + the gated RMSNorm: "
                        "not written yet (the ssd op landed late)",
    "recurrent_block.rglru": "RecurrentGemmaRecurrentBlock via causal_conv1d (state_len K-1) + kernels_runtime.ops."
                             "rglru: not written yet (the rglru op landed late)",
}


def ops_table() -> list[dict]:
    """One row per template: family, phases, the ops it imports, whether they are available now."""
    return [{"template": t.name, "family": t.family, "phases": list(t.phases),
             "ops": [f"{m}.{a}" for m, a in t.requires], "missing": t.missing_ops()} for t in TEMPLATES]


__all__ = ["PENDING", "TEMPLATES", "Template", "ops_table"]
