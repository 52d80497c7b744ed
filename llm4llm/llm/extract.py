"""Code out of an LLM answer: the fenced Python block that defines the candidate's `Target` (a model task's
`entry`; a task kind's own, llm4llm/taskkind.py), else an unfenced fallback.

Every way an answer can be unusable is an `ExtractionError` with a `kind` (empty, truncated, no_code, or the
target's missing kind: no_entry for a model task's answer);
the proposer turns it into a candidate with empty source and `config["error"]`, which the verifier records as a
failed (static) trial. Nothing here raises anything else.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+\-.]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.S | re.M)
_FENCE_LINE = re.compile(r"^[ \t]*```", re.M)
_PY_LANGS = {"", "python", "py", "python3", "triton"}
_CODE_START = re.compile(r"^(import |from |@triton|def |class |[A-Z_][A-Z0-9_]* = )", re.M)


class ExtractionError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class Target:
    """What an answer must define at top level: a function or a class of this name; `missing` is the error kind of
    an answer without it, `wording` how messages name it."""

    node: type  # ast.FunctionDef or ast.ClassDef
    name: str
    missing: str
    wording: str

    @property
    def fallback(self) -> re.Pattern:
        """Its definition found by a regex, where the code does not parse."""
        if self.node is ast.ClassDef:
            return re.compile(rf"^class {self.name}\b", re.M)
        return re.compile(rf"^def {self.name}\s*\(", re.M)


ENTRY = Target(ast.FunctionDef, "entry", "no_entry", "entry(inputs, weights, state, static)")


@dataclass(frozen=True)
class Extracted:
    code: str
    how: str  # "fenced", "fenced-joined", "unfenced"


def defines(code: str, target: Target = ENTRY) -> bool:
    """Whether `code` defines `target` at top level."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, RecursionError, MemoryError):  # nested too deeply too
        return bool(target.fallback.search(code))  # the compile gate reports the syntax error with its line
    return any(isinstance(n, target.node) and n.name == target.name for n in tree.body)


def _has_kernel(code: str) -> bool:
    return "@triton." in code or "kernels_runtime" in code


def extract_code(text: str | None, finish_reason: str | None = None, target: Target = ENTRY) -> Extracted:
    """The candidate source in `text`: the code defining `target` (a model task's `entry`, or a task kind's).
    `finish_reason == "length"` (the token limit cut the answer) is truncation even when a closed block precedes
    the cut: the model may have meant to revise it."""
    missing_kind, wording = target.missing, target.wording
    if text is None or not text.strip():
        raise ExtractionError("empty", "the model returned no text")
    if finish_reason == "length":
        raise ExtractionError("truncated", "the answer hit max_tokens (finish_reason=length); raise llm.max_tokens "
                                           "or ask for shorter code")
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    if len(_FENCE_LINE.findall(text)) % 2:
        raise ExtractionError("truncated", "a ``` code fence is opened but never closed")
    py = [body for lang, body in blocks if lang in _PY_LANGS]
    if py:
        with_entry = [i for i, b in enumerate(py) if defines(b, target)]
        if with_entry:
            last = with_entry[-1]  # the last one: models revise in place
            if _has_kernel(py[last]) or not any(_has_kernel(b) for b in py[:last]):
                return Extracted(py[last].strip() + "\n", "fenced")
            # The kernel in one block, the launcher in another: join the helper blocks before it.
            parts = [b.strip() for i, b in enumerate(py[:last]) if i not in with_entry] + [py[last].strip()]
            return Extracted("\n\n".join(parts) + "\n", "fenced-joined")
        joined = "\n\n".join(b.strip() for b in py)
        if defines(joined, target):
            return Extracted(joined + "\n", "fenced-joined")
        raise ExtractionError(missing_kind, f"{len(py)} Python block(s), none defines {wording}")
    if blocks:
        raise ExtractionError("no_code", f"code blocks in {sorted({l or '?' for l, _ in blocks})} only, no Python")
    start = _CODE_START.search(text)
    if start and defines(text[start.start():], target):
        return Extracted(text[start.start():].strip() + "\n", "unfenced")
    raise ExtractionError("no_code", f"no Python code defining {wording} in the answer")
