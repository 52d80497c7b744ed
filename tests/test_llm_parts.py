"""The LLM proposer's pure parts, without a server: code extraction, the API-correction layer (rules, version
conditions, user rule files, the tanh helper's numerics under the interpreter) and key redaction."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from llm4llm.llm.corrections import (BUILTIN_RULES, TANH_HELPER, CorrectionsError, Rule, apply_corrections,
                                     load_rules_file, rule_set)
from llm4llm.llm.extract import ExtractionError, extract_code
from llm4llm.redact import MASK, redact, redact_obj

ENTRY = "import torch\n\ndef entry(inputs, weights, state, static):\n    return {}\n"


# -------------------------------------------------------------------------------------------------- extraction

def test_picks_the_last_python_block_that_defines_entry():
    text = f"Plan.\n```python\nimport torch\n```\nthen\n```python\n{ENTRY}```\nfinal:\n```py\n{ENTRY}# v2\n```\n"
    got = extract_code(text)
    assert got.how == "fenced" and got.code.endswith("# v2\n")


def test_joins_blocks_when_the_kernel_and_entry_are_split():
    text = "```python\nimport triton\n@triton.jit\ndef _k(x):\n    pass\n```\nand\n```python\n" \
           "def entry(inputs, weights, state, static):\n    return {}\n```"
    got = extract_code(text)
    assert got.how == "fenced-joined" and "def _k" in got.code and "def entry" in got.code


def test_unfenced_code_is_a_fallback():
    got = extract_code("Here it is:\n" + ENTRY)
    assert got.how == "unfenced" and got.code.startswith("import torch")


@pytest.mark.parametrize("text,finish,kind", [
    ("", "stop", "empty"),
    (None, None, "empty"),
    ("   \n", "stop", "empty"),
    (f"```python\n{ENTRY}```", "length", "truncated"),
    ("```python\nimport torch\ndef entry(inputs,", "stop", "truncated"),
    ("I would use a persistent kernel.", "stop", "no_code"),
    ("```bash\npip install triton\n```", "stop", "no_code"),
    ("```python\nimport torch\nx = 1\n```", "stop", "no_entry"),
])
def test_unusable_answers_raise_one_clear_kind(text, finish, kind):
    with pytest.raises(ExtractionError) as e:
        extract_code(text, finish)
    assert e.value.kind == kind and e.value.message


# ------------------------------------------------------------------------------------------------- corrections

OLD = """import triton
import triton.language as tl


