"""Workload TOMLs, the inference-script contract and the error each bad input gives."""
from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from llm4llm.errors import DeviceError, Llm4llmError, ScriptError, WorkloadError
from llm4llm.workload import Workload, call_script, load_script, load_workload

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ROOT / "examples" / "workloads"
SCRIPT = ROOT / "examples" / "scripts" / "hf_generate.py"
TINY = sorted(WORKLOADS.glob("tiny-*.toml"))
LOSSY = [WORKLOADS / "qwen3-4b-long.toml"]  # opted in to lossy kernels (TileMix), long context
REAL = sorted(set(WORKLOADS.glob("*.toml")) - set(TINY) - set(LOSSY))

GOOD = """\
name = "t"
script = "script.py"
dtype = "float32"
device = "cpu"
batch_size = 1
prompt_len = 8
decode_len = 2
seed = 0
[model]
model_type = "llama"
[model.config]
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 1
num_attention_heads = 4
vocab_size = 128
"""


def _write(tmp_path: Path, toml: str, script: str | None = None) -> Path:
    (tmp_path / "script.py").write_text(script if script is not None else SCRIPT.read_text())
    path = tmp_path / "w.toml"
    path.write_text(toml)
    return path


def test_examples_present():
    assert {p.stem for p in TINY} == {"tiny-llama", "tiny-qwen3", "tiny-mamba", "tiny-mamba2", "tiny-recurrentgemma",
                                      "tiny-falcon-mamba", "tiny-gpt-neox", "tiny-llama-padded", "tiny-qwen3-padded",
                                      "tiny-gemma2"}
    assert {p.stem for p in REAL} == {"qwen3-4b", "llama-2-7b", "mamba-130m", "mamba2-2.7b", "recurrentgemma-2b",
                                      "falcon-mamba-7b", "qwen3-4b-serving", "llama-2-7b-serving"}
    assert all(p.is_file() for p in LOSSY)


def test_long_context_example_opts_in_to_lossy_kernels():
    w = load_workload(LOSSY[0], check_device=False)
    assert (w.dtype, w.prompt_len, w.decode_len, w.model.config["num_key_value_heads"]) == ("bfloat16", 16384, 4, 8)
    assert w.allow_lossy and w.lossy_budget() == {"max_logit_deviation": 0.06, "min_token_agreement": 0.75}
    for p in REAL + TINY:  # nobody else is opted in
        assert load_workload(p, check_device=False).lossy_budget() is None


@pytest.mark.parametrize("extra, problem", [
    ("allow_lossy = true\n", r"field `\(top level\)`: expected an \[accuracy_budget\] table"),
    ("[accuracy_budget]\nmax_logit_deviation = 0.05\n", r"expected allow_lossy = true beside an \[accuracy_budget\]"),
    ("allow_lossy = true\n[accuracy_budget]\n", r"max_logit_deviation .* or min_token_agreement .*, got neither"),
    ("allow_lossy = true\n[accuracy_budget]\nmin_token_agreement = 1.5\n", r"accuracy_budget.min_token_agreement"),
    ("allow_lossy = true\n[accuracy_budget]\nmax_logit_deviation = 0\n", r"accuracy_budget.max_logit_deviation"),
    ("allow_lossy = true\n[accuracy_budget]\nmax_logits = 0.1\n", r"accuracy_budget.max_logits"),
])
def test_lossy_opt_in_needs_a_valid_budget(tmp_path, extra, problem):
    head, _, tail = GOOD.partition("[model]")
    if extra.startswith("allow_lossy = true\n["):  # the key before the tables, the budget table after
        text = head + "allow_lossy = true\n[model]" + tail + extra.removeprefix("allow_lossy = true\n")
    elif extra.startswith("["):
        text = GOOD + extra
    else:
        text = head + extra + "[model]" + tail
    with pytest.raises(WorkloadError, match=problem):
        load_workload(_write(tmp_path, text))


def test_lossy_opt_in_with_a_budget_loads(tmp_path):
    head, _, tail = GOOD.partition("[model]")
    w = load_workload(_write(tmp_path, head + "allow_lossy = true\n[model]" + tail
                             + "[accuracy_budget]\nmin_token_agreement = 0.9\n"))
    assert w.lossy_budget() == {"min_token_agreement": 0.9}
    assert load_workload(_write(tmp_path, GOOD)).lossy_budget() is None


