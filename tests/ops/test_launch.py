"""kernels_runtime.ops._common.launch: the first call of a specialization goes through Triton's JIT, later ones call
the bound compiled kernel with every signature argument in order (constexprs and their defaults last); a new
specialization (alignment, an int's divisibility, a constexpr) goes through the JIT again. A fake JIT function stands
in for Triton's (the interpreter has no compiled kernels)."""
import inspect

import torch

from kernels_runtime.ops import _common


class _FakeKernel:
    function, packed_metadata = "fn", "meta"

    def launch_metadata(self, grid, stream, *args):
        return ("md", stream, len(args))

    def __init__(self, log):
        self.log = log

    def run(self, *a):
        self.log.append(("run", a))


class _FakeJit:
    def __init__(self):
        self.log = []
        self.signature = inspect.signature(lambda x, n, BLOCK, FLAG=False: None)

    def __getitem__(self, grid):
        def call(*args, **kw):
            self.log.append(("jit", grid, args, kw))
            return _FakeKernel(self.log)
        return call


def test_cached_launch_binds_once_per_specialization(monkeypatch):
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 7})())
    monkeypatch.setitem(_common._CACHED_LAUNCH, "on", True)
    jit = _FakeJit()
    x = torch.zeros(64)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # stands in for a CUDA tensor
    _common.launch(jit, (3,), (x, 32), {"BLOCK": 16}, num_warps=4)
    _common.launch(jit, (5, 2), (x, 48), {"BLOCK": 16}, num_warps=4)  # same specialization: 48 % 16 == 0
    assert [e[0] for e in jit.log] == ["jit", "run"]
    from triton import knobs
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    assert jit.log[1][1] == (5, 2, 1, 7, "fn", "meta", ("md", 7, 4), *hooks, x, 48, 16, False)
    _common.launch(jit, (3,), (x, 33), {"BLOCK": 16}, num_warps=4)  # 33: another int specialization
    _common.launch(jit, (3,), (x[1:], 32), {"BLOCK": 16}, num_warps=4)  # misaligned pointer
    _common.launch(jit, (3,), (x, 32), {"BLOCK": 32}, num_warps=4)  # another constexpr
    _common.launch(jit, (3,), (x, 32), {"BLOCK": 16}, num_warps=8)  # another launch option
    assert [e[0] for e in jit.log] == ["jit", "run", "jit", "jit", "jit", "jit"]
    monkeypatch.setitem(_common._CACHED_LAUNCH, "on", False)  # LLM4LLM_CACHED_LAUNCH=0: always the JIT
    _common.launch(jit, (3,), (x, 32), {"BLOCK": 16}, num_warps=4)
    assert jit.log[-1][0] == "jit"
