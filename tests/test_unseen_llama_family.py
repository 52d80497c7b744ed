"""A Llama-family shape the examples do not include, with no code written for it: Llama-3.2's (GQA groups of 3,
llama3 rope scaling, tied embeddings), scaled down. The workload keeps the user's nested rope_scaling table as
written (transformers' config check had filled it with its default rope_theta, 10000, in place), and on the
static cache the decode attention and whole-layer templates compute what the modules do. The full-size config
is docs/results/2026-12-02-h200/workloads/llama-3.2-3b.toml (issue 18's third architecture)."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOML = f'''name = "tiny-llama-3.2"
script = "{ROOT / 'examples' / 'scripts' / 'hf_generate.py'}"
dtype = "float32"
device = "cpu"
batch_size = 1
prompt_len = 16
decode_len = 3
seed = 0

[model]
model_type = "llama"

[model.config]
hidden_size = 96
intermediate_size = 192
num_hidden_layers = 2
num_attention_heads = 6
num_key_value_heads = 2
head_dim = 16
vocab_size = 256
max_position_embeddings = 256
rope_theta = 500000.0
tie_word_embeddings = true

[model.config.rope_scaling]
factor = 32.0
high_freq_factor = 4.0
low_freq_factor = 1.0
original_max_position_embeddings = 64
rope_type = "llama3"
'''


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    from llm4llm.stages.extract import run_extract
    from llm4llm.stages.profile import run_profile

    d = tmp_path_factory.mktemp("llama32")
    wl = d / "tiny-llama-3.2.toml"
    wl.write_text(TOML)
    run_extract(str(wl), run_profile(str(wl), str(d / "data")), str(d / "data"), static_cache=True)
    return wl, sorted(p for p in (d / "data" / "tasks").iterdir() if (p / "spec.json").exists())


def test_nested_rope_scaling_reaches_the_model_as_written(extracted):
    from llm4llm.workload import load_script, load_workload

    wl, _ = extracted
    w = load_workload(wl)
    assert w.model.config["rope_scaling"] == {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                              "original_max_position_embeddings": 64, "rope_type": "llama3"}
    model = load_script(w).build(w)
    rope = model.config.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0


@pytest.mark.parametrize("template,prefix", [("attention.decode_static", "attention-decode-"),
                                             ("decoder_layer.decode_static", "decoder_layer-decode-")])
def test_static_cache_templates_compute_the_groups_of_three(extracted, template, prefix):
    from llm4llm.search.templates import TEMPLATES
    from llm4llm.taskspec import load_spec
    from llm4llm.verify.gates import run_gates

    _, dirs = extracted
    task_dir = next(d for d in dirs if d.name.startswith(prefix))
    spec = load_spec(task_dir)
    assert spec.static.get("num_key_value_groups", 3) == 3
    tpl = next(t for t in TEMPLATES if t.name == template)
    assert tpl.why_not(spec) is None
    for config in (tpl.default(spec), *tpl.seeds(spec)[:1]):
        v, _ = run_gates(str(task_dir), tpl.render(spec, config), device="cpu", draws=1, timing=False)
        assert v.passed, f"{template} {config}: {v.failure_class}: {v.message}"
