"""KernelBench mode on the CPU (Triton's interpreter): tiny KernelBench-format problems written here, turned into
tasks, searched by the built-in proposer, judged by the verifier with KernelBench's protocol on top; KernelBench's
own three adversarial kernels (src/unit_tests/test_kernels there), as written (CUDA via load_inline) and ported to
Triton, must be rejected."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

CONV_SOFTMAX = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, scale):
        super(Model, self).__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.bias = nn.Parameter(torch.randn(out_channels, 1, 1) * 0.02)
        self.scale = scale

    def forward(self, x):
        x = self.conv(x)
        x = torch.nn.functional.gelu(x) * self.scale + self.bias
        return torch.softmax(x, dim=1)

def get_inputs():
    return [torch.rand(2, 3, 8, 8)]

def get_init_inputs():
    return [3, 4, 3, 2.0]
'''

GEMM_SUM = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, in_features, out_features, scaling_factor):
        super(Model, self).__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scaling_factor = scaling_factor

    def forward(self, x):
        x = self.linear(x)
        x = x / 2
        x = torch.sum(x, dim=1, keepdim=True)
        return x * self.scaling_factor

def get_inputs():
    return [torch.rand(4, 16)]

def get_init_inputs():
    return [16, 8, 1.5]
'''

CONV_GN_POOL = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, groups):
        super(Model, self).__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.gn = nn.GroupNorm(groups, out_channels)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        x = self.conv(x)
        x = torch.tanh(self.gn(x))
        return self.pool(x)

def get_inputs():
    return [torch.rand(2, 3, 10, 10)]

def get_init_inputs():
    return [3, 4, 3, 2]
'''


@pytest.fixture(scope="module")
def kb_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("kb")
    for name, src in (("1_Conv2d_GELU_Softmax.py", CONV_SOFTMAX), ("2_Gemm_Divide_Sum.py", GEMM_SUM),
                      ("3_Conv2d_GroupNorm_Tanh_MaxPool.py", CONV_GN_POOL)):
        (d / name).write_text(src)
    (d / "README.md").write_text("not a problem")
    return d


@pytest.fixture(scope="module")
def kb_run(kb_dir, tmp_path_factory):
    from llm4llm.stages.kernelbench import run_kernelbench
    from storage.store import Store

    data = tmp_path_factory.mktemp("kbdata")
    db = str(data / "kb.duckdb")
    kb = run_kernelbench(str(kb_dir), Store(db), str(data), problems="2", budget=1, proposer="library",
                         device="cpu", timeout_s=300)
    return kb.run_id, kb.problems, db, data


def test_selection_and_seeds(kb_dir):
    from llm4llm.kernelbench.problem import ProblemError, parse_selection, select, trial_seeds

    assert parse_selection("12,40-42") == {12, 40, 41, 42}
    assert parse_selection(None) is None
    with pytest.raises(ProblemError):
        parse_selection("4-2")
    assert [p.name for p in select(kb_dir, "2-3")] == ["2_Gemm_Divide_Sum.py", "3_Conv2d_GroupNorm_Tanh_MaxPool.py"]
    with pytest.raises(ProblemError):
        select(kb_dir, "9")
    # KernelBench's trial seeds: manual_seed(42), then randint draws; five distinct, reproducible
    assert trial_seeds(5) == trial_seeds(5) and len(set(trial_seeds(5))) == 5


def test_graph_capture_and_patterns(kb_dir, tmp_path):
    from llm4llm.kernelbench.problem import make_task
    from llm4llm.kernelbench.run import kb_proposer
    from llm4llm.taskspec import load_spec

    prop = kb_proposer("library")
    got = {}
    for f in sorted(kb_dir.glob("*_*.py")):
        spec = load_spec(make_task(f, tmp_path))
        assert spec.family == "kernelbench" and spec.reference == "kernelbench" and spec.input_names == ["x"]
        got[f.name] = [t.name for t in prop.templates_for(spec)]
    # the GEMM-sum rewrite fires; the GEMM also gets the Triton GEMM with its epilogue fused
    assert got["2_Gemm_Divide_Sum.py"] == ["kb.rewrite_fused_tail", "kb.fused_tail", "kb.gemm_epilogue"]
    assert got["1_Conv2d_GELU_Softmax.py"] == ["kb.fused_tail", "kb.conv_epilogue"]
    src = prop.propose(load_spec(make_task(kb_dir / "3_Conv2d_GroupNorm_Tanh_MaxPool.py", tmp_path)), [], [], 1)[0]
    # heavy op on cuDNN, everything after it in Triton: group norm (two statistics passes) with tanh and the pool
    assert "torch.nn.functional.conv2d" in src.source and "@triton.jit" in src.source
    assert "group_norm" in src.source and "'pool'" in src.source


@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_triton_gemm_dot_precision_is_a_config_choice(kb_dir, tmp_path, precision):
    """kb.gemm_epilogue's dot precision is searched: IEEE FMA dots or TF32x3 (near-fp32 on tensor cores; the
    verifier's 1e-4 decides on the GPU). Under the interpreter both must match the fp32 Model; TF32 alone is refused."""
    import torch

    from llm4llm.kernelbench import codegen
    from llm4llm.kernelbench.problem import build_model, inputs_for, load_module, make_task
    from llm4llm.kernelbench.templates import TEMPLATES, render_source
    from llm4llm.taskspec import load_spec

    spec = load_spec(make_task(kb_dir / "2_Gemm_Divide_Sum.py", tmp_path))
    t = {x.name: x for x in TEMPLATES}["kb.gemm_epilogue"]
    assert t.space(spec)["gemm_precision"] == ["tf32x3", "ieee"] and t.default(spec)["gemm_precision"] == "tf32x3"
    src = render_source(spec, {**t.default(spec), "gemm_precision": precision}, rewrite=False)
    assert f'input_precision="{precision}"' in src and f"triton_gemm_{precision}" in src
    problem = load_module(GEMM_SUM)
    new = load_module(GEMM_SUM + "\n" + src.split('"""', 2)[2])
    ref, cand = build_model(problem, "cpu"), build_model(new, "cpu", "ModelNew")
    x = inputs_for(problem, 7, "cpu")
    with torch.no_grad():
        torch.testing.assert_close(cand(*x), ref(*x), atol=1e-4, rtol=1e-4)
    with pytest.raises(codegen.Unsupported, match="gemm_precision"):
        render_source(spec, {**t.default(spec), "gemm_precision": "tf32"}, rewrite=False)


