"""Compile Triton kernels for a GPU target on a machine without one.

Triton's interpreter (the CPU path of the tests and of the CPU verifier) accepts programs the GPU compiler rejects:
a variable rebound to another shape inside a branch, a dtype mix the interpreter's numpy silently promotes. This
module records the kernel launches a piece of code makes (without running them) and compiles each for a target
(default: the target GPU's, kernels_runtime.hardware) through `triton.compile`, which needs no device. It checks
compilation only, with the installed Triton (the GPU image's may be another version): no launch, no numerics.

    launches = capture_launches(lambda: my_op(x, w))
    errors = compile_launches(launches)  # [] when every kernel compiles for sm_90

    python -m llm4llm.verify.aot TASK_DIR...   # every applicable template's default rendering, fp32 and bf16
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl")


@dataclass
class Launch:
    fn: Any  # triton JITFunction
    signature: dict[str, str]
    constexprs: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", str(self.fn))

    def key(self) -> tuple:
        return (id(self.fn), tuple(sorted(self.signature.items())), repr(sorted(self.constexprs.items(), key=str)),
                tuple(sorted(self.options.items())))


def _arg_type(value: Any) -> str | None:
    """Triton signature type of a runtime argument; None: passed as a constexpr (None, dtypes, strings)."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in _TYPES:
            raise TypeError(f"no Triton pointer type for {value.dtype}")
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, TensorDescriptor):  # a host-made TMA descriptor: Triton's own type string
        from triton.runtime.jit import mangle_type

        return mangle_type(value)
    return None


def _launch_of(fn, args: tuple, kwargs: dict) -> Launch:
    params = fn.params
    values: dict[str, Any] = {}
    for p, v in zip(params, args):
        values[p.name] = v
    for p in params[len(args):]:
        if p.name in kwargs:
            values[p.name] = kwargs[p.name]
        elif p.has_default:
            values[p.name] = p.default
    signature, constexprs = {}, {}
    for p in params:
        if p.name not in values:
            raise TypeError(f"{fn.__name__}: no value for parameter {p.name}")
        v = values[p.name]
        t = None if p.is_constexpr else _arg_type(v)
        if t is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
        else:
            signature[p.name] = t
    options = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
    return Launch(fn, signature, constexprs, options)


@contextlib.contextmanager
def _recording(launches: list[Launch]):
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):  # noqa: ARG001 - the launch is recorded, never executed
        launches.append(_launch_of(self, args, kwargs))

    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = original


def capture_launches(call: Callable[[], Any]) -> list[Launch]:
    """The kernel launches `call()` makes, recorded and not executed (outputs stay unwritten). Must run without
    TRITON_INTERPRET (under the interpreter kernels are not JITFunctions)."""
    launches: list[Launch] = []
    with _recording(launches):
        call()
    unique: dict[tuple, Launch] = {}
    for launch in launches:
        unique.setdefault(launch.key(), launch)
    return list(unique.values())


def compile_launches(launches: list[Launch], arch: int = 90, warp_size: int = 32) -> list[str]:
    """Compile each launch for CUDA `arch`; returns one message per kernel that does not compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, warp_size)
    errors = []
    for launch in launches:
        try:
            src = ASTSource(fn=launch.fn, signature=launch.signature, constexprs=launch.constexprs)
            triton.compile(src, target=target, options=launch.options or None)
        except Exception as e:  # noqa: BLE001 - every failing kernel is reported
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            errors.append(f"{launch.name}: {type(e).__name__}: {' | '.join(lines[-6:])[:1500]}")
    return errors




def candidate_launches(task_dir: str, source: str, dtype: torch.dtype | None = None) -> list[Launch]:
    """The launches of a candidate source's `entry` called on the task's first captured case (floating tensors cast
    to `dtype` when given: the bf16 code paths differ). Run without TRITON_INTERPRET."""
    import tempfile
    from pathlib import Path

    from llm4llm.taskkind import kind_of
    from llm4llm.taskspec import load_task
    from llm4llm.verify.candidate import load_candidate, unload_candidate

    task = load_task(Path(task_dir))
    case = task.cases[0]

    def cast(d):
        return {k: v.to(dtype) if dtype is not None and v.is_floating_point() and k not in _FP32_STATE else v
                for k, v in d.items()}

    name = f"llm4llm_aot_{abs(hash((task_dir, source, str(dtype))))}"
    with tempfile.TemporaryDirectory(prefix="llm4llm-aot-") as tmp:
        module = load_candidate(source, Path(tmp), name)
        try:
            if (kind := kind_of(task.spec)) is not None:  # its candidate is not an `entry`: the kind calls it
                return capture_launches(kind.launch_call(task, module))
            return capture_launches(lambda: module.entry(cast(case.inputs), cast(case.weights), cast(case.state),
                                                         dict(task.spec.static)))
        finally:
            unload_candidate(name)


def template_launches(task_dir: str, template: str, dtype: torch.dtype | None = None) -> list[Launch]:
    """`candidate_launches` of `template`'s default rendering for the task."""
    from pathlib import Path

    from llm4llm.search.templates import TEMPLATES
    from llm4llm.taskspec import load_spec

    spec = load_spec(Path(task_dir))
    t = next(t for t in TEMPLATES if t.name == template)
    return candidate_launches(task_dir, t.render(spec, t.default(spec)), dtype)


