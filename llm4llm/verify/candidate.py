"""Loading a candidate's source as a fresh module, and counting the Triton launches it makes."""
from __future__ import annotations

import importlib.util
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType


@dataclass
class LaunchLog:
    """Triton launches since the last reset; on CUDA also the stream each was launched on."""

    count: int = 0
    streams: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.count, self.streams = 0, []

    def record_cached(self, args: tuple) -> None:
        self.record(args, {})

    def record(self, args: tuple, kwargs: dict) -> None:
        with self.lock:
            self.count += 1
            stream = _current_cuda_stream(args, kwargs)
            if stream is not None:
                self.streams.append(stream)


LAUNCHES = LaunchLog()


def _current_cuda_stream(args: tuple, kwargs: dict) -> int | None:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    dev = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_cuda), None)
    return torch.cuda.current_stream(dev).cuda_stream if dev is not None else None


def install_launch_hook() -> None:
    """Wrap every Triton launcher entry point (`JITFunction.run`, the interpreter's `run`) so launches are counted.
    Autotuners and `kernels_runtime.ops` launchers all pass through these. Idempotent."""
    from triton.runtime.jit import JITFunction

    from kernels_runtime.ops import _common

    if LAUNCHES.record_cached not in _common.LAUNCH_OBSERVERS:  # kernels_runtime's cached launches skip run()
        _common.LAUNCH_OBSERVERS.append(LAUNCHES.record_cached)
    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:
        pass
    for cls in classes:
        orig = cls.run
        if getattr(orig, "_llm4llm_counted", False):
            continue

        def run(self, *args, _orig=orig, **kwargs):
            if not kwargs.get("warmup", False):
                LAUNCHES.record(args, kwargs)
            return _orig(self, *args, **kwargs)

        run._llm4llm_counted = True
        cls.run = run


def load_candidate(source: str, workdir: Path, name: str) -> ModuleType:
    """Exec `source` as a fresh module backed by a real file (Triton reads kernel source with `inspect`)."""
    path = Path(workdir) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and Triton resolve globals through sys.modules
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def unload_candidate(name: str) -> None:
    sys.modules.pop(name, None)
