"""The verifier counts launches that take kernels_runtime's cached path (which skips `JITFunction.run`). On the
H200 (2026-12-02) every GEMV candidate failed `launches_triton` as "no_triton" after the first call of a key: the
weight-streaming MLP and lm_head templates never reached a search on qwen3-4b. The cached path needs a GPU, so
this drives it with a stand-in compiled kernel."""
import types

import torch

from kernels_runtime.ops import _common
from llm4llm.verify.candidate import LAUNCHES, install_launch_hook


class _Kernel:
    function, packed_metadata = object(), object()

    def __init__(self):
        self.runs = 0

    def launch_metadata(self, *a):
        return None

    def run(self, *a):
        self.runs += 1


class _Jit:
    """What `launch` needs of a JITFunction: `fn[grid](...)` returning the compiled kernel, and its signature."""

    def __init__(self):
        import inspect

        self.kernel = _Kernel()
        self.signature = inspect.signature(lambda x_ptr, n, BLOCK=None: None)

    def __getitem__(self, grid):
        return lambda *a, **k: self.kernel


def test_cached_launches_are_counted_by_the_verifier(monkeypatch):
    install_launch_hook()
    install_launch_hook()  # idempotent: one observer
    assert _common.LAUNCH_OBSERVERS.count(LAUNCHES.record_cached) == 1
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    monkeypatch.setattr(_common, "_on_gpu", lambda args: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(_common, "_LAUNCHERS", {})
    jit, x = _Jit(), torch.ones(4)
    _common.launch(jit, (1,), (x, 4), {"BLOCK": 16})  # first call of the key: Triton's own path (fn[grid])
    LAUNCHES.reset()
    _common.launch(jit, (1,), (x, 4), {"BLOCK": 16})  # cached: kernel.run directly
    assert jit.kernel.runs == 1 and LAUNCHES.count == 1
    monkeypatch.setattr(_common, "LAUNCH_OBSERVERS", [])  # without the observer the launch went uncounted
    LAUNCHES.reset()
    _common.launch(jit, (1,), (x, 4), {"BLOCK": 16})
    assert jit.kernel.runs == 2 and LAUNCHES.count == 0
