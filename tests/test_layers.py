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


def test_a_wrong_import_breaks_the_contract(tmp_path):
    """The same contracts over a tree of the project's package names (and the modules a contract names) where
    kernels_runtime imports storage and a flow imports a stage directly."""
    pytest.importorskip("importlinter")
    for pkg in ("cli", "llm4llm", "llm4llm/stages", "kernels_runtime", "storage", "tasks", "flows", "deployments"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "llm4llm" / "isolation.py").write_text("")
    (tmp_path / "kernels_runtime" / "patch.py").write_text("import storage\n")
    (tmp_path / "flows" / "optimize.py").write_text("import llm4llm.stages\n")
    (tmp_path / ".importlinter").write_text((ROOT / ".importlinter").read_text())
    res = _lint(tmp_path)
    assert res.returncode != 0 and "BROKEN" in res.stdout, res.stdout[-3000:]
    assert "kernels_runtime.patch -> storage" in res.stdout
    assert "flows.optimize -> llm4llm.stages" in res.stdout, res.stdout[-3000:]


SQL = re.compile(r"""["'](SELECT|INSERT INTO|CREATE TABLE|ALTER TABLE|DELETE FROM|UPDATE \w+ SET)\s""")


def test_sql_lives_in_storage_only():
    offenders = []
    for pkg in ("cli", "llm4llm", "kernels_runtime", "tasks", "flows", "deployments"):
        for f in (ROOT / pkg).rglob("*.py"):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if SQL.search(line):
                    offenders.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders)
