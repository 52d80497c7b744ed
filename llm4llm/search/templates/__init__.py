"""Kernel-family templates for the built-in proposer, and the table of what each depends on.

`TEMPLATES` lists every template; a template whose ops do not import is skipped by the proposer (`why_not`), so
templates can be written ahead of their ops. `PENDING` names the family variants without a template yet, and why.
"""
from __future__ import annotations

from llm4llm.search.templates import attention, decode_fused, mamba2, mlp, norm, recurrent, ssm, tilemix
from llm4llm.search.templates.base import Template

TEMPLATES: list[Template] = [*norm.TEMPLATES, *mlp.TEMPLATES, *attention.TEMPLATES, *ssm.TEMPLATES, *mamba2.TEMPLATES,
                              *recurrent.TEMPLATES, *decode_fused.TEMPLATES, *tilemix.TEMPLATES]

# Every family variant the tiny example workloads extract has a template now (ssm_mixer.mamba2 and
# recurrent_block.rglru landed with tests/test_templates_real.py).
PENDING: dict[str, str] = {}


def ops_table() -> list[dict]:
    """One row per template: family, phases, the ops it imports, whether they are available now."""
    return [{"template": t.name, "family": t.family, "phases": list(t.phases),
             "ops": [f"{m}.{a}" for m, a in t.requires], "missing": t.missing_ops()} for t in TEMPLATES]


__all__ = ["PENDING", "TEMPLATES", "Template", "ops_table"]
