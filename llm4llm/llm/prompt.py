"""The messages an LLM proposer sends: the task as a kernel engineer needs it, then what the search has learned.

System: the candidate contract and the answer format. User, in order: the task (reference source, phase and its
contract, every observed shape, hardware, dtype and tolerance, boundary names, static values), compact experience
from earlier episodes, this episode's feedback (newest last), the previous attempt's source when repairing, and the
best known kernel as a seed. Each part is capped so a long episode cannot push the task out of the context.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from llm4llm.taskspec import TaskSpec

REFERENCE_CHARS = 12_000
SEED_CHARS = 10_000
SEED_MODULES = 4  # library modules shown with a seed (its host module first, then the kernels it calls)
FEEDBACK_ITEMS = 8
FEEDBACK_MESSAGE_CHARS = 1_200
EXPERIENCE_CHARS = 4_000

PHASE_CONTRACTS = {
    "prefill": "prefill: the model's forward processes many new positions at once (q_len > 1), typically without a "
               "past cache. This kernel is dispatched only then; it is never called with q_len == 1, so optimise for "
               "the long-sequence shapes below (parallelise over rows/tokens and heads).",
    "decode": "decode: exactly one new position per sequence (q_len == 1) with a non-empty cache. This kernel is "
              "dispatched only then; latency is dominated by launch overhead and memory traffic of weights/cache, so "
              "minimise launches and read each byte once: every launch costs host time and a gap on the GPU, often "
              "more than a small kernel's own work, and the candidate is timed installed in the module through the "
              "runtime's dispatch, as the model runs it, so fusing steps into fewer kernels beats tuning one of many. State tensors (KV cache, SSM state) hold the past: read "
              "them and return their updated values under `state_out.<name>` exactly as the reference does. "
              "A kernel may write the new state over the `state` tensor it was given and return that same "
              "tensor (no copy back into the cache: fewer launches); then set `STATE_IN_PLACE = True` at module "
              "level and do every check before the first state write (such a kernel cannot fall back once it "
              "started).",
}

SYSTEM = """You are an expert GPU kernel engineer writing Triton kernels for LLM inference.
You replace one PyTorch module call with a faster implementation that launches Triton kernels.

Candidate contract (checked by an AST gate, then by correctness and timing gates):
- Python source defining a top-level `def entry(inputs: dict, weights: dict, state: dict, static: dict) -> dict`.
  `inputs`, `weights`, `state` map names to torch tensors; `static` maps names to JSON values.
  Return a dict with every output name (and `state_out.<name>` for every state tensor the call updates).
- It must launch at least one `@triton.jit` kernel that does the computation.
- Allowed imports only: {imports}. Nothing else (no transformers, no torch.nn / torch.nn.functional).
- Outside kernels, torch is for allocation, views and metadata only ({torch_allowed}, tensor .view/.reshape/
  .contiguous/.stride/.shape/.to ...). No torch compute (matmul, sum, softmax, exp, .mean(), @ ...).
- Do not mention the reference module's class name. No getattr/eval/exec/open, no dunder attributes, no modules
  reached through attributes of allowed ones (`torch.cuda.os`), no assignment to attributes of imported modules.
- Never modify the input tensors in place; never cache outputs between calls; return fresh output tensors on every
  call (never an input, a weight or a buffer kept from an earlier call); use the current CUDA stream.
- Handle every observed shape below (masks for non-power-of-2 sizes); accumulate in float32 for half inputs.
- Write for the GPU compiler, not only the interpreter: without a GPU the kernels run in Triton's interpreter and
  are also compiled for sm_90 (a variable keeps one type and shape across runtime branches; constexpr sizes).

