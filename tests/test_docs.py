"""The docs a new engineer starts from stay short and true: docs/status.md is one page of short table cells,
docs/contributing.md exists and names only files that exist, and every script under scripts/ has its line in
scripts/README.md."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATUS_MAX_LINES = 150
CELL_MAX_CHARS = 300
# the recipes' worked examples: files a contributor creates, not files of the repository
EXAMPLES = {"kernels_runtime/ops/softcap.py", "tests/ops/test_softcap.py", "examples/workloads/tiny-qwen2.toml"}
PATH = re.compile(r"(?<![\w./])((?:scripts|tests|kernels_runtime|llm4llm|storage|examples|docs)/[\w./-]*\w)")


def _cells(text: str) -> list[tuple[int, str]]:
    """(line number, cell) of every markdown table cell; `\\|` inside a cell is not a separator."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("|"):
            out += [(n, c.strip()) for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
    return out


def test_cells_split_on_unescaped_pipes_only():
    assert _cells("text\n| a | b \\| c |\n") == [(2, "a"), (2, "b \\| c")]


def test_status_is_one_page_of_short_cells():
    text = (ROOT / "docs" / "status.md").read_text()
    assert len(text.splitlines()) < STATUS_MAX_LINES
    long = [f"line {n}: {len(c)} chars: {c[:80]}..." for n, c in _cells(text) if len(c) > CELL_MAX_CHARS]
    assert not long, f"docs/status.md: cells over {CELL_MAX_CHARS} characters (history goes to docs/results):\n" + \
        "\n".join(long)


def test_contributing_names_only_files_that_exist():
    text = (ROOT / "docs" / "contributing.md").read_text()
    for section in ("## Add an op", "## Add a template", "## Add a family", "## Add a workload",
                    "## Run a GPU benchmark and record it"):
        assert section in text
    named = {p.rstrip(".") for p in PATH.findall(text)} - EXAMPLES
    missing = sorted(p for p in named if not (ROOT / p).exists() and not p.startswith("docs/results/D"))
    assert not missing, f"docs/contributing.md names files that do not exist: {missing}"


def test_every_script_has_its_line_in_the_scripts_readme():
    readme = (ROOT / "scripts" / "README.md").read_text()
    scripts = sorted(p.relative_to(ROOT / "scripts").as_posix() for p in (ROOT / "scripts").rglob("*")
                     if p.suffix in (".py", ".sh"))
    missing = [s for s in scripts if f"`scripts/{s}`" not in readme and f"`{Path(s).name}`" not in readme]
    assert not missing, f"scripts/README.md: no line for {missing}"