@pytest.mark.parametrize("path", TINY, ids=lambda p: p.stem)
def test_tiny_examples_load(path):
    w = load_workload(path)
    assert w.name == path.stem and w.device == "cpu" and w.torch_dtype is torch.float32
    assert w.script == SCRIPT and w.toml_path == path
    assert (w.prompt_len, w.decode_len) == (16, 4)
    assert re.fullmatch(r"[0-9a-f]{16}", w.content_hash())


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.stem)
def test_real_examples_validate(path):
    w = load_workload(path, check_device=False)
    assert (w.device, w.dtype, w.torch_dtype) == ("cuda", "bfloat16", torch.bfloat16)
    if w.regime is None:
        assert (w.batch_size, w.prompt_len, w.decode_len, w.seed) == (1, 512, 64, 0)
    else:  # the serving example: batch 8 representative of a regime of batches 1-32, left-padded
        assert (w.batch_size, w.prompt_len, w.decode_len, w.seed) == (8, 512, 64, 0)
        assert w.regime.batch_buckets() == (1, 2, 4, 8, 16, 32) and w.regime.padding == "left"
    assert "# checkpoint = " in path.read_text()
    if not torch.cuda.is_available():
        with pytest.raises(WorkloadError, match=r"field `device`: expected a machine with CUDA"):
            load_workload(path)


def test_content_hash_covers_toml_and_script(tmp_path):
    path = _write(tmp_path, GOOD)
    first = load_workload(path).content_hash()
    assert load_workload(path).content_hash() == first
    (tmp_path / "script.py").write_text(SCRIPT.read_text() + "\n# changed\n")
    second = load_workload(path).content_hash()
    path.write_text(GOOD.replace("seed = 0", "seed = 1"))
    assert len({first, second, load_workload(path).content_hash()}) == 3


def test_phase_weights_and_defaults(tmp_path):
    text = GOOD.replace("batch_size = 1\n", "").replace("seed = 0\n", "") + "[phase_weights]\nprefill = 1\ndecode = 3\n"
    w = load_workload(_write(tmp_path, text))
    assert (w.batch_size, w.seed) == (1, 0)
    assert w.phase_weights.normalised() == {"prefill": 0.25, "decode": 0.75}


def _error(tmp_path, toml: str, **kw) -> WorkloadError:
    with pytest.raises(WorkloadError) as info:
        load_workload(_write(tmp_path, toml, **kw))
    assert isinstance(info.value, Llm4llmError)
    return info.value


@pytest.mark.parametrize(
    ("edit", "field", "pieces"),
    [
        (lambda t: t.replace("prompt_len = 8\n", ""), "prompt_len", ["required", "got nothing"]),
        (lambda t: t.replace('name = "t"\n', ""), "name", ["required"]),
        (lambda t: t.replace('"float32"', '"float8"'), "dtype", ["'float32'", "'bfloat16'", "got 'float8'"]),
        (lambda t: t.replace('"cpu"', '"tpu"'), "device", ["cpu, cuda or cuda:N", "got 'tpu'"]),
        (lambda t: t.replace("batch_size = 1", "batch_size = 0"), "batch_size", ["greater than 0", "got 0"]),
        (lambda t: t.replace("batch_size = 1", 'batch_size = "1"'), "batch_size", ["integer", "got '1'"]),
        (lambda t: t + "\n[phase_weights]\nprefill = 0\ndecode = 0\n", "phase_weights", ["prefill + decode > 0"]),
        (lambda t: t.replace("seed = 0", "seed = 0\nbatch = 2"), "batch", ["known fields", "batch_size"]),
        (lambda t: t.replace('"llama"', '"lama"'), "model.model_type", ["model_type", "did you mean", "got 'lama'"]),
        (lambda t: t.replace('model_type = "llama"\n', "").split("[model.config]")[0], "model",
         ["model_type", "checkpoint", "got neither"]),
        (lambda t: t.replace("num_attention_heads = 4", "num_attention_heads = 5"), "model.config",
         ["a valid llama config", "not a multiple"]),
        (lambda t: t.replace("hidden_size = 64", 'hidden_size = "big"'), "model.config", ["hidden_size"]),
    ],
    ids=["missing", "missing-name", "dtype", "device", "batch0", "batch-str", "weights", "extra", "model_type",
         "no-model", "config", "config-type"],
)
def test_bad_field(tmp_path, edit, field, pieces):
    err = _error(tmp_path, edit(GOOD))
    assert err.field == field
    text = str(err)
    assert f"field `{field}`" in text and str(tmp_path / "w.toml") in text
    for piece in pieces:
        assert piece in text, text


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".hidden", "a..b", "x" * 101, "x" * 1200, "tab\\there",
                                  "sp ace", "", "caf\\u00e9"])
def test_unsafe_workload_name_is_one_clear_error(tmp_path, name):
    err = _error(tmp_path, GOOD.replace('name = "t"', f'name = "{name}"'))
    assert err.field == "name"
    text = str(err)
    assert "field `name`" in text and "\n" not in text and len(text) < 400, text


@pytest.mark.parametrize("name", ["tiny-llama", "llama-3.2-3b", "a_b.c-1", "x" * 100])
def test_safe_workload_names_load(tmp_path, name):
    assert load_workload(_write(tmp_path, GOOD.replace('name = "t"', f'name = "{name}"'))).name == name


