"""The LLM prompt for KernelBench tasks: KernelBench's candidate contract (a `ModelNew(nn.Module)` module), not the
`entry(inputs, weights, state, static)` contract of the other tasks.

The rules the model is told are read from the code that enforces them: the static gate's lists
(llm4llm/kernelbench/static.py, llm4llm/verify/static_check.py) and the protocol's constants
(llm4llm/kernelbench/protocol.py, problem.py), so the prompt cannot drift from the gates. The problem's source comes
from the task's own spec (`static["source"]`, stored when the task was made), never from files outside it.
"""
from __future__ import annotations

from typing import Any

from llm4llm.taskspec import TaskSpec

SOURCE_CHARS = 12_000
FINAL_INSTRUCTION = ("Write the complete candidate source now: one ```python block defining "
                     "`class ModelNew(nn.Module)` (and its Triton kernels).")

SYSTEM = """You are an expert GPU kernel engineer writing Triton kernels for KernelBench problems.
You replace a PyTorch reference model (`class Model(nn.Module)`) with a faster `class ModelNew(nn.Module)` whose
forward launches Triton kernels.

Candidate contract (KernelBench's; checked by an AST gate, then by KernelBench's correctness and timing protocol):
- Python source defining a top-level `class ModelNew(nn.Module)`. It is built as `ModelNew(*get_init_inputs())`, so
  its `__init__` takes the same arguments as `Model.__init__`; it is called as `model(*get_inputs())`, so its
  `forward` takes the same arguments as `Model.forward` and returns the same tensor (shape, fp32).
- Create the same parameters and buffers as `Model.__init__` (same attribute names, shapes and order): both models
  are built under the same seed, so this gives identical weights, and a ModelNew whose state_dict matches Model's has
  the reference's weights bound by name. `__init__` may use torch freely (nn.Linear, nn.Conv2d, nn.Parameter, ...).
- At least one `@triton.jit` kernel must do the computation. Outside `__init__` and the kernels, torch is for
  allocation, views and metadata only ({torch_allowed}; tensor .view/.reshape/.contiguous/.stride/.shape ...) plus
  these library heavy ops, called on the module's own parameters: {heavy} (tensor methods: {heavy_methods}).
  Every other op (elementwise, activations, normalisation, pooling, reductions, softmax ...) must be a Triton kernel;
  torch.nn.functional's other functions, torch compute functions and tensor compute methods ({compute}) are refused
  there.
- Allowed imports only: {imports}. Refused anywhere: {forbidden} (no CUDA/C++ extensions, no torch.compile, no side
  streams, no precision settings).
- Do not mention `Model` (the reference). No {builtins}, no dunder attributes other than __init__.
- Never modify the inputs or the weights in place; never cache outputs between calls; use the current CUDA stream.
- Write for the GPU compiler, not only the interpreter (constexpr block sizes; masks for non-power-of-2 sizes).

{protocol}

Answer with a short plan (at most a few sentences), then the complete source in ONE ```python fenced block defining
`class ModelNew`."""


def protocol_text() -> str:
    """KernelBench's protocol and the precision rule, from the constants the verifier uses."""
    from llm4llm.kernelbench.problem import SEED
    from llm4llm.kernelbench.protocol import ATOL, PERF_TRIALS, RTOL, TRIALS, WARMUP

    return (f"Correctness (KernelBench's protocol): fp32 throughout; both models built under seed {SEED} (identical "
            f"weights) and left in training mode; {TRIALS} trials with fresh seeds (drawn from seed {SEED}) plus the "
            f"seed-{SEED} inputs, get_inputs() under each trial's seed and the seed set again before each forward; "
            f"every trial must pass torch.allclose(out, ref, atol={ATOL:g}, rtol={RTOL:g}); NaN/Inf never pass. "
            f"Inputs and weights must come back bit-identical, outputs are primed with poison, an output equal to an "
            f"earlier trial's is a cached result.\n"
            f"Timing: CUDA events after {WARMUP} warm-up calls, the L2 cache flushed before each of up to "
            f"{PERF_TRIALS} trials; the score is the mean time against eager PyTorch and against torch.compile "
            f"(inductor, default mode), both measured in the same call.\n"
            f"Precision: TF32 is off for both models, and a candidate that changes a precision setting is rejected. "
            f"tl.dot on fp32 inputs defaults to TF32: pass input_precision=\"ieee\" (or \"tf32x3\", only if the "
            f"result still meets {ATOL:g}). No TF32 and no bf16/fp16 computation inside this fp32 problem unless the "
            f"result still meets atol=rtol={ATOL:g} in every trial; accumulate in fp32.")


def system_prompt() -> str:
    from llm4llm.kernelbench.static import ALLOWED_IMPORTS, FORBIDDEN, HEAVY_CALLS, HEAVY_METHODS
    from llm4llm.verify.static_check import COMPUTE_METHODS, FORBIDDEN_BUILTINS, TORCH_ALLOWED

    return SYSTEM.format(
        torch_allowed=", ".join(f"torch.{n}" for n in sorted(TORCH_ALLOWED) if n.islower()),
        heavy=", ".join(sorted(HEAVY_CALLS)), heavy_methods=", ".join(f".{m}" for m in sorted(HEAVY_METHODS)),
        compute=", ".join(f".{m}" for m in sorted(COMPUTE_METHODS - HEAVY_METHODS)),
        imports=", ".join(sorted(ALLOWED_IMPORTS - {"__future__"})), forbidden=", ".join(FORBIDDEN),
        builtins="/".join(sorted(n for n in FORBIDDEN_BUILTINS if not n.startswith("__"))),
        protocol=protocol_text())


def _sig(name: str, s: Any) -> str:
    return f"{name}: {s.dtype}{list(s.shape)}"


def task_section(task: TaskSpec) -> str:
    """The problem as the model needs it: its source (Model, get_inputs, get_init_inputs), the shapes get_inputs()
    gives, the parameter names to keep, the hardware."""
    from llm4llm.kernelbench.protocol import ATOL, RTOL

    static = task.static or {}
    hw = task.hardware or {}
    lines = [f"# Task {task.task_id or '(unsaved)'}",
             f"KernelBench problem {static.get('problem', task.module_class)}: replace `Model` below by `ModelNew`",
             "hardware: " + (", ".join(f"{k}={v}" for k, v in hw.items()) if hw else "unspecified"),
             f"dtype: {task.dtype}; tolerance: allclose atol={ATOL:g}, rtol={RTOL:g} (KernelBench's)"]
    for case in task.cases[:1]:
        lines.append("forward(" + ", ".join(_sig(n, s) for n, s in case.inputs.items()) + ") -> "
                     + ", ".join(_sig(n, s) for n, s in case.outputs.items()))
    lines.append(f"Model's parameters and buffers (keep these state_dict names): {task.weight_names or 'none'}")
    source = static.get("source", "")
    if source:
        clipped = source if len(source) <= SOURCE_CHARS else \
            source[:SOURCE_CHARS] + f"\n... [{len(source) - SOURCE_CHARS} more characters cut]"
        lines += ["the problem (the reference `Model`, and the inputs and constructor arguments KernelBench uses):",
                  "```python", clipped.rstrip(), "```"]
    return "\n".join(lines)