@triton.jit
def _k(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    y = tl.math.tanh(x) + tl.libdevice.rsqrt(x) + tl.math.max(x, x) + tl.math.pow(x, 2.0)
    z = tl.dot(x, x, allow_tf32=False).to(tl.float8e4)
    tl.store(y_ptr + offs, triton.language.math.exp(y))
"""


def test_builtin_rules_fix_old_spellings_and_say_which():
    fixed = apply_corrections(OLD, triton_version="3.9.0")
    assert fixed.applied == ["triton-language-math-alias", "tl-libdevice-to-extra", "tl-math-tanh", "tl-math-moved",
                             "tl-float8e4-nv", "tl-dot-allow-tf32"]
    src = fixed.source
    for old in ("tl.math.tanh", "tl.libdevice.", "tl.math.max", "tl.math.pow", "allow_tf32", "tl.float8e4)",
                "triton.language.math"):
        assert old not in src, old
    for new in (f"{TANH_HELPER}(x)", "tl.extra.cuda.libdevice.rsqrt(", "tl.maximum(x, x)",
                "tl.extra.cuda.libdevice.pow(", 'input_precision="ieee"', "tl.float8e4nv", "tl.math.exp(y)"):
        assert new in src, new
    compile(src, "<corrected>", "exec")
    assert apply_corrections(src, triton_version="3.9.0").applied == []  # idempotent


def test_rules_outside_their_version_range_do_not_apply():
    assert apply_corrections(OLD, triton_version="2.1.0").applied == []


def test_current_api_is_left_alone():
    from llm_server import GOOD_SOURCE

    assert apply_corrections(GOOD_SOURCE, triton_version="3.9.0").applied == []


def test_user_rules_from_toml_and_python(tmp_path):
    toml = tmp_path / "fixes.toml"
    toml.write_text('[[rule]]\nid = "tl-math-tanh"\ndescription = "ours: libdevice"\ntriton = ">=3.0"\n'
                    'pattern = \'tl\\.math\\.tanh\\(\'\nreplacement = "tl.extra.cuda.libdevice.tanh("\n')
    rules = rule_set(toml)
    assert [r.id for r in rules].count("tl-math-tanh") == 1
    assert next(r for r in rules if r.id == "tl-math-tanh").origin == str(toml)
    fixed = apply_corrections(OLD, rules, triton_version="3.9.0")
    assert "tl.extra.cuda.libdevice.tanh(x)" in fixed.source and TANH_HELPER not in fixed.source

    py = tmp_path / "fixes.py"
    py.write_text("from llm4llm.llm.corrections import Rule\n"
                  "def boom(s):\n    raise RuntimeError('bad rule')\n"
                  "RULES = [Rule('local-x', fn=lambda s: s.replace('_k(', '_kernel('), triton='>=3'),\n"
                  "         {'id': 'broken', 'fn': boom}]\n")
    fixed = apply_corrections(OLD, load_rules_file(py), triton_version="3.9.0")
    assert fixed.applied == ["local-x"] and fixed.errors and fixed.errors[0].startswith("broken:")
    assert rule_set(None, disabled=["tl-math-tanh"]) == [r for r in BUILTIN_RULES if r.id != "tl-math-tanh"]


@pytest.mark.parametrize("content,suffix,match", [
    ("[[rule]]\nid = 'x'\n", ".toml", "exactly one of pattern or fn"),
    ("[[rule]]\nid = 'x'\npattern = '('\n", ".toml", "bad regex"),
    ("[[rule]]\nid = 'x'\npattern = 'a'\ntriton = 'three'\n", ".toml", "version range"),
    ("[[rule]]\nid = 'x'\npattern = 'a'\ncolour = 'red'\n", ".toml", "unknown keys"),
    ("X = 1\n", ".py", "RULES"),
    ("", ".yaml", "expected a .toml or .py"),
])
def test_bad_rule_files_fail_loudly(tmp_path, content, suffix, match):
    path = tmp_path / f"rules{suffix}"
    path.write_text(content)
    with pytest.raises(CorrectionsError, match=match):
        load_rules_file(path)


def test_tanh_helper_matches_torch_under_the_interpreter(tmp_path):
    import importlib.util
    import sys

    import triton

    src = apply_corrections("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                            "def _k(x_ptr, y_ptr, N: tl.constexpr):\n    offs = tl.arange(0, N)\n"
                            "    tl.store(y_ptr + offs, tl.math.tanh(tl.load(x_ptr + offs)))\n",
                            triton_version=triton.__version__).source
    path = tmp_path / "tanh_candidate.py"  # triton.jit reads the function's source from a real file
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("tanh_candidate", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tanh_candidate"] = mod
    try:
        spec.loader.exec_module(mod)
        x = torch.linspace(-30, 30, 64)
        y = torch.empty_like(x)
        mod._k[(1,)](x, y, N=64)
    finally:
        sys.modules.pop("tanh_candidate", None)
    torch.testing.assert_close(y, torch.tanh(x), atol=1e-6, rtol=1e-5)


def test_a_rule_needs_an_id_and_one_action():
    with pytest.raises(CorrectionsError):
        Rule("", pattern="a")
    with pytest.raises(CorrectionsError):
        Rule("x", pattern="a", fn=lambda s: s)


# ---------------------------------------------------------------------------------------------------- redaction

def test_redact_masks_key_shapes_and_secret_env_values():
    env = {"MY_PROVIDER_API_KEY": "plainvalue-without-prefix", "HOME": "/root", "SHORT_TOKEN": "abc"}
    text = ("sk-proj-AbCdEf0123456789 sk-ant-api03-xyzxyzxyz Bearer abc.def-ghi_jkl "
            "api_key='hunter2hunter2' plainvalue-without-prefix /root abc prompt_tokens: 1234")
    out = redact(text, env)
    for secret in ("AbCdEf0123456789", "xyzxyzxyz", "abc.def-ghi_jkl", "hunter2hunter2", "plainvalue-without-prefix"):
        assert secret not in out
    assert "/root" in out and " abc " in out and "prompt_tokens: 1234" in out and MASK in out
    assert redact_obj({"a": ["sk-zzzzzzzzzz", 3], "b": ("x",)}, env) == {"a": [MASK, 3], "b": ("x",)}


def test_a_seed_shows_its_host_module_and_the_kernels_that_module_calls():
    """A rendered template imports its host code from kernels_runtime.hosts; the kernels worth showing the model are
    one import further (the seed itself is a few lines)."""
    from llm4llm.llm.prompt import ops_sources

    mods = [m for m, _ in ops_sources("from kernels_runtime.hosts.norm import rmsnorm_op\n")]
    assert mods[0] == "kernels_runtime.hosts.norm" and "kernels_runtime.ops.rmsnorm" in mods, mods
    assert "kernels_runtime.ops.layernorm" in mods and len(mods) == len(set(mods))
