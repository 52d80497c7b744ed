"""The API-correction layer: rewrites of generated source for kernel-DSL version differences (paper appendix A.3).

LLMs write against whichever Triton they were trained on (`tl.math.tanh`, `tl.libdevice.*`, `tl.float8e4`). These
rules fix the spelling only; they never touch fusion scope, tiling, masking, precision or launch structure. Each rule
has an id and a Triton version range; the ids that changed a candidate are recorded in its config
(`config["api_corrections"]`) and the uncorrected text stays in the transcript, so a fix is always visible.

Users add rules without editing the package: a TOML or Python file named by `LLM4LLM_CORRECTIONS` or
`[llm] corrections` (docs/llm.md). A user rule with a built-in rule's id replaces it.

Limits: rules are textual (regex) or whole-source functions; a regex also rewrites matching text in comments and
strings, which is harmless for these spellings. Conditions are judged against the Triton installed where the
proposer runs, which must match the verifier's (the flow and the GPU workers share one environment).
"""
from __future__ import annotations

import ast
import importlib.util
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from llm4llm.errors import Llm4llmError

TANH_HELPER = "_l4l_tanh"


class CorrectionsError(Llm4llmError):
    """A corrections file or rule that cannot be used."""


@dataclass
class Rule:
    """One rewrite. `triton`: a PEP 440 range the installed Triton must fall in ("" = any). Exactly one of
    `pattern` (+ `replacement`, re.sub syntax) or `fn` (source -> source)."""

    id: str
    description: str = ""
    triton: str = ""
    pattern: str | None = None
    replacement: str = ""
    fn: Callable[[str], str] | None = None
    flags: int = re.MULTILINE
    origin: str = "builtin"
    _regex: re.Pattern | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.id:
            raise CorrectionsError("correction rule: expected a non-empty id, got none")
        if (self.pattern is None) == (self.fn is None):
            raise CorrectionsError(f"correction rule {self.id}: expected exactly one of pattern or fn")
        try:
            SpecifierSet(self.triton)
        except InvalidSpecifier as e:
            raise CorrectionsError(f"correction rule {self.id}: expected a version range like '>=3.0,<4', "
                                   f"got {self.triton!r}") from e
        if self.pattern is not None:
            try:
                self._regex = re.compile(self.pattern, self.flags)
            except re.error as e:
                raise CorrectionsError(f"correction rule {self.id}: bad regex {self.pattern!r}: {e}") from e

    def applies_to(self, triton_version: str) -> bool:
        try:
            version = Version(triton_version)
        except InvalidVersion:
            return True
        return SpecifierSet(self.triton).contains(version, prereleases=True)

    def apply(self, source: str) -> str:
        if self._regex is not None:
            return self._regex.sub(self.replacement, source)
        return self.fn(source)


def installed_triton_version() -> str:
    import triton

    return triton.__version__.split("+")[0]


# --- the built-in rules ---------------------------------------------------------------------------------------

_TANH_HELPER_SRC = f'''
@triton.jit
def {TANH_HELPER}(x):
    # tanh from exp (added by the API-correction layer: Triton 3.0 dropped math.tanh): portable to every backend
    # and the interpreter; exp(-2|x|) keeps large |x| from overflowing.
    xf = x.to(tl.float32)
    e = tl.exp(-2.0 * tl.abs(xf))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(xf >= 0, t, -t).to(x.dtype)
'''
_ELEMENTWISE_RENAMES = {"max": "maximum", "min": "minimum"}  # tl.math.max was elementwise before 3.0


def _ensure_triton_imports(source: str) -> str:
    lines = []
    if not re.search(r"^import triton\s*$", source, re.M):
        lines.append("import triton")
    if not re.search(r"^import triton\.language as tl\s*$", source, re.M):
        lines.append("import triton.language as tl")
    return "\n".join(lines) + "\n" + source if lines else source


