"""The layer rules of docs/architecture.md, checked: import-linter's contracts (.importlinter) and SQL in storage/."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(LINT, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"})


def test_the_import_contracts_hold():
    pytest.importorskip("importlinter")
    res = _lint(ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout


PACKAGES = ("cli", "llm4llm", "llm4llm/stages", "llm4llm/verify", "llm4llm/kernelbench", "llm4llm/search",
            "llm4llm/llm", "kernels_runtime", "storage", "tasks", "flows", "deployments")
MODULES = ("llm4llm/isolation", "llm4llm/verify/gates", "llm4llm/verify/judge", "llm4llm/verify/verdict",
           "llm4llm/verify/static_gate", "llm4llm/verify/static_check", "llm4llm/kernelbench/protocol",
           "llm4llm/kernelbench/static")
# Each wrong import (file, source) and the line of lint-imports' report that names it; the last two are the circles
# the verifier had, each hidden behind a function-local import.
WRONG = {
    ("kernels_runtime/patch.py", "import storage\n"): "kernels_runtime.patch -> storage",
    ("flows/optimize.py", "import llm4llm.stages\n"): "flows.optimize -> llm4llm.stages",
    ("storage/rows.py", "def f():\n    from llm4llm import accept\n"): "storage.rows -> llm4llm",
    ("llm4llm/report.py", "def f():\n    import cli\n"): "llm4llm.report -> cli",
    ("llm4llm/verify/timing.py", "import llm4llm.verify.judge\n\n\ndef f():\n    from llm4llm.verify import gates\n"):
        "llm4llm.verify.timing -> llm4llm.verify.gates",
    ("llm4llm/verify/static_check.py", "def f():\n    from llm4llm.kernelbench import static\n"):
        "llm4llm.verify.static_check -> llm4llm.kernelbench.static",
    # the verifier and the LLM naming a benchmark: a task kind is found by entry name (llm4llm/taskkind.py)
    ("llm4llm/verify/aot.py", "def f():\n    from llm4llm.kernelbench import protocol\n"):
        "llm4llm.verify.aot -> llm4llm.kernelbench.protocol",
    ("llm4llm/llm/prompt.py", "def f():\n    from llm4llm.kernelbench import static\n"):
        "llm4llm.llm.prompt -> llm4llm.kernelbench.static",
    # a circle between the core's subpackages (the sandbox once imported the LLM's redaction)
    ("llm4llm/llm/extract.py", "from llm4llm.verify import static_check\n"): "No cycles are allowed in llm4llm.",
    ("llm4llm/verify/sandbox.py", "def f():\n    from llm4llm.llm import extract\n"): "No cycles are allowed in llm4llm.",
}


def test_a_wrong_import_breaks_the_contract(tmp_path):
    """The same contracts over a tree of the project's package names (and the modules a contract names) where
    kernels_runtime imports storage, a flow imports a stage directly, storage imports the core, the core imports
    the CLI, the verifier's two old circles come back, the verifier or the LLM imports KernelBench, and the verifier
    and the LLM import each other."""
    pytest.importorskip("importlinter")
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    for mod in MODULES:
        (tmp_path / f"{mod}.py").write_text("")
    (tmp_path / "llm4llm/verify/gates.py").write_text("from llm4llm.verify import timing\n")
    for (path, source) in WRONG:
        (tmp_path / path).write_text(source)
    (tmp_path / ".importlinter").write_text((ROOT / ".importlinter").read_text())
    res = _lint(tmp_path)
    assert res.returncode != 0 and "BROKEN" in res.stdout, res.stdout[-3000:]
    for line in WRONG.values():
        assert line in res.stdout, (line, res.stdout[-3000:])


def test_no_module_imports_itself_round_a_circle():
    """No circle anywhere at module level, function-local imports included (grimp, import-linter's graph): the
    acyclic_siblings contract covers each package's children, this the modules across packages."""
    grimp = pytest.importorskip("grimp")
    sys.path.insert(0, str(ROOT))
    try:
        g = grimp.build_graph("cli", "llm4llm", "kernels_runtime", "storage", "tasks", "flows", "deployments")
    finally:
        sys.path.remove(str(ROOT))
    circles = sorted(f"{a} -> {b} -> ... -> {a}" for a in g.modules for b in g.find_modules_directly_imported_by(a)
                     if g.chain_exists(importer=b, imported=a))
    assert circles == [], "\n".join(circles)


SQL = re.compile(r"""["'](SELECT|INSERT INTO|CREATE TABLE|ALTER TABLE|DELETE FROM|UPDATE \w+ SET)\s""")


def test_sql_lives_in_storage_only():
    offenders = []
    for pkg in ("cli", "llm4llm", "kernels_runtime", "tasks", "flows", "deployments"):
        for f in (ROOT / pkg).rglob("*.py"):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if SQL.search(line):
                    offenders.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders)


def _defined_functions(folder: Path) -> dict[str, str]:
    import ast

    names = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = str(path.relative_to(ROOT))
    return names


def test_no_task_is_named_like_a_stage_function():
    """tasks/ holds the Prefect wrappers, llm4llm/stages/ the stages: a function of one named like one of the other
    is the mirror issue 41 removed (a wrapper is named for the task it is: `search_task`, `describe`)."""
    tasks, stages = _defined_functions(ROOT / "tasks"), _defined_functions(ROOT / "llm4llm" / "stages")
    both = sorted(set(tasks) & set(stages))
    assert not both, [(n, tasks[n], stages[n]) for n in both]
