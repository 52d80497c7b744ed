"""KernelBench as a task kind (llm4llm/taskkind.py): its ModelNew contract end to end, registered by entry name
so the verifier and the LLM call it without importing this package. The parts live beside it: the static gate
(static.py), the benchmark's judging and timing protocol (protocol.py), the prompt (prompt.py)."""
from __future__ import annotations

import ast
from typing import Any, Callable

from llm4llm.kernelbench import prompt
from llm4llm.kernelbench.problem import REFERENCE
from llm4llm.llm.extract import Target


class KernelBenchKind:
    name = REFERENCE
    target = Target(ast.ClassDef, "ModelNew", "no_model_new", "class ModelNew(nn.Module)")
    final_instruction = prompt.FINAL_INSTRUCTION

    def static_gate(self, source: str):
        from llm4llm.kernelbench.static import check_modelnew

        return check_modelnew(source)

    def judge(self, v, task, module, dev, timing: bool) -> tuple[Any, bool]:
        """KernelBench's protocol compares ModelNew with Model in one process, as the benchmark does."""
        from llm4llm.kernelbench.protocol import run_kb

        return run_kb(v, task, module, dev, timing)

    def launch_call(self, task, module) -> Callable[[], Any]:
        """A KernelBench candidate is a ModelNew, not an `entry` (and its task captures no cases): built as the
        protocol builds it, on the CPU with its own seeded weights (launches depend on shapes, not values), called
        through the protocol's `entry` adapter on the problem's seed-42 inputs, the ones KernelBench times."""
        from llm4llm.kernelbench.problem import SEED, build_model, inputs_for, load_module
        from llm4llm.kernelbench.protocol import make_entry

        problem = load_module(task.spec.static["source"], f"kb_ref_aot_{task.spec.task_id.replace('-', '_')}")
        entry = make_entry(build_model(problem, "cpu", cls=module.ModelNew), task.spec.input_names, functional=False)
        inputs = dict(zip(task.spec.input_names, inputs_for(problem, SEED, "cpu")))
        return lambda: entry(inputs, {}, {}, dict(task.spec.static))

    def worker_handover(self) -> tuple[Any, dict[str, str]]:
        """The GPU lock the shards of a run share, opened here and handed over: the child cannot reach its path."""
        from llm4llm.kernelbench.protocol import LOCK_FD_ENV, open_gpu_lock

        lock = open_gpu_lock()
        return lock, ({LOCK_FD_ENV: str(lock.fileno())} if lock else {})

    def system_prompt(self) -> str:
        return prompt.system_prompt()

    def task_section(self, task) -> str:
        return prompt.task_section(task)


KIND = KernelBenchKind()
