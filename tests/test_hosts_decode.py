"""The fused decode templates (llm4llm/search/templates/decode_fused.py) render short sources whose host code is
kernels_runtime.hosts.decode_layer: the source imports its factory, bakes CONFIG and defines `entry` only (no host
code pasted in as strings); the GEMV stages' keyword arguments are taken from the config once, in the factory."""
from __future__ import annotations

import ast

import pytest

from kernels_runtime.hosts.decode_layer import stage
from llm4llm.search.templates.decode_fused import TEMPLATES
from llm4llm.taskspec import load_spec

NAMES = {"mlp.decode_gemv", "attention.decode_fused_qkv", "decoder_layer.decode_fused", "decoder_layer.decode_static",
         "decoder_layer.decode_static_gemma2", "lm_head.gemv"}
GEMMA2 = "decoder_layer.decode_static_gemma2"  # no Qwen3 task: tests/test_gemma2_decoder_layer.py renders it


def _configs(tpl, spec):
    base = tpl.default(spec)
    if "post_norm" not in base:
        return [base]
    return [{**base, "post_norm": v} for v in tpl.space(spec)["post_norm"]]


def _check_source(source: str, name: str):
    tree = ast.parse(source)
    functions = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert functions == ["entry"], f"{name}: defines {functions}"
    assert not any(isinstance(n, ast.Lambda) for n in ast.walk(tree)), name
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert len(imports) == 1 and isinstance(imports[0], ast.ImportFrom), \
        f"{name}: imports {[ast.dump(n) for n in imports]}"
    assert imports[0].module == "kernels_runtime.hosts.decode_layer", f"{name}: imports from {imports[0].module}"
    ns: dict = {}
    exec(compile(source, f"<{name}>", "exec"), ns)
    assert ns["_entry"].__module__ == "kernels_runtime.hosts.decode_layer" and callable(ns["entry"])


def test_every_decode_fused_template_renders_an_import_of_its_host(tiny_extracted):
    assert {t.name for t in TEMPLATES} == NAMES
    covered = set()
    for d in [*tiny_extracted("tiny-qwen3"), *tiny_extracted("tiny-qwen3+static")]:
        spec = load_spec(d)
        for tpl in TEMPLATES:
            if tpl.why_not(spec) is None:
                for config in _configs(tpl, spec):
                    _check_source(tpl.render(spec, config), tpl.name)
                covered.add(tpl.name)
    assert covered == NAMES - {GEMMA2}, sorted(NAMES - covered)


@pytest.mark.parametrize("extra,expect", [({}, {}), ({"pdl": True, "fma_max_m": 4, "dot_stages": 3},
                                                      {"PDL": True, "FMA_MAX_M": 4, "DOT_STAGES": 3})])
def test_stage_kwargs_are_the_prefixed_keys_and_the_shared_ones(extra, expect):
    config = {"gu_BLOCK_N": 8, "gu_SPLIT_K": 2, "dn_BLOCK_N": 4, "num_stages": 3, **extra}
    assert stage(config, "gu_") == {"BLOCK_N": 8, "SPLIT_K": 2, "num_stages": 3, "PDL": False, **expect}