CONV_MISH = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, scale):
        super(Model, self).__init__()
        self.conv = nn.CONV(in_channels, out_channels, kernel_size, KWARGS)
        self.bias = nn.Parameter(torch.randn(out_channels, *([1] * ND)) * 0.02)
        self.scale = scale

    def forward(self, x):
        x = self.conv(x)
        x = torch.nn.functional.mish(x) * self.scale + self.bias
        return torch.softmax(x, dim=1)

def get_inputs():
    return [torch.rand(2, 3, *SPATIAL)]

def get_init_inputs():
    return [3, 20, KS, 2.0]
'''


@pytest.mark.parametrize("conv,ks,kwargs,precision,layout", [
    ("Conv2d", 3, "stride=1, padding=0", "tf32x3", "nc"), ("Conv2d", 3, "stride=2, padding=1", "ieee", "nc"),
    ("Conv2d", 3, "padding=2, dilation=2", "tf32x3", "cl"), ("Conv3d", 3, "padding=1", "tf32x3", "cl"),
    ("ConvTranspose2d", 3, "stride=1, padding=1", "tf32x3", "cl"),
    ("ConvTranspose2d", 3, "stride=2, padding=1, output_padding=1", "ieee", "nc"),
    ("ConvTranspose2d", 4, "stride=2, padding=1", "tf32x3", "cl"),
    ("ConvTranspose3d", 5, "stride=2, padding=2", "tf32x3", "nc"),
    ("ConvTranspose3d", 3, "stride=2, padding=1, output_padding=1", "tf32x3", "cl"),
    ("Conv2d", 3, "stride=2, padding=1, dilation=2", "tf32x3", "clk"), ("Conv3d", 3, "padding=0", "ieee", "clk")])
def test_conv_as_implicit_gemm_matches_the_model(tmp_path, conv, ks, kwargs, precision, layout):
    """kb.conv_epilogue: the convolution as an implicit GEMM in Triton with the pointwise tail on its accumulator
    (strides, padding, dilation, 2-D and 3-D; transposed ones split by output phase, kernels that the stride does
    and does not divide; 20 output channels, so a channel tile is partly masked), in the NC* layout and channels
    last (tap by tap, or with 8 input channels the K loop flattened over taps x channels); the fp32 Model's output
    within KernelBench's 1e-4 on fresh inputs. A dilated transposed conv leaves the template inapplicable."""
    import torch

    from llm4llm.kernelbench.problem import build_model, inputs_for, load_module, make_task
    from llm4llm.kernelbench.templates import TEMPLATES, render_source
    from llm4llm.taskspec import load_spec

    nd, cin = int(conv[-2]), 8 if layout == "clk" else 3  # the flattened K loop is the default from 4 channels
    src = (CONV_MISH.replace("2, 3, *SPATIAL", f"2, {cin}, *SPATIAL").replace("[3, 20, KS", f"[{cin}, 20, KS")
           .replace("CONV", conv).replace("KWARGS", kwargs).replace("ND", str(nd)).replace("KS", str(ks))
           .replace("SPATIAL", "(7, 8)" if nd == 2 else "(3, 4, 5)"))
    (tmp_path / "7_Conv_Mish_Softmax.py").write_text(src)
    spec = load_spec(make_task(tmp_path / "7_Conv_Mish_Softmax.py", tmp_path))
    t = {x.name: x for x in TEMPLATES}["kb.conv_epilogue"]
    assert t.why_not(spec) is None and t.default(spec)["conv_precision"] == "tf32x3"
    assert (t.default(spec)["conv_layout"] == "clk") == (layout == "clk")
    code = render_source(spec, {**t.default(spec), "conv_precision": precision, "BP": 32, "CK": 16, "BCO": 16,
                                "conv_layout": layout}, rewrite=False)
    assert ("_cl = " in code) == (layout != "nc")
    kind = f"triton_conv{'_transpose' if 'Transpose' in conv else ''}{nd}d_{precision}"
    assert kind in code and "torch.nn.functional.conv" not in code.split("class ModelNew")[1]
    problem = load_module(src)
    new = load_module(src + "\n" + code.split('"""', 2)[2])
    ref, cand = build_model(problem, "cpu"), build_model(new, "cpu", "ModelNew")
    # one fresh draw (not the task's seed 42): an indexing or precision slip misses 1e-4 on any random input, and a
    # second draw doubled the interpreter's time (~20 s for each 3-D transposed case)
    x = inputs_for(problem, 5, "cpu")
    with torch.no_grad():
        torch.testing.assert_close(cand(*x), ref(*x), atol=1e-4, rtol=1e-4)
    if "Transpose" in conv:
        (tmp_path / "8_ConvT.py").write_text(src.replace(kwargs, kwargs + ", dilation=2"))
        assert "transposed" in t.why_not(load_spec(make_task(tmp_path / "8_ConvT.py", tmp_path)))


SPLIT_REDUCTIONS = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, groups):
        super(Model, self).__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.bn = nn.BatchNorm2d(out_channels)
        self.gn = nn.GroupNorm(groups, out_channels)

    def forward(self, x):
        x = self.conv(x)
        x = self.bn(torch.tanh(x) * x)
        y = self.gn(x)
        return y.amax(dim=(0, 2, 3)) + y.mean(dim=(0, 2, 3)) + y.sum(dim=(0, 2, 3)) * 0.01

def get_inputs():
    return [torch.rand(3, 3, 14, 14) * 4 - 1]

def get_init_inputs():
    return [3, 4, 3, 2]
'''