# States HF keeps in fp32 whatever the model dtype (Mamba's ssm_state, RecurrentGemma's RG-LRU state)
_FP32_STATE = {"ssm_state", "rg_lru_state"}


def compile_templates(task_dirs: list[str], arch: int = 90) -> dict[str, list[str]]:
    """Every template that applies to each task, default config, fp32 and bf16: {"template/task/dtype": errors}."""
    from pathlib import Path

    from llm4llm.search.templates import TEMPLATES
    from llm4llm.taskspec import load_spec

    out: dict[str, list[str]] = {}
    for d in task_dirs:
        spec = load_spec(Path(d))
        for t in TEMPLATES:
            # a lossy template is compiled as for an opted-in 16-bit workload (the tiny workloads opt in to nothing)
            probe = spec.model_copy(update={"accuracy_budget": spec.accuracy_budget or {"max_logit_deviation": 1.0},
                                            "dtype": "bfloat16"}) if t.lossy else spec
            if t.family != spec.family or spec.phase not in t.phases or t.why_not(probe) is not None:
                continue
            for dtype in ((torch.bfloat16,) if t.lossy else (None, torch.bfloat16)):
                key = f"{t.name}/{Path(d).name}/{'bfloat16' if dtype else 'captured dtype'}"
                try:
                    out[key] = compile_launches(template_launches(d, t.name, dtype), arch)
                except Exception as e:  # noqa: BLE001 - a rendering that cannot even be called is an error too
                    out[key] = [f"capture: {type(e).__name__}: {str(e)[:500]}"]
    return out


def aot_arch() -> int | None:
    """The CPU verifier's compile target: LLM4LLM_AOT_ARCH (default: the target GPU's, kernels_runtime.hardware);
    "0" or "" turns the gate off."""
    import os

    from kernels_runtime.hardware import TARGET

    value = os.environ.get("LLM4LLM_AOT_ARCH", str(TARGET.arch)).strip()
    return int(value) if value and value != "0" else None


def aot_gate(task_dir: str, source: str, arch: int = 90, timeout_s: float = 600.0):
    """The verifier's GPU-compile gate on a machine without a GPU: the candidate's launches on the task's first case,
    compiled for `arch` in a subprocess without TRITON_INTERPRET (the verifier's own process runs the interpreter).
    Returns a GateResult named compile_sm<arch>."""
    import json
    import subprocess
    from pathlib import Path

    from llm4llm.verify.sandbox import copy_readonly, kill_group, make_box, remove_box, sandboxed_popen
    from llm4llm.verify.verdict import GateResult

    name = f"compile_sm{arch}"
    # the candidate's code runs here too (its launches are captured by calling it): in the sandbox, like the worker
    box = make_box("llm4llm-aot-")
    try:
        cand = box / "ro" / "candidate.py"
        cand.write_text(source)
        local = box / "ro" / "task"
        copy_readonly(Path(task_dir), local)
        proc = sandboxed_popen("llm4llm.verify.aot:main", box=box, args=["--arch", str(arch), "--candidate",
                               str(cand), str(local)], extra_env={"TRITON_INTERPRET": "0"},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.communicate()
            return GateResult(name=name, passed=False, detail=f"no answer within {timeout_s:.0f}s")
        kill_group(proc.pid)  # nothing it started outlives it
    finally:
        remove_box(box)
    try:
        errors = json.loads(out)[str(cand)]
    except (ValueError, KeyError):
        # the checker itself failed (this machine's Triton, an import): not the candidate's fault, nothing is lost
        tail = (err or out).strip().splitlines()[-8:]
        return GateResult(name=name, passed=True, detail="skipped: the compile check could not run here: "
                          + " | ".join(tail)[:2000])
    if errors:
        return GateResult(name=name, passed=False, detail="the GPU compiler rejects what the interpreter ran: "
                          + " || ".join(errors)[:6000])
    return GateResult(name=name, passed=True, detail=f"every launch compiles for sm_{arch} (not run)")


def main(argv: list[str] | None = None) -> int:
    """python -m llm4llm.verify.aot [--arch 90] TASK_DIR... : compile every applicable template; with --candidate
    FILE TASK_DIR: that candidate's launches. Prints JSON {key: [errors]}."""
    import json
    import os
    import sys

    import argparse

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("llm4llm.verify.aot: unset TRITON_INTERPRET (the interpreter replaces the kernels)", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(prog="python -m llm4llm.verify.aot")
    ap.add_argument("task_dirs", nargs="+")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--candidate", default=None, help="a candidate source file: compile its launches instead")
    args = ap.parse_args(argv)
    if args.candidate:
        source = open(args.candidate).read()
        try:
            errors = compile_launches(candidate_launches(args.task_dirs[0], source), args.arch)
        except Exception as e:  # noqa: BLE001 - a source that cannot be called here is reported, not raised
            errors = [f"capture: {type(e).__name__}: {str(e)[:1000]}"]
        result = {args.candidate: errors}
    else:
        result = compile_templates(args.task_dirs, args.arch)
    print(json.dumps(result, indent=1))
    return 1 if any(result.values()) else 0


__all__ = ["Launch", "aot_arch", "aot_gate", "candidate_launches", "capture_launches", "compile_launches",
           "compile_templates", "template_launches"]

if __name__ == "__main__":
    raise SystemExit(main())
