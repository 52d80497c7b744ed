"""Constants in a KernelBench forward (Triton's interpreter): a Python float and a one-element tensor made in forward
fold into the kernels as literals, a registered buffer is read like a weight, a plain tensor attribute and a tensor
made in forward become non-persistent buffers of ModelNew. Each problem is written here in KernelBench's format;
each is covered by the generator (no longer "graph not covered: graph constants") and its ModelNew gives the fp32
Model's output within KernelBench's 1e-4, through the verifier's own entry (weights bound by name)."""
from __future__ import annotations

import pytest

FLOAT_CONSTANT = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, in_features, out_features, scale, shift):
        super(Model, self).__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale
        self.shift = shift

    def forward(self, x):
        x = self.linear(x) * self.scale - torch.tensor(self.shift)
        return torch.where(x > 0, x, x * torch.tensor(0.125, device=x.device))

def get_inputs():
    return [torch.rand(5, 24) - 0.5]

def get_init_inputs():
    return [24, 12, 1.75, 0.3125]
'''

REGISTERED_BUFFER = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size):
        super(Model, self).__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.register_buffer("offset", torch.randn(1, out_channels, 1, 1))
        self.alpha = nn.Parameter(torch.tensor(0.75))
        self.gain = torch.tensor(1.25)

    def forward(self, x):
        x = self.conv(x) + self.offset
        return torch.tanh(x) * self.alpha * self.gain

def get_inputs():
    return [torch.rand(2, 3, 9, 7)]

def get_init_inputs():
    return [3, 5, 3]
'''

FORWARD_TENSOR = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size):
        super(Model, self).__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)

    def forward(self, x):
        x = self.conv(x)
        w = torch.tensor([0.5, -1.0, 2.0, 0.25], device=x.device)
        return torch.softmax(x * w.view(1, -1, 1, 1), dim=1)

def get_inputs():
    return [torch.rand(2, 3, 6, 6)]

def get_init_inputs():
    return [3, 4, 3]
'''

NESTED_ATTRIBUTE = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, features):
        super(Model, self).__init__()
        self.blocks = nn.ModuleList([nn.Linear(features, features)])
        self.blocks[0].gate = torch.linspace(-1.0, 1.0, features)

    def forward(self, x):
        block = self.blocks[0]
        return torch.sigmoid(block(x) * block.gate)

def get_inputs():
    return [torch.rand(3, 8)]

def get_init_inputs():
    return [8]
'''

UNKNOWN_CONSTANT = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, features):
        super(Model, self).__init__()
        self.table = [torch.randn(features)]

    def forward(self, x):
        return torch.relu(x + self.table[0])

def get_inputs():
    return [torch.rand(3, 8)]

def get_init_inputs():
    return [8]