def _after_imports(source: str, block: str) -> str:
    """`source` with `block` inserted after its last top-level import (at the top when unparsable)."""
    try:
        body = ast.parse(source).body
    except (SyntaxError, RecursionError, MemoryError):  # nested too deeply too
        return block.lstrip("\n") + "\n" + source
    last = 0
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            last = node.end_lineno or node.lineno
    lines = source.splitlines(keepends=True)
    return "".join(lines[:last]) + block + "\n" + "".join(lines[last:])


def _tanh_from_exp(source: str) -> str:
    pattern = re.compile(r"\b(?:tl\.math|triton\.language\.math|tl\.libdevice|tl|libdevice)\.tanh\s*\(")
    if not pattern.search(source) or _has_attr(_tl(), "tanh"):
        return source
    if re.search(r"\btl\.extra\.(cuda|hip)\.libdevice\.tanh", source):
        return source
    source = pattern.sub(f"{TANH_HELPER}(", source)
    if f"def {TANH_HELPER}(" not in source:
        source = _after_imports(_ensure_triton_imports(source), _TANH_HELPER_SRC)
    return source


def _tl():
    import triton.language as tl

    return tl


def _has_attr(obj: Any, name: str) -> bool:
    return name in dir(obj)


def _libdevice_names() -> set[str]:
    tl = _tl()
    try:
        return {n for n in dir(tl.extra.cuda.libdevice) if not n.startswith("_")}
    except AttributeError:
        return set()


def _math_moved(source: str) -> str:
    """`tl.math.X` / `tl.X` that this Triton lacks: to `tl.X` when tl has it, else to the CUDA libdevice."""
    tl, libdevice = _tl(), _libdevice_names()

    def fix_math(m: re.Match) -> str:
        name = m.group(1)
        if _has_attr(tl.math, name):
            return m.group(0)
        name = _ELEMENTWISE_RENAMES.get(name, name)
        if _has_attr(tl, name):
            return f"tl.{name}("
        if name in libdevice:
            return f"tl.extra.cuda.libdevice.{name}("
        return m.group(0)

    def fix_bare(m: re.Match) -> str:
        name = m.group(1)
        if _has_attr(tl, name) or name not in libdevice:
            return m.group(0)
        return f"tl.extra.cuda.libdevice.{name}("

    source = re.sub(r"\btl\.math\.(\w+)\s*\(", fix_math, source)
    return re.sub(r"(?<![\w.])tl\.(\w+)\s*\(", fix_bare, source)


BUILTIN_RULES: list[Rule] = [
    Rule("triton-language-math-alias", "triton.language.math.X -> tl.math.X (one spelling for the rules below)",
         triton=">=3.0", pattern=r"\btriton\.language\.math\.", replacement="tl.math."),
    Rule("tl-libdevice-to-extra", "tl.libdevice.X / triton.language.libdevice.X -> tl.extra.cuda.libdevice.X "
         "(libdevice moved under tl.extra in Triton 3.0)",
         triton=">=3.0", pattern=r"\b(?:tl|triton\.language)\.libdevice\.(?!tanh\b)",
         replacement="tl.extra.cuda.libdevice."),
    Rule("tl-math-tanh", "tl.math.tanh / tl.tanh / libdevice.tanh -> a tanh built from tl.exp (Triton >= 3.0 has "
         "no tl.math.tanh; the helper also runs under the interpreter and on every backend)",
         triton=">=3.0", fn=_tanh_from_exp),
    Rule("tl-math-moved", "tl.math.X missing in this Triton -> tl.X (max/min -> maximum/minimum) or "
         "tl.extra.cuda.libdevice.X; tl.X missing -> tl.extra.cuda.libdevice.X",
         triton=">=3.0", fn=_math_moved),
    Rule("tl-float8e4-nv", "tl.float8e4 -> tl.float8e4nv (renamed in Triton 2.2/3.0)",
         triton=">=3.0", pattern=r"\btl\.float8e4(?![\w])", replacement="tl.float8e4nv"),
    Rule("tl-dot-allow-tf32", "tl.dot(..., allow_tf32=B) -> input_precision ('tf32' / 'ieee'); allow_tf32 is "
         "deprecated since Triton 3.0", triton=">=3.0",
         fn=lambda s: re.sub(r"\ballow_tf32\s*=\s*False\b", 'input_precision="ieee"',
                             re.sub(r"\ballow_tf32\s*=\s*True\b", 'input_precision="tf32"', s))),
]


