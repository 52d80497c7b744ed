"""Task kinds (llm4llm/taskkind.py): the verifier and the LLM ask a task's kind for its contract and name no
benchmark; KernelBench is one kind, found by entry name."""
import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from llm4llm import taskkind
from llm4llm.llm.extract import Target
from llm4llm.llm.prompt import build_messages
from llm4llm.verify.static_check import StaticReport
from llm4llm.verify.static_gate import check_task_source

ROOT = Path(__file__).resolve().parents[1]


class _Toy:
    """A kind with a contract of its own: candidates define `Toy`, the static gate refuses every source."""

    name = "toy"
    target = Target(ast.ClassDef, "Toy", "no_toy", "class Toy")
    final_instruction = "Write the toy."

    def static_gate(self, source: str) -> StaticReport:
        return StaticReport(False, f"toy gate saw {len(source)} chars")

    def system_prompt(self) -> str:
        return "toy system"

    def task_section(self, task) -> str:
        return f"# toy task {task.task_id}"


TOY = _Toy()


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(taskkind.ENTRIES, "toy", f"{__name__}:TOY")
    monkeypatch.setattr(taskkind, "_LOADED", {})
    return SimpleNamespace(reference="toy", task_id="t1", module_class="Anything")


def test_a_registered_kind_serves_the_static_gate_and_the_prompt(toy):
    assert taskkind.kind_of(toy) is TOY
    rep = check_task_source("class Toy: pass\n", toy)
    assert not rep.ok and rep.reason == "toy gate saw 16 chars"
    system, user = build_messages(toy, [], [])
    assert system["content"] == "toy system"
    assert user["content"].startswith("# toy task t1") and user["content"].endswith("Write the toy.")


def test_a_model_task_has_no_kind_and_kernelbench_is_one():
    assert taskkind.kind_of(SimpleNamespace(reference="module.pt via torch.func.functional_call")) is None
    kb = taskkind.kind_of(SimpleNamespace(reference="kernelbench"))
    assert kb.name == "kernelbench" and kb.target.name == "ModelNew"


def test_the_verifier_and_the_llm_name_no_benchmark():
    """No code line (comments and docstrings aside) of llm4llm/verify or llm4llm/llm names KernelBench; the imports
    are .importlinter's `kinds` contract."""
    offenders = []
    for pkg in ("verify", "llm"):
        for f in (ROOT / "llm4llm" / pkg).glob("*.py"):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if re.search(r"""["']kernelbench["']|ModelNew["']""", code, re.IGNORECASE):
                    offenders.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
