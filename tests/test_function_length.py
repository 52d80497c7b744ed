"""No function outside Triton kernels runs over 80 lines (issue 23): where one does, it holds two ideas. A Triton
kernel stays whole (docs/duplicates.md says why), so `@triton.jit` functions are left out."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("llm4llm", "kernels_runtime", "flows", "tasks", "storage", "deployments", "scripts", "cli")
LIMIT = 80


def _is_triton(fn: ast.AST) -> bool:
    return any("triton" in ast.unparse(d) for d in getattr(fn, "decorator_list", []))


def long_functions(root: Path = ROOT) -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton(node):
                    n = node.end_lineno - node.lineno + 1
                    if n > LIMIT:
                        out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_outside_triton_kernels_is_over_80_lines():
    assert long_functions() == []


def test_the_check_sees_a_long_function(tmp_path):
    pkg = tmp_path / "llm4llm"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (pkg / "m.py").write_text(f"def long():\n{body}\n\n\n@triton.jit\ndef kernel():\n{body}\n")
    for p in PACKAGES[1:]:
        (tmp_path / p).mkdir()
    assert long_functions(tmp_path) == [f"llm4llm{__import__('os').sep}m.py:1 long ({LIMIT + 1} lines)"]