# --- user rules ------------------------------------------------------------------------------------------------

def _rule_from_dict(d: dict[str, Any], origin: str) -> Rule:
    if isinstance(d, Rule):
        d.origin = origin
        return d
    if not isinstance(d, dict):
        raise CorrectionsError(f"{origin}: expected a rule table or Rule, got {type(d).__name__}")
    unknown = set(d) - {"id", "description", "triton", "pattern", "replacement", "fn", "flags"}
    if unknown:
        raise CorrectionsError(f"{origin}: rule {d.get('id', '?')}: unknown keys {sorted(unknown)}")
    flags = re.MULTILINE
    for f in str(d.get("flags", "")).upper().replace(",", " ").split():
        flags |= {"I": re.I, "S": re.S, "X": re.X}.get(f, 0)
    return Rule(id=str(d.get("id", "")), description=str(d.get("description", "")), triton=str(d.get("triton", "")),
                pattern=d.get("pattern"), replacement=str(d.get("replacement", "")), fn=d.get("fn"), flags=flags,
                origin=origin)


def load_rules_file(path: str | Path) -> list[Rule]:
    """Rules from a TOML file (`[[rule]]` tables) or a Python file (a module-level `RULES` list of Rule objects or
    dicts with the TOML keys)."""
    path = Path(path)
    if not path.exists():
        raise CorrectionsError(f"corrections: expected a .toml or .py file at {path}, got no such file")
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise CorrectionsError(f"{path}: bad TOML: {e}") from e
        raw = data.get("rule", [])
    elif path.suffix == ".py":
        spec = importlib.util.spec_from_file_location(f"llm4llm_user_corrections_{abs(hash(str(path)))}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise CorrectionsError(f"{path}: importing the corrections file failed: {e!r}") from e
        raw = getattr(module, "RULES", None)
        if raw is None:
            raise CorrectionsError(f"{path}: expected a module-level RULES list, got none")
    else:
        raise CorrectionsError(f"corrections: expected a .toml or .py file, got {path}")
    return [_rule_from_dict(d, str(path)) for d in raw]


def rule_set(extra_file: str | Path | None = None, disabled: list[str] | tuple[str, ...] = ()) -> list[Rule]:
    """The built-in rules, minus `disabled`, with `extra_file`'s rules appended (same id replaces)."""
    rules = {r.id: r for r in BUILTIN_RULES if r.id not in set(disabled)}
    if extra_file:
        for r in load_rules_file(extra_file):
            rules.pop(r.id, None)
            rules[r.id] = r
    return list(rules.values())


@dataclass
class Corrected:
    source: str
    applied: list[str]  # rule ids that changed the source, in order
    errors: list[str] = field(default_factory=list)  # rules that raised (skipped, source unchanged by them)


def apply_corrections(source: str, rules: list[Rule] | None = None, triton_version: str | None = None) -> Corrected:
    """Run each applicable rule in order; a rule that raises is skipped and reported, never fatal."""
    rules = BUILTIN_RULES if rules is None else rules
    version = triton_version or installed_triton_version()
    applied, errors = [], []
    for rule in rules:
        if not rule.applies_to(version):
            continue
        try:
            new = rule.apply(source)
        except Exception as e:  # a user's rule must not crash the search
            errors.append(f"{rule.id}: {e!r}")
            continue
        if new != source:
            applied.append(rule.id)
            source = new
    return Corrected(source, applied, errors)