GROUPNORM_512_ROWS = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, channels, groups):
        super(Model, self).__init__()
        self.gn = nn.GroupNorm(groups, channels)

    def forward(self, x):
        return torch.nn.functional.hardswish(self.gn(torch.sigmoid(x) * x))

def get_inputs():
    return [torch.rand(128, 16, 64, 64)]

def get_init_inputs():
    return [16, 4]
'''


@pytest.mark.parametrize("rsplit,split", [(0, True), (1, False)])
def test_a_few_hundred_long_rows_are_split(tmp_path, rsplit, split):
    """Problem 60's shape of reduction: a GroupNorm of 128 x 4 = 512 rows of 16K elements. One program a row would
    be 4 programs an SM; the generator splits each row (below 1024 rows) unless RSPLIT is 1. Rendered, not run."""
    from llm4llm.kernelbench.problem import make_task
    from llm4llm.kernelbench.templates import TEMPLATES, render_source
    from llm4llm.taskspec import load_spec

    (tmp_path / "6_GroupNorm_512_rows.py").write_text(GROUPNORM_512_ROWS)
    spec = load_spec(make_task(tmp_path / "6_GroupNorm_512_rows.py", tmp_path))
    t = {x.name: x for x in TEMPLATES}["kb.fused_tail"]
    src = render_source(spec, {**t.default(spec), "RSPLIT": rsplit}, rewrite=False)
    assert ("group_norm partials (4 chunks a row)" in src) == split, src[:400]


@pytest.mark.parametrize("rsplit", [1, 3, 0])
def test_split_reductions_match_the_model(tmp_path, rsplit):
    """A few long rows (BatchNorm's channels over N x H x W, a per-channel max, mean and sum) split over several
    programs a row: the chunk partials (a norm's chunk mean and squared deviations, combined by Chan's formula)
    give the fp32 Model's output within KernelBench's 1e-4; RSPLIT 1 keeps one program a row, 0 picks the split."""
    import torch

    from llm4llm.kernelbench.problem import build_model, inputs_for, load_module, make_task
    from llm4llm.kernelbench.templates import TEMPLATES, render_source
    from llm4llm.taskspec import load_spec

    (tmp_path / "5_Conv2d_BatchNorm_GroupNorm_Max.py").write_text(SPLIT_REDUCTIONS)
    spec = load_spec(make_task(tmp_path / "5_Conv2d_BatchNorm_GroupNorm_Max.py", tmp_path))
    t = {x.name: x for x in TEMPLATES}["kb.fused_tail"]
    src = render_source(spec, {**t.default(spec), "RSPLIT": rsplit, "BLOCK_R": 64}, rewrite=False)
    split = "partials (" in src
    assert split == (rsplit != 1), src[:400]
    if rsplit == 3:
        assert "batch_norm partials (3 chunks a row)" in src and "max partials (3 chunks a row)" in src
    problem = load_module(SPLIT_REDUCTIONS)
    new = load_module(SPLIT_REDUCTIONS + "\n" + src.split('"""', 2)[2])
    ref, cand = build_model(problem, "cpu"), build_model(new, "cpu", "ModelNew")
    for seed in (3, 4):
        x = inputs_for(problem, seed, "cpu")
        with torch.no_grad():
            torch.testing.assert_close(cand(*x), ref(*x), atol=1e-4, rtol=1e-4)


def test_run_passes_and_records_origins(kb_run):
    from storage import repo
    from storage.db import Database

    kb_run_id, rows, db, _ = kb_run
    assert [r.passed for r in rows] == [True]
    with Database(db) as d:
        res = repo.kb_results(d, kb_run_id)
        cands = repo.candidate_rows(d)
        curves = repo.kb_curves(d, kb_run_id)
        summary = repo.kb_summary(d, kb_run_id)
        bands = repo.kb_curve_bands(d, kb_run_id, resamples=200)
    assert dict(zip(res["problem"], res["origin"])) == {"2_Gemm_Divide_Sum.py": "rewrite"}
    assert list(bands["trial"]) == [1] and bands.iloc[0]["geo_p05"] <= bands.iloc[0]["geo_best"] <= \
        bands.iloc[0]["geo_p95"]
    assert set(cands["origin"]) == {"rewrite"} and cands["passed"].all()
    gates = cands.iloc[0]["gates_json"]
    assert "KernelBench: 5 trials" in str(gates) and "precision" in str(gates)
    assert summary.iloc[0]["pass_rate"] == 1.0
    assert list(curves["trial"]) == [1] and curves.iloc[0]["solved"] == 1.0  # curves come from the trials' rows


def test_origin_of_each_template():
    from llm4llm.search.types import Candidate
    from storage.rows import candidate_origin

    def origin(template, proposer="library"):
        return candidate_origin(Candidate(source=template, template=template, proposer=proposer))

    assert [origin("kb.fused_tail"), origin("kb.gemm_epilogue"), origin("kb.rewrite_fused_tail"),
            origin("", "llm:gpt")] == ["template", "template", "rewrite", "llm"]


# ----------------------------------------------------------------------------------------- adversarial candidates

# KernelBench's three adversarial kernels as its unit tests write them (CUDA C++ through load_inline)
_LOAD_INLINE = '''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

