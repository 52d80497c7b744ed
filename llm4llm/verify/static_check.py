"""The static gate: an AST check of a candidate's source before anything runs.

It enforces the candidate contract's surface: allowed imports only, no escape hatches (file/process/network access,
dynamic code, dunder introspection), no calls into the reference (the task's module class, transformers, torch's
compute functions), torch for allocation and views only, a top-level `entry`, and at least one Triton kernel (a
`@triton.jit` function or an import from kernels_runtime.ops). Limits: it cannot see tensor arithmetic written with
operators (`x * w`); the runtime gates judge those results, and a candidate without a Triton launch is rejected there.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

ALLOWED_MODULES = {"torch", "triton", "triton.language", "math", "functools", "typing", "dataclasses", "__future__"}
OPS_PACKAGE = "kernels_runtime.ops"
# the built-in templates' host code (reviewed project code whose compute is in the ops): a rendered source imports it
HOSTS_PACKAGE = "kernels_runtime.hosts"
# A source larger than this is refused before it is parsed or sent to a worker: a kernel is a few kB, and parsing and
# copying megabytes costs the search process gigabytes (an 8 MB source took it from 0.5 to 4 GiB; issue 39).
MAX_SOURCE_BYTES = 1 << 20

FORBIDDEN_BUILTINS = {
    "open", "exec", "eval", "compile", "__import__", "getattr", "setattr", "delattr", "globals", "locals", "vars",
    "breakpoint", "input", "exit", "quit", "help", "__builtins__", "__loader__", "__spec__", "__file__",
}
FORBIDDEN_PREFIXES = (
    "transformers", "torch.nn", "torch.func", "torch.ops", "torch.library", "torch.compile", "torch._dynamo",
    "torch._inductor", "torch.jit", "torch.hub", "torch.load", "torch.save", "torch.utils", "torch.autograd",
    "torch.matmul", "torch.mm", "torch.bmm", "torch.einsum", "torch.softmax",
)
# torch is for allocation, views and metadata only: its top-level names outside this set are refused.
TORCH_ALLOWED = {
    "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "arange",
    "tensor", "as_strided", "Size", "Tensor", "device", "dtype", "finfo", "iinfo", "is_tensor", "is_floating_point",
    "cuda", "get_default_dtype", "broadcast_shapes", "float32", "float16", "bfloat16", "float64", "float", "half",
    "double", "int8", "int16", "int32", "int64", "uint8", "long", "int", "bool", "float8_e4m3fn", "float8_e5m2",
    "contiguous_format", "strided", "Generator", "promote_types", "result_type",
}
# Tensor methods that compute; outside Triton kernels a call to one is torch doing the work.
COMPUTE_METHODS = {
    "matmul", "mm", "bmm", "einsum", "softmax", "log_softmax", "addmm", "baddbmm", "linear", "rms_norm", "layer_norm",
    "silu", "gelu", "relu", "sigmoid", "tanh", "exp", "log", "pow", "mean", "sum", "var", "std", "rsqrt", "sqrt",
    "norm", "cumsum", "mul", "add", "sub", "div", "square", "abs", "amax", "amin", "topk", "sort", "prod", "erf",
    "mul_", "add_", "sub_", "div_", "pow_", "exp_", "rsqrt_", "sqrt_", "addcmul", "lerp", "conv1d", "conv2d",
    "scaled_dot_product_attention", "cos", "sin",
}
# Modules an allowed module imported for itself are reachable as its attributes (`torch.cuda.os`,
# `triton.runtime.jit.inspect`): attribute names of such modules are refused wherever they appear (the base may be
# a local the checker cannot resolve), and a chain it can resolve is walked through the real objects, so that an
# alias (`import os as _os`) or a module this list misses is refused as well (`_foreign_module`).
DENIED_ATTRS = {
    "os", "_os", "sys", "_sys", "subprocess", "inspect", "builtins", "importlib", "ctypes", "gc", "threading",
    "_thread", "socket", "shutil", "pathlib", "signal", "multiprocessing", "pickle", "marshal", "runpy", "tempfile",
    "concurrent", "asyncio", "pty", "fcntl", "mmap", "resource", "sysconfig", "site", "posix", "io", "codecs",
    "weakref", "atexit", "faulthandler", "tracemalloc", "operator", "types", "linecache", "dis", "code", "codeop",
    "pdb", "traceback", "copyreg",
    # frames and code objects: a frame's globals are the harness's (the judge's counters, its hooks)
    "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "gi_frame", "cr_frame", "ag_frame", "tb_frame",
    "tb_next", "co_code", "co_consts", "func_globals", "gi_code", "cr_code",
}
# roots whose submodules a resolved chain may pass through
ALLOWED_ROOTS = ("torch", "triton", "math", "functools", "typing", "dataclasses", "kernels_runtime")


def _foreign_module(dotted: str) -> str | None:
    """The first module outside ALLOWED_ROOTS that `dotted` reaches through attributes of an allowed module (None:
    it reaches none). Walks only modules already imported here: the check never imports a candidate's names."""
    import sys
    import types

    parts = dotted.split(".")
    obj = sys.modules.get(parts[0])
    for i, name in enumerate(parts[1:], 1):
        if obj is None:
            return None
        try:
            obj = sys.modules.get(".".join(parts[:i + 1])) or getattr(obj, name, None)
        except Exception:  # noqa: BLE001 - a lazy attribute that fails to resolve reaches nothing
            return None
        if isinstance(obj, types.ModuleType) and obj.__name__.split(".")[0] not in ALLOWED_ROOTS:
            return f"{'.'.join(parts[:i + 1])} (module {obj.__name__})"
    return None