Answer with a short plan (at most a few sentences), then the complete source in ONE ```python fenced block."""


@dataclass
class PromptParts:
    """What the proposer shows besides the task; the ids let it set the candidate's parent."""

    previous_source: str | None = None
    previous_id: str | None = None
    seed_source: str | None = None
    seed_label: str = ""
    seed_id: str | None = None


def _static_gate_names() -> tuple[str, str]:
    try:
        from llm4llm.verify.static_check import ALLOWED_MODULES, OPS_PACKAGE, TORCH_ALLOWED
    except ImportError:
        return ("torch, triton, triton.language, math, functools, typing, dataclasses, kernels_runtime.ops.*",
                "torch.empty/empty_like/zeros/full/arange and dtypes")
    imports = ", ".join(sorted(ALLOWED_MODULES - {"__future__"})) + f", {OPS_PACKAGE}.*"
    torch_allowed = ", ".join(f"torch.{n}" for n in sorted(TORCH_ALLOWED) if n.islower())
    return imports, torch_allowed


def system_prompt() -> str:
    imports, torch_allowed = _static_gate_names()
    return SYSTEM.format(imports=imports, torch_allowed=torch_allowed)


@functools.lru_cache(maxsize=64)
def reference_source(module_class: str) -> str | None:
    """The reference module class's source, when its import path imports here."""
    mod_name, _, cls_name = module_class.rpartition(".")
    if not mod_name:
        return None
    try:
        cls = getattr(importlib.import_module(mod_name), cls_name)
        return inspect.getsource(cls)
    except Exception:  # any import or lookup failure means "not available here"; the spec still describes the call
        return None


def ops_sources(source: str) -> list[tuple[str, str]]:
    """(module, source) of each `kernels_runtime.ops` or `kernels_runtime.hosts` module a seed imports, and of the
    modules such a host module imports in turn: the seed is often a thin wrapper, and the kernel (or the template's
    host code and the kernels it calls) worth showing lives there."""
    import importlib.util
    import re

    pattern = re.compile(r"^\s*(?:from|import)\s+(kernels_runtime\.(?:ops|hosts)\.\w+)", re.M)
    out, todo, seen = [], list(dict.fromkeys(pattern.findall(source))), set()
    while todo:
        mod = todo.pop(0)
        if mod in seen:
            continue
        seen.add(mod)
        try:
            spec = importlib.util.find_spec(mod)
            if spec and spec.origin:
                with open(spec.origin) as f:
                    text = f.read()
        except (ImportError, OSError, ValueError):
            continue
        out.append((mod, text))
        if mod.startswith("kernels_runtime.hosts."):
            todo += [m for m in pattern.findall(text) if m not in seen]
    return out


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n... [{len(text) - limit} more characters cut]"


def _sig(name: str, s: Any) -> str:
    return f"{name}: {s.dtype}{list(s.shape)}"


def task_section(task: TaskSpec) -> str:
    from kernels_runtime.tolerances import FLOOR_FACTOR, TOLERANCES

    import torch

    more = " ..." if len(task.instances) > 4 else ""
    lines = [f"# Task {task.task_id or '(unsaved)'}",
             f"family: {task.family}; reference module: {task.module_class} "
             f"({len(task.instances)} instance(s): {', '.join(task.instances[:4])}{more})",
             f"phase: {PHASE_CONTRACTS.get(task.phase, task.phase)}"]
    if task.dispatch:
        lines.append(f"dispatch predicate: {task.dispatch.predicate}; otherwise the original forward runs")
    hw = task.hardware or {}
    lines.append("hardware: " + (", ".join(f"{k}={v}" for k, v in hw.items()) if hw else "unspecified"))
    dtype = getattr(torch, task.dtype, None)
    tol = TOLERANCES.get(dtype)
    lines.append(f"dtype: {task.dtype}; tolerance: atol={tol.atol}, rtol={tol.rtol} (NaN/Inf never pass)"
                 if tol else f"dtype: {task.dtype}")
    if dtype in (torch.bfloat16, torch.float16):
        lines.append(f"16-bit: an output outside that tolerance still passes if it is no further from an fp32 "
                     f"reference than {FLOOR_FACTOR:g}x the {task.dtype} reference's own distance (accumulate in "
                     f"fp32, round once)")
    lines.append(f"inputs: {task.input_names}; weights: {task.weight_names}; state: {task.state_names or 'none'}; "
                 f"outputs: {task.output_names}")
    if task.state_names:
        lines.append("return also: " + ", ".join(f"state_out.{n}" for n in task.state_names))
    lines.append(f"static: {task.static}")
    lines.append(f"observed shape signatures ({len(task.cases)}; all must work):")
    for k, case in enumerate(task.cases):
        parts = [_sig(n, s) for n, s in case.inputs.items()] + [_sig(f"state.{n}", s) for n, s in case.state.items()]
        outs = [_sig(n, s) for n, s in case.outputs.items()]
        lines.append(f"  [{k}] x{case.calls} calls: {', '.join(parts)}" + (f" -> {', '.join(outs)}" if outs else ""))
    ref = reference_source(task.module_class)
    if ref:
        lines += ["reference implementation (called with the weights above; match it numerically):",
                  "```python", _clip(ref.rstrip(), REFERENCE_CHARS), "```"]
    return "\n".join(lines)


def experience_section(experience: list[Any]) -> str | None:
    texts = []
    for e in experience:
        t = e.to_prompt_text() if hasattr(e, "to_prompt_text") else str(e)
        if t:
            texts.append(t)
    if not texts:
        return None
    body = _clip("\n\n".join(texts[-4:]), EXPERIENCE_CHARS)
    return "# Experience from earlier episodes (durable lessons; respect these constraints)\n" + body


def _feedback_line(f: Any, label: str) -> str:
    status = "PASSED" if f.passed else f"FAILED [{f.failure_class or 'unknown'}]"
    parts = [f"{label} {status}"]
    if f.max_abs_err is not None:
        parts.append(f"max_abs_err={f.max_abs_err:.3g}")
    if f.speedup is not None:
        parts.append(f"speedup={f.speedup:.3g}x")
    line = "; ".join(parts)
    message = (f.message or "").strip()
    if message:
        line += "\n    " + _clip(message, FEEDBACK_MESSAGE_CHARS).replace("\n", "\n    ")
    return line


def feedback_section(feedback: list[Any]) -> str | None:
    if not feedback:
        return None
    shown = feedback[-FEEDBACK_ITEMS:]
    head = f"# This episode's results so far ({len(feedback)} trial(s), showing the last {len(shown)}, newest last)"
    lines = [head]
    for k, f in enumerate(shown, start=len(feedback) - len(shown) + 1):
        who = f.template or "?"
        lines.append(_feedback_line(f, f"trial {k} ({who}, {f.candidate_id[:10]}):"))
    passed = [f for f in feedback if f.passed]
    if passed:
        best = max(passed, key=lambda f: (f.utility, f.speedup or 0.0))
        lines.append(f"best so far: {best.candidate_id[:10]} utility={best.utility:.3g}")
    return "\n".join(lines)


def build_messages(task: TaskSpec, experience: list[Any], feedback: list[Any], parts: PromptParts | None = None
                   ) -> list[dict[str, str]]:
    """The chat messages for one sample. A task of another kind (llm4llm/taskkind.py; KernelBench's ModelNew
    contract and the problem's source) gets its kind's system prompt, task section and last line in place of the
    entry() contract's; everything after the task is shared."""
    from llm4llm.taskkind import kind_of

    kind = kind_of(task)
    parts = parts or PromptParts()
    sections = [kind.task_section(task) if kind else task_section(task)]
    for s in (experience_section(experience), feedback_section(feedback)):
        if s:
            sections.append(s)
    if parts.previous_source:
        sections.append("# Your previous attempt (the last trial above); fix its failure or make it faster\n"
                        "```python\n" + _clip(parts.previous_source.rstrip(), SEED_CHARS) + "\n```")
    if parts.seed_source:
        seed = f"# A working kernel to start from ({parts.seed_label}); beat it, do not copy it\n" \
               "```python\n" + _clip(parts.seed_source.rstrip(), SEED_CHARS) + "\n```"
        for mod, text in ops_sources(parts.seed_source)[:SEED_MODULES]:
            seed += f"\nwhere {mod} is:\n```python\n" + _clip(text.rstrip(), SEED_CHARS) + "\n```"
        sections.append(seed)
    sections.append(kind.final_instruction if kind else
                    "Write the complete candidate source now: one ```python block defining entry(...).")
    system = kind.system_prompt() if kind else system_prompt()
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(sections)}]