'''


def _task(tmp_path, name: str, src: str):
    from llm4llm.kernelbench.problem import make_task
    from llm4llm.taskspec import load_spec

    (tmp_path / name).write_text(src)
    return load_spec(make_task(tmp_path / name, tmp_path))


def _matches_the_model(src: str, code: str, seeds=(3, 4)) -> None:
    """ModelNew against the eager Model on fresh inputs, called as the verifier calls it (the reference's state
    dict bound by name: the constants' buffers are not part of it)."""
    import torch

    from llm4llm.kernelbench.problem import build_model, inputs_for, load_module
    from llm4llm.kernelbench.protocol import _same_layout, make_entry
    from llm4llm.kernelbench.static import check_modelnew

    assert check_modelnew(code).ok, check_modelnew(code).reason
    problem = load_module(src)
    new = load_module(src + "\n" + code.split('"""', 2)[2])
    ref, cand = build_model(problem, "cpu"), build_model(new, "cpu", "ModelNew")
    assert _same_layout(ref, cand)
    entry = make_entry(cand, ["x"], functional=True)
    weights = dict(ref.state_dict())
    for seed in seeds:
        x = inputs_for(problem, seed, "cpu")
        with torch.no_grad():
            torch.testing.assert_close(entry({"x": x[0]}, weights, {}, {})["out"], ref(*x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("template", ["kb.fused_tail", "kb.gemm_epilogue"])
def test_scalar_constants_fold_into_the_epilogue(tmp_path, template):
    """A Python float (`x * self.scale`) and one-element tensors made in forward (`torch.tensor(self.shift)`,
    `torch.tensor(0.125, device=x.device)`) are literals in the kernel that stores the GEMM's tail: no buffer."""
    from llm4llm.kernelbench.templates import TEMPLATES, render_source

    spec = _task(tmp_path, "1_Gemm_Scale_Shift_LeakyWhere.py", FLOAT_CONSTANT)
    t = {x.name: x for x in TEMPLATES}[template]
    assert t.why_not(spec) is None
    code = render_source(spec, {**t.default(spec), "BM": 16, "BN": 16, "BK": 16}, rewrite=False)
    kernels = code.split("class ModelNew")[0]
    assert "* 1.75)" in kernels and "- 0.3125)" in kernels and "* 0.125)" in kernels
    assert "register_buffer" not in code
    _matches_the_model(FLOAT_CONSTANT, code)


def test_registered_buffer_and_tensor_attribute(tmp_path):
    """A registered buffer is read like a weight (`self.offset`); a plain tensor attribute, which `.to(device)`
    leaves on the host, is copied into a non-persistent buffer of ModelNew that moves with it; a scalar Parameter
    is loaded in the kernel."""
    from llm4llm.kernelbench.templates import TEMPLATES, render_source

    spec = _task(tmp_path, "2_Conv2d_Buffer_Tanh_Scale.py", REGISTERED_BUFFER)
    for name in ("kb.fused_tail", "kb.conv_epilogue"):
        assert {x.name: x for x in TEMPLATES}[name].why_not(spec) is None, name
    t = {x.name: x for x in TEMPLATES}["kb.fused_tail"]
    code = render_source(spec, t.default(spec), rewrite=False)
    forward = code.split("def forward")[1]
    assert "= self.offset" in forward and "= self.alpha" in forward and "self.gain" not in forward
    assert "torch.as_tensor(self.gain)" in code and "persistent=False" in code
    _matches_the_model(REGISTERED_BUFFER, code)


def test_attribute_of_an_unnamed_submodule(tmp_path):
    """A plain tensor attribute under a ModuleList entry (`blocks.0.gate`), and that entry's parameters: reached
    through get_submodule, since `self.blocks.0` is no Python."""
    from llm4llm.kernelbench.templates import TEMPLATES, render_source

    spec = _task(tmp_path, "5_Gemm_Gate_Sigmoid.py", NESTED_ATTRIBUTE)
    t = {x.name: x for x in TEMPLATES}["kb.fused_tail"]
    assert t.why_not(spec) is None
    code = render_source(spec, t.default(spec), rewrite=False)
    assert "torch.as_tensor(self.get_submodule('blocks.0').gate)" in code
    assert "= self.get_submodule('blocks.0').weight" in code.split("def forward")[1]
    _matches_the_model(NESTED_ATTRIBUTE, code)


@pytest.mark.parametrize("template", ["kb.fused_tail", "kb.conv_epilogue"])
def test_tensor_made_in_forward_is_a_buffer(tmp_path, template):
    """`torch.tensor([...], device=x.device)` in forward: its values written into ModelNew's constructor as a
    buffer, viewed and broadcast like a weight; the view is bound before the first kernel, so the implicit-GEMM
    conv can apply it in its epilogue (the graph has the view after the conv)."""
    from llm4llm.kernelbench.templates import TEMPLATES, render_source

    spec = _task(tmp_path, "3_Conv2d_ChannelScale_Softmax.py", FORWARD_TENSOR)
    t = {x.name: x for x in TEMPLATES}[template]
    assert t.why_not(spec) is None
    code = render_source(spec, {**t.default(spec), "BP": 32, "CK": 16, "BCO": 16}, rewrite=False)
    assert "torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float32)" in code
    forward = code.split("def forward")[1].splitlines()
    view = next(i for i, line in enumerate(forward) if ".view((1, 4, 1, 1))" in line)
    assert view < next(i for i, line in enumerate(forward) if "_k1[" in line)
    _matches_the_model(FORWARD_TENSOR, code)


def test_a_constant_of_unknown_value_is_refused_by_name(tmp_path):
    """A tensor the capture only sees as fake (inside a list attribute) has no value to write out: the template
    says so instead of rendering a wrong candidate."""
    from llm4llm.kernelbench.templates import TEMPLATES

    spec = _task(tmp_path, "4_Add_ListConstant_ReLU.py", UNKNOWN_CONSTANT)
    reason = {x.name: x for x in TEMPLATES}["kb.fused_tail"].why_not(spec)
    assert reason is not None and "of unknown value" in reason


def test_the_verifier_passes_a_candidate_with_constants(tmp_path):
    """The whole KernelBench protocol on the CPU (static gate, canaries, trials, cached-output check) over the
    buffer problem's rendered candidate."""
    from llm4llm.kernelbench.problem import make_task
    from llm4llm.kernelbench.templates import TEMPLATES
    from llm4llm.taskspec import load_spec
    from llm4llm.verify import VerifierPool

    (tmp_path / "2_Conv2d_Buffer_Tanh_Scale.py").write_text(REGISTERED_BUFFER)
    task_dir = make_task(tmp_path / "2_Conv2d_Buffer_Tanh_Scale.py", tmp_path)
    spec = load_spec(task_dir)
    t = {x.name: x for x in TEMPLATES}["kb.fused_tail"]
    with VerifierPool("cpu", timeout_s=120) as pool:
        v = pool.verify(task_dir, t.render(spec, t.default(spec)))
    assert v.passed, f"{v.failure_class}: {v.message[-600:]}"
