"""Templates as modules (issue 41 item 5): a converted template's rendered source is short, its host code imported
from kernels_runtime.hosts, not pasted in as strings."""
from __future__ import annotations

import ast

import pytest

from llm4llm.search.templates import TEMPLATES
from llm4llm.taskspec import TaskSpec

BY_NAME = {t.name: t for t in TEMPLATES}
SPLIT = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
FUSED = ["query_key_value.weight", "query_key_value.bias", "dense.weight", "dense.bias"]
# template, its host module, the task's weights, phase and cache layer
CONVERTED = [
    ("attention.prefill_flash", "attention", SPLIT, "prefill", "DynamicSlidingWindowLayer"),
    ("attention.prefill_flash", "attention", FUSED, "prefill", "DynamicLayer"),
    ("attention.decode_splitkv", "attention", FUSED, "decode", "DynamicLayer"),
    ("attention.decode_static", "attention", SPLIT, "decode", "StaticLayer"),
    ("attention.prefill_tilemix", "tilemix", SPLIT, "prefill", "DynamicLayer"),
]


def _spec(weights: list[str], phase: str, adapter: str) -> TaskSpec:
    return TaskSpec.model_validate(dict(
        task_id="t", workload="w", run_id="r", family="attention", module_class="m.Attention", instances=["a"],
        phase=phase, input_names=["hidden_states", "position_embeddings.0", "position_embeddings.1"],
        weight_names=weights, state_names=[], output_names=["out"], dtype="bfloat16", cases=[],
        recipe={"state": {"adapter": adapter, "sliding_window": 64 if "Sliding" in adapter else None}}))


@pytest.mark.parametrize("name, module, weights, phase, adapter", CONVERTED)
def test_rendered_source_imports_its_host_and_defines_only_entry(name, module, weights, phase, adapter):
    template, spec = BY_NAME[name], _spec(weights, phase, adapter)
    configs = [template.default(spec), *({**template.default(spec), **v} for v in template.variants(spec))]
    for config in configs:
        tree = ast.parse(template.render(spec, config))
        defs = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        assert defs == ["entry"], (name, defs)
        assert not any(isinstance(n, ast.Lambda) for n in ast.walk(tree))
        froms = [n.module for n in tree.body if isinstance(n, ast.ImportFrom)]
        assert froms == [f"kernels_runtime.hosts.{module}"] and not any(isinstance(n, ast.Import) for n in tree.body)
        exec(compile(tree, name, "exec"), {})  # noqa: S102 - and it imports and builds its entry