src = r"""
#include <torch/extension.h>
torch::Tensor f(torch::Tensor A) { %s }
"""
mod = load_inline(name="hack", cpp_sources="torch::Tensor f(torch::Tensor A);", cuda_sources=src, functions=["f"])

class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scaling_factor):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        return mod.f(x)
'''
KB_ORIGINALS = {
    "result_reuse": "return torch::empty({A.size(0), 1}, A.options());",
    "zero_out": "A.zero_(); return torch::zeros({A.size(0), 1}, A.options());",
    "non_default_stream": "auto s = at::cuda::getStreamFromPool(false, A.get_device()); "
                          "c10::cuda::CUDAStreamGuard g(s); return A.sum(1, true);",
}

_TRITON_HEAD = '''
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def _touch(x_ptr, out_ptr, n, ZERO_INPUT: tl.constexpr, WRITE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if ZERO_INPUT:
        tl.store(x_ptr + offs, tl.zeros([BLOCK], tl.float32), mask=offs < n)
    if WRITE:
        tl.store(out_ptr + offs, tl.zeros([BLOCK], tl.float32), mask=offs < 4)


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scaling_factor):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scaling_factor = scaling_factor
'''
# The same hacks ported to Triton, so that they pass the static gate where they can and meet the runtime gates
TRITON_PORTS = {
    # allocate the result and never write it: the reference's freed output may sit in that memory
    "result_reuse": ("""
    def forward(self, x):
        out = torch.empty((4, 1), device=x.device, dtype=torch.float32)
        _touch[(1,)](x, out, x.numel(), ZERO_INPUT=False, WRITE=False, BLOCK=64)
        return out
""", {"unwritten_output", "wrong_output"}),
    # zero the inputs and return zeros: a reference run after it would agree
    "zero_out": ("""
    def forward(self, x):
        out = torch.empty((4, 1), device=x.device, dtype=torch.float32)
        _touch[(1,)](x, out, x.numel(), ZERO_INPUT=True, WRITE=True, BLOCK=64)
        return out
""", {"input_mutated"}),
    # the work on a side stream, so that a timer on the caller's stream sees none of it
    "non_default_stream": ("""
    def forward(self, x):
        out = torch.empty((4, 1), device=x.device, dtype=torch.float32)
        with torch.cuda.stream(torch.cuda.Stream()):
            _touch[(1,)](x, out, x.numel(), ZERO_INPUT=False, WRITE=True, BLOCK=64)
        return out
""", {"static"}),
    # turn TF32 on: it would reach the reference in the same process
    "tf32_on": ("""
    def forward(self, x):
        torch.backends.cuda.matmul.allow_tf32 = True
        out = torch.empty((4, 1), device=x.device, dtype=torch.float32)
        _touch[(1,)](x, out, x.numel(), ZERO_INPUT=False, WRITE=True, BLOCK=64)
        return out
""", {"static"}),
    # torch does the work after the heavy op (allowed: cuBLAS for the GEMM; refused: torch's reduction)
    "torch_tail": ("""
    def forward(self, x):
        y = torch.nn.functional.linear(x, self.linear.weight, self.linear.bias)
        out = torch.empty((4, 1), device=x.device, dtype=torch.float32)
        _touch[(1,)](x, out, 0, ZERO_INPUT=False, WRITE=False, BLOCK=64)
        return y.sum(1, keepdim=True) * (self.scaling_factor / 2)
""", {"static"}),
}


@pytest.fixture(scope="module")
def gemm_task(kb_dir, tmp_path_factory) -> Path:
    from llm4llm.kernelbench.problem import make_task

    return make_task(kb_dir / "2_Gemm_Divide_Sum.py", tmp_path_factory.mktemp("kbtask"))


@pytest.fixture(scope="module")
def pool():
    from llm4llm.verify import VerifierPool

    with VerifierPool("cpu", timeout_s=120) as p:
        yield p


@pytest.mark.parametrize("name", sorted(KB_ORIGINALS))
def test_kernelbench_adversarial_originals_are_rejected(pool, gemm_task, name):
    v = pool.verify(gemm_task, _LOAD_INLINE % KB_ORIGINALS[name])
    assert not v.passed and v.failure_class == "static" and "torch.utils" in v.message


@pytest.mark.parametrize("name", sorted(TRITON_PORTS))
def test_kernelbench_adversarial_ports_are_rejected(pool, gemm_task, name):
    body, expect = TRITON_PORTS[name]
    v = pool.verify(gemm_task, _TRITON_HEAD + textwrap.indent(textwrap.dedent(body), "    "))
    assert not v.passed and v.utility == 0.0
    assert v.failure_class in expect, f"{name}: {v.failure_class}: {v.message[-600:]}"


def test_the_cpu_compile_gate_drives_a_modelnew(kb_dir, tmp_path):
    """`kernelbench --device cpu` runs the CPU verifier's sm_90 compile gate: it must build and call the ModelNew a
    KernelBench candidate defines (it has no `entry`), or every candidate fails there."""
    from llm4llm.kernelbench.problem import make_task
    from llm4llm.kernelbench.templates import TEMPLATES
    from llm4llm.taskspec import load_spec
    from llm4llm.verify.aot import aot_gate

    task_dir = make_task(kb_dir / "2_Gemm_Divide_Sum.py", tmp_path)
    spec = load_spec(task_dir)
    t = {x.name: x for x in TEMPLATES}["kb.rewrite_fused_tail"]
    g = aot_gate(str(task_dir), t.render(spec, t.default(spec)), 90)
    assert g.passed and g.name == "compile_sm90", g.detail
