"""The LLM proposer on KernelBench tasks: the prompt states KernelBench's ModelNew contract with the problem's source
(other tasks keep the entry() prompt), answers must define `class ModelNew`, and `llm4llm kernelbench --proposer llm`
end to end against the scripted local OpenAI-compatible server on a real Level 2 problem (read from the shared
folder at test time, shrunk to tiny sizes), Triton under its interpreter."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price-table fetch from GitHub on import

sys.path.insert(0, str(Path(__file__).parent))
import llm_server as srv  # noqa: E402

from llm4llm.kernelbench.kind import KIND  # noqa: E402
from llm4llm.llm.extract import ExtractionError, extract_code  # noqa: E402
from llm4llm.llm.prompt import build_messages  # noqa: E402

KB_TARGET = KIND.target  # what a KernelBench answer must define: class ModelNew
LEVEL2 = Path("/work/shared/kernelbench/level2")
PROBLEM = "76_Gemm_Add_ReLU.py"  # GEMM (cuBLAS, allowed for KernelBench) + bias + ReLU (a Triton kernel)
SIZES = {"batch_size": 4, "in_features": 16, "out_features": 8}  # the problem's 1024 x 8192 x 8192, shrunk

MODEL_NEW = '''import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def _bias_relu_kernel(
    # Pointers
    y_ptr, b_ptr, out_ptr,
    # Matrix dimensions
    n_elements, n_cols,
    # Meta-parameters
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    b = tl.load(b_ptr + offs % n_cols, mask=mask, other=0.0)
    tl.store(out_ptr + offs, tl.maximum(y + b, 0.0), mask=mask)


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, bias_shape):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features, bias=False)
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        y = torch.nn.functional.linear(x, self.gemm.weight)  # [B, N] on cuBLAS
        out = torch.empty_like(y)
        n = y.numel()
        _bias_relu_kernel[(triton.cdiv(n, 1024),)](y, self.bias, out, n, y.shape[1], BLOCK=1024)
        return out
'''


@pytest.fixture(autouse=True)
def _api_key(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-kb-0123456789abcdef")


@pytest.fixture(scope="module")
def kb_dir(tmp_path_factory) -> Path:
    """The shared Level 2 problem with its size constants shrunk (the rest of its source as KernelBench has it)."""
    if not (LEVEL2 / PROBLEM).exists():
        pytest.skip(f"{LEVEL2 / PROBLEM} not present")
    src = (LEVEL2 / PROBLEM).read_text()
    for name, value in SIZES.items():
        src, n = re.subn(rf"^{name}\s*=.*$", f"{name} = {value}", src, flags=re.M)
        assert n == 1, name
    d = tmp_path_factory.mktemp("kb-llm")
    (d / PROBLEM).write_text(src)
    return d


@pytest.fixture(scope="module")
def kb_spec(kb_dir, tmp_path_factory):
    from llm4llm.kernelbench.problem import make_task
    from llm4llm.taskspec import load_spec

    return load_spec(make_task(kb_dir / PROBLEM, tmp_path_factory.mktemp("kb-llm-tasks")))


# ------------------------------------------------------------------------------------------------------- prompt

def test_kernelbench_prompt_states_the_modelnew_contract_and_the_problem(kb_spec):
    from llm4llm.kernelbench.static import FORBIDDEN, HEAVY_CALLS

    system, user = (m["content"] for m in build_messages(kb_spec, [], []))
    for text in ("class ModelNew(nn.Module)", "ModelNew(*get_init_inputs())", "model(*get_inputs())",
                 "atol=0.0001, rtol=0.0001", "5 trials with fresh seeds", "seed 42", "torch.compile",
                 "CUDA events", "L2 cache flushed", "TF32", "bf16/fp16", 'input_precision="ieee"',
                 *HEAVY_CALLS, *FORBIDDEN):  # the gate's own lists, not a copy
        assert text in system, text
    for text in ("76_Gemm_Add_ReLU.py", "class Model(nn.Module)", "self.gemm = nn.Linear(in_features, out_features",
                 "def get_init_inputs():", "batch_size = 4", "forward(x: float32[4, 16]) -> out: float32[4, 8]",
                 "['bias', 'gemm.weight']"):
        assert text in user, text
    assert user.rstrip().endswith("defining `class ModelNew(nn.Module)` (and its Triton kernels).")
    for text in (system, user):
        assert "def entry" not in text and "entry(inputs" not in text and "state_out" not in text


def test_other_tasks_keep_the_entry_prompt():
    from llm4llm.llm import prompt
    from llm4llm.taskspec import CaseSig, TaskSpec, TensorSig

    sig = TensorSig(shape=[2, 80], dtype="float32")
    spec = TaskSpec(task_id="norm-t", family="norm", phase="prefill", module_class="x.RMSNorm", instances=["n"],
                    input_names=["hidden_states"], weight_names=["weight"], output_names=["out"], static={},
                    dtype="float32", cases=[CaseSig(inputs={"hidden_states": sig}, outputs={"out": sig})])
    system, user = (m["content"] for m in build_messages(spec, [], []))
    assert system == prompt.system_prompt()
    assert "def entry(inputs: dict, weights: dict, state: dict, static: dict) -> dict" in system
    assert user.startswith(prompt.task_section(spec))
    assert user.endswith("one ```python block defining entry(...).")
    assert "ModelNew" not in system + user and "KernelBench" not in system + user


def test_kernelbench_answers_must_define_modelnew():
    text = srv.fenced(MODEL_NEW)
    assert extract_code(text, "stop", KB_TARGET).code == MODEL_NEW
    with pytest.raises(ExtractionError) as e:  # an entry() answer is the wrong contract for KernelBench
        extract_code(srv.fenced(srv.GOOD_SOURCE), "stop", KB_TARGET)
    assert e.value.kind == "no_model_new"
    assert e.value.message == "1 Python block(s), none defines class ModelNew(nn.Module)"
    with pytest.raises(ExtractionError) as e:
        extract_code("I would fuse the bias and the ReLU.", "stop", KB_TARGET)
    assert e.value.kind == "no_code" and "class ModelNew" in e.value.message
    assert extract_code(srv.fenced(srv.GOOD_SOURCE)).code == srv.GOOD_SOURCE  # entry stays the default


# ------------------------------------------------------------------------------------------------- end to end

@pytest.mark.timeout(120)
def test_kernelbench_llm_run_passes_and_records_llm_origin(kb_dir, tmp_path):
    from storage import repo
    from storage.db import Database
    from llm4llm.stages.kernelbench import run_kernelbench
    from storage.store import Store

    db = str(tmp_path / "kb.duckdb")
    with srv.ScriptedLLM([srv.good(), srv.Reply(srv.fenced(MODEL_NEW))]) as llm:  # the wrong contract, then a ModelNew
        flags = {"model": "openai/test-model", "api_base": llm.base_url, "concurrency": 1, "samples_per_step": 1,
                 "max_retries": 0, "timeout_s": 20}
        kb = run_kernelbench(str(kb_dir), Store(db), str(tmp_path), budget=2, proposer="llm",
                             device="cpu", timeout_s=120, llm=flags)
    kb_run_id, rows = kb.run_id, kb.problems
    first, second = (r["body"]["messages"] for r in llm.requests)
    assert "class ModelNew(nn.Module)" in first[0]["content"] and "class Model(nn.Module)" in first[1]["content"]
    assert "built-in template kb." in first[1]["content"]  # the seed is a KernelBench template's ModelNew
    # the failed answer is feedback, not an attempt to repair (its placeholder source names ModelNew in a comment)
    assert "FAILED [static]" in second[1]["content"] and "Your previous attempt" not in second[1]["content"]
    assert [(r.passed, r.origin, r.proposer) for r in rows] == [(True, "llm", "llm")]
    with Database(db) as d:
        res = repo.kb_results(d, kb_run_id)
        cands = repo.candidate_rows(d, search_id=rows[0].search_id)
        calls = repo.table_df(d, "llm_calls")
    assert list(res["origin"]) == ["llm"] and bool(res["passed"].iloc[0])
    assert list(cands["proposer"]) == ["llm", "llm"] and list(cands["origin"]) == ["llm", "llm"]
    bad, good = cands.iloc[0], cands.iloc[1]
    assert bool(good["passed"]) and not isinstance(good["failure_class"], str)
    assert "KernelBench: 5 trials" in str(good["gates_json"]) and good["parent_id"] != bad["candidate_id"]
    assert not bool(bad["passed"]) and bad["failure_class"] == "static"
    assert '"error_kind": "no_model_new"' in bad["config_json"]
    assert "none defines class ModelNew(nn.Module)" in bad["config_json"]
    assert list(calls["status"]) == ["ok", "ok"]