@pytest.mark.parametrize("path", sorted(ROOT.glob("docs/results/*/workloads/*.toml")), ids=lambda p: p.parent.parent.name + "/" + p.stem)
def test_recorded_result_workloads_still_validate(path):
    assert load_workload(path, check_device=False).name == path.stem


def test_missing_file_and_bad_syntax(tmp_path):
    with pytest.raises(WorkloadError, match="expected a workload TOML file, got no such file"):
        load_workload(tmp_path / "nope.toml")
    err = _error(tmp_path, GOOD.replace('name = "t"', 'name = "t'))
    assert "expected valid TOML, got a syntax error" in str(err)


def test_script_not_found(tmp_path):
    err = _error(tmp_path, GOOD.replace('"script.py"', '"missing.py"'))
    assert err.field == "script" and "missing.py" in str(err) and "expected an existing Python file" in str(err)


def test_checkpoint_missing(tmp_path):
    text = GOOD.split("[model]")[0] + '[model]\ncheckpoint = "no/such/dir"\n'
    err = _error(tmp_path, text)
    assert err.field == "model.checkpoint" and "no such directory" in str(err)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    w = load_workload(_write(tmp_path, text.replace("no/such/dir", "ckpt")))
    assert w.model.checkpoint == ckpt


def test_cuda_requested_but_absent(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _error(tmp_path, GOOD.replace('"cpu"', '"cuda:0"'))
    assert err.field == "device" and "torch.cuda.is_available() == False" in str(err)
    assert load_workload(tmp_path / "w.toml", check_device=False).device == "cuda:0"


BROKEN_BUILD = textwrap.dedent("""\
    def _helper(workload):
        raise RuntimeError("boom from the user's build")

    def build(workload):
        return _helper(workload)

    def inputs(workload):
        return {}

    def run(model, workload, inputs):
        return None
    """)


def test_script_error_carries_the_scripts_traceback(tmp_path):
    w = load_workload(_write(tmp_path, GOOD, script=BROKEN_BUILD))
    script = load_script(w)
    with pytest.raises(ScriptError) as info:
        call_script(script.build, w)
    err = info.value
    for text in (str(err), err.traceback_text):
        assert 'raise RuntimeError("boom from the user\'s build")' in text
        assert "return _helper(workload)" in text and str(tmp_path / "script.py") in text
    assert "build() raised RuntimeError: boom from the user's build" in str(err)
    assert "call_script" not in err.traceback_text


def test_script_import_error_and_missing_functions(tmp_path):
    w = load_workload(_write(tmp_path, GOOD, script="import os\nx = 1 / 0\n"))
    with pytest.raises(ScriptError, match="importing it raised ZeroDivisionError") as info:
        load_script(w)
    assert "x = 1 / 0" in info.value.traceback_text
    (tmp_path / "script.py").write_text("def build(w): pass\ninputs = 3\n")
    with pytest.raises(ScriptError, match="got none named inputs, run"):
        load_script(w)


def test_out_of_memory_becomes_device_error():
    def run():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(DeviceError, match="out of GPU memory in .*run\\(\\): CUDA out of memory"):
        call_script(run)


def test_direct_construction(tmp_path):
    shutil.copy(SCRIPT, tmp_path / "s.py")
    w = Workload(name="x", script=tmp_path / "s.py", model={"model_type": "mamba", "config": {"hidden_size": 32}},
                 prompt_len=4, decode_len=2)
    assert w.toml_path is None and len(w.content_hash()) == 16


@pytest.mark.parametrize("path", TINY, ids=lambda p: p.stem)
def test_reference_script_generates_every_token(path):
    w = load_workload(path)
    script = load_script(w)
    model = call_script(script.build, w)
    assert not model.training and next(model.parameters()).dtype is torch.float32
    batch = call_script(script.inputs, w)
    assert batch["input_ids"].shape == (w.batch_size, w.prompt_len)
    ids = call_script(script.run, model, w, batch)
    assert ids.shape == (w.batch_size, w.prompt_len + w.decode_len)
    assert torch.equal(ids, call_script(script.run, model, w, batch))  # greedy and seeded: deterministic


def test_cuda_needed_at_run_time_becomes_device_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    w = load_workload(_write(tmp_path, GOOD.replace('"cpu"', '"cuda"')), check_device=False)
    with pytest.raises(DeviceError, match=r"build\(\) needs CUDA, but this machine has none"):
        call_script(load_script(w).build, w)


def test_reference_script_from_a_checkpoint(tmp_path):
    w = load_workload(_write(tmp_path, GOOD))
    script = load_script(w)
    call_script(script.build, w).save_pretrained(tmp_path / "ckpt")
    text = GOOD.split("[model]")[0].replace("decode_len = 2", "decode_len = 3") + '[model]\ncheckpoint = "ckpt"\n'
    w = load_workload(_write(tmp_path, text))
    model = call_script(script.build, w)
    ids = call_script(script.run, model, w, call_script(script.inputs, w))
    assert ids.shape == (1, w.prompt_len + 3)