@dataclass(frozen=True)
class StaticReport:
    ok: bool
    reason: str = ""


class _Violation(Exception):
    def __init__(self, node: ast.AST, reason: str):
        super().__init__(f"line {getattr(node, 'lineno', '?')}: {reason}")


def _allowed_module(name: str) -> bool:
    return name in ALLOWED_MODULES or any(name == p or name.startswith(p + ".") for p in (OPS_PACKAGE, HOSTS_PACKAGE))


def _is_jit_decorator(resolved: str | None) -> bool:
    return resolved in {"triton.jit", "triton.autotune", "triton.heuristics"}


class _Checker(ast.NodeVisitor):
    def __init__(self, forbidden_names: set[str]):
        self.forbidden_names = forbidden_names
        self.aliases: dict[str, str] = {}
        self.has_kernel = False
        self.jit_depth = 0

    def resolve(self, node: ast.AST) -> str | None:
        """Dotted name of a Name/Attribute chain with import aliases expanded; None for local values."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call):
            return self.resolve(node.func)
        return None

    def visit_Import(self, node: ast.Import):
        for a in node.names:
            if not _allowed_module(a.name):
                raise _Violation(node, f"import of {a.name!r}: allowed are {sorted(ALLOWED_MODULES - {'__future__'})} "
                                       f"and {OPS_PACKAGE}.*, {HOSTS_PACKAGE}.*")
            if a.asname:
                self.aliases[a.asname] = a.name
            else:
                self.aliases[a.name.split(".")[0]] = a.name.split(".")[0]
            if a.name.startswith((OPS_PACKAGE, HOSTS_PACKAGE)):
                self.has_kernel = True

    def visit_ImportFrom(self, node: ast.ImportFrom):
        mod = node.module or ""
        if node.level or not _allowed_module(mod) and not (mod == "kernels_runtime" and
                                                           all(a.name == "ops" for a in node.names)):
            raise _Violation(node, f"import from {'.' * node.level}{mod!r}: allowed are "
                                   f"{sorted(ALLOWED_MODULES - {'__future__'})} and {OPS_PACKAGE}.*, {HOSTS_PACKAGE}.*")
        for a in node.names:
            if a.name == "*":
                raise _Violation(node, f"star import from {mod!r}")
            full = f"{mod}.{a.name}"
            self._check_dotted(node, full)
            self.aliases[a.asname or a.name] = full
        if mod.startswith((OPS_PACKAGE, HOSTS_PACKAGE)) or mod == "kernels_runtime":
            self.has_kernel = True

    def _check_dotted(self, node: ast.AST, dotted: str | None):
        if not dotted:
            return
        for p in FORBIDDEN_PREFIXES:
            if dotted == p or dotted.startswith(p + "."):
                raise _Violation(node, f"{dotted} is not allowed in a candidate (calls into the reference or torch "
                                       f"compute; torch is for allocation and views only)")
        parts = dotted.split(".")
        if parts[0] == "torch" and len(parts) > 1 and parts[1] not in TORCH_ALLOWED:
            raise _Violation(node, f"{dotted}: torch is for allocation and views only")
        if (foreign := _foreign_module(dotted)) is not None:
            raise _Violation(node, f"{foreign}: a module outside the allowed imports, reached through an attribute")

    def _check_name(self, node: ast.AST, name: str):
        if name in self.forbidden_names:
            raise _Violation(node, f"{name!r} refers to the reference module")
        if name in FORBIDDEN_BUILTINS:
            raise _Violation(node, f"{name!r} is not allowed in a candidate")

    def visit_Name(self, node: ast.Name):
        self._check_name(node, node.id)

    def visit_Attribute(self, node: ast.Attribute):
        if node.attr.startswith("__") and node.attr.endswith("__") and node.attr != "__init__":
            raise _Violation(node, f"dunder attribute {node.attr!r} is not allowed in a candidate")
        if node.attr in self.forbidden_names:
            raise _Violation(node, f"{node.attr!r} refers to the reference module")
        if isinstance(node.ctx, (ast.Store, ast.Del)) and self.resolve(node.value) is not None:
            raise _Violation(node, f"assigning {self.resolve(node)}: a candidate may not rebind what imported modules "
                                   f"hold (the timing and counting hooks of the judge live there)")
        if node.attr in DENIED_ATTRS:
            raise _Violation(node, f"attribute {node.attr!r} is not allowed in a candidate (a module or frame outside "
                                   f"the allowed imports)")
        self._check_dotted(node, self.resolve(node))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call):
        f = node.func
        self.visit(f)
        if self.jit_depth == 0 and isinstance(f, ast.Attribute) and f.attr in COMPUTE_METHODS:
            base = self.resolve(f.value)
            if not (base and (base.startswith("triton") or base == "math")):
                raise _Violation(node, f".{f.attr}(...) outside a Triton kernel: torch is for allocation and views "
                                       f"only")
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp):
        if self.jit_depth == 0 and isinstance(node.op, ast.MatMult):
            raise _Violation(node, "'@' outside a Triton kernel: torch is for allocation and views only")
        self.generic_visit(node)

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef):
        self._check_name(node, node.name)
        is_jit = any(_is_jit_decorator(self.resolve(d)) for d in node.decorator_list)
        for d in node.decorator_list:
            self.visit(d)
        self.has_kernel |= is_jit
        self.jit_depth += is_jit
        for child in (node.args, *node.body, *([node.returns] if node.returns else [])):
            self.visit(child)
        self.jit_depth -= is_jit

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function


def oversize(source: str) -> StaticReport | None:
    """A failing report for a source over MAX_SOURCE_BYTES, else None."""
    n = len(source.encode(errors="replace"))
    if n > MAX_SOURCE_BYTES:
        return StaticReport(False, f"source is {n} bytes, over the limit of {MAX_SOURCE_BYTES} bytes")
    return None


def parse_source(source: str) -> ast.Module:
    """ast.parse, where nesting too deep for the parser (which raises RecursionError or MemoryError) is the
    SyntaxError it is: a deeply nested expression must never take the search process down."""
    try:
        return ast.parse(source)
    except (RecursionError, MemoryError):
        raise SyntaxError("expressions nested too deeply") from None


def check_source(source: str, forbidden_names: tuple[str, ...] | set[str] = ()) -> StaticReport:
    """Check a candidate's source. `forbidden_names`: names that reach the reference (the task's module class)."""
    if (big := oversize(source)) is not None:
        return big
    try:
        tree = parse_source(source)
    except SyntaxError as e:
        return StaticReport(False, f"syntax error: {f'line {e.lineno}: ' if e.lineno else ''}{e.msg}")
    checker = _Checker(set(forbidden_names))
    try:
        checker.visit(tree)
    except _Violation as v:
        return StaticReport(False, str(v))
    except (RecursionError, MemoryError):  # parsed, yet deeper than the checker's recursion goes
        return StaticReport(False, "expressions nested too deeply")
    entries = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "entry"]
    if not entries:
        return StaticReport(False, "no top-level `def entry(inputs, weights, state, static)`")
    if len(entries[0].args.args) != 4:
        return StaticReport(False, f"entry: expected 4 parameters (inputs, weights, state, static), "
                                   f"got {len(entries[0].args.args)}")
    if not checker.has_kernel:
        return StaticReport(False, f"no Triton kernel: expected a @triton.jit function or an import from "
                                   f"{OPS_PACKAGE}")
    return StaticReport(True)


def forbidden_names_for(module_class: str) -> tuple[str, ...]:
    """The reference's names a candidate may not mention: the class's short name and its import path."""
    return tuple(n for n in {module_class.rsplit(".", 1)[-1], module_class} if n)


def _host_factory(module: str, name: str) -> bool:
    """`name` is a function defined in the hosts module itself (not a name it imported: torch, an op)."""
    import importlib
    import inspect

    try:
        fn = getattr(importlib.import_module(module), name, None)
    except Exception:  # noqa: BLE001 - no such module: not the templates' form
        return False
    return inspect.isfunction(fn) and fn.__module__ == module


def host_only(source: str) -> bool:
    """Whether the source only calls the project's host code with literal settings: the form the built-in templates
    render (base.host_source): a docstring, imports from kernels_runtime.hosts, module-level literals (CONFIG,
    LOSSY) or items of them (STATE_IN_PLACE = CONFIG["..."]), `_entry = factory(CONFIG, name=literal, ...)` and
    `def entry(inputs, weights, state, static): return _entry(inputs, weights, state, static)`. Such a source runs
    no code of its own, so every kernel it compiles is the project's: its worker's Triton cache may be shared with
    later workers (verify/kernel_cache.py); anyone may write this form, the rule is about what it can run."""
    if oversize(source) is not None:
        return False
    try:
        tree = parse_source(source)
    except SyntaxError:
        return False
    literals: set[str] = set()

    def literal(node: ast.AST) -> bool:
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in literals:
            return literal(node.slice)
        if isinstance(node, ast.Dict):
            return all(k is not None and literal(k) for k in node.keys) and all(literal(v) for v in node.values)
        try:
            ast.literal_eval(node)
            return True
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return False

    factories: set[str] = set()
    for k, node in enumerate(tree.body):
        if k == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith(HOSTS_PACKAGE + ".") \
                and all(a.asname is None and a.name != "*" for a in node.names):
            if not all(_host_factory(node.module, a.name) for a in node.names):
                return False
            factories.update(a.name for a in node.names)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
            if name == "_entry" and isinstance(value, ast.Call) and isinstance(value.func, ast.Name) \
                    and value.func.id in factories and all(isinstance(a, ast.Name) and a.id in literals
                                                           for a in value.args) \
                    and all(kw.arg is not None and literal(kw.value) for kw in value.keywords):
                continue
            if name == "_entry" or not literal(value):
                return False
            literals.add(name)
        elif isinstance(node, ast.FunctionDef) and node.name == "entry" and not node.decorator_list:
            body = node.body
            call = body[0].value if len(body) == 1 and isinstance(body[0], ast.Return) else None
            params = [a.arg for a in node.args.args]
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "_entry"
                    and not call.keywords and [getattr(a, "id", None) for a in call.args] == params):
                return False
        else:
            return False
    return bool(factories)
