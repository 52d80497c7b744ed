"""The static gate for KernelBench candidates: a `ModelNew(nn.Module)` whose forward calls Triton kernels.

KernelBench's contract allows the constructor to build the model's layers as the reference does (nn.Conv2d,
nn.Parameter, ...), so `__init__` may use torch freely (no escape hatches). Everywhere else torch is for
allocation and views, plus the heavy ops a library does best (cuDNN convolutions, cuBLAS GEMMs) and dropout, whose
mask must come from torch's own RNG stream to match the reference's; every other op must be a Triton kernel.
Refused everywhere: CUDA/C++ extensions (KernelBench's adversarial kernels use `load_inline`), torch.compile and
its internals, side streams, the reference's `Model`, the escape-hatch builtins of the `entry` gate.
"""
from __future__ import annotations

import ast

from llm4llm.verify.static_check import (COMPUTE_METHODS, FORBIDDEN_BUILTINS, TORCH_ALLOWED, StaticReport, oversize,
                                        parse_source)

ALLOWED_IMPORTS = {"torch", "torch.nn", "torch.nn.functional", "triton", "triton.language", "math", "functools",
                   "typing", "__future__"}
HEAVY_CALLS = {
    "torch.nn.functional.conv1d", "torch.nn.functional.conv2d", "torch.nn.functional.conv3d",
    "torch.nn.functional.conv_transpose1d", "torch.nn.functional.conv_transpose2d",
    "torch.nn.functional.conv_transpose3d", "torch.nn.functional.linear", "torch.addmm", "torch.mm", "torch.bmm",
    "torch.matmul", "torch.nn.functional.dropout",
}
FORBIDDEN = ("torch.utils", "torch.compile", "torch._dynamo", "torch._inductor", "torch.jit", "torch.ops",
             "torch.library", "torch.cuda.Stream", "torch.cuda.stream", "torch.cuda.streams", "torch.cuda.set_stream",
             "torch.cuda.ExternalStream", "torch.backends", "torch.set_float32_matmul_precision", "torch.hub",
             "torch.load", "torch.save", "torch.autograd", "torch.func")
HEAVY_METHODS = {"matmul", "mm", "bmm", "addmm"}


class _V(Exception):
    pass


class _Check(ast.NodeVisitor):
    def __init__(self):
        self.aliases: dict[str, str] = {}
        self.has_kernel = False
        self.in_init = 0
        self.in_jit = 0
        self.has_model_new = False

    def resolve(self, node):
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def visit_Import(self, node):
        for a in node.names:
            if a.name not in ALLOWED_IMPORTS:
                raise _V(f"line {node.lineno}: import of {a.name!r}: allowed are {sorted(ALLOWED_IMPORTS)}")
            self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]

    def visit_ImportFrom(self, node):
        mod = node.module or ""
        if node.level or mod not in ALLOWED_IMPORTS:
            raise _V(f"line {node.lineno}: import from {mod!r}: allowed are {sorted(ALLOWED_IMPORTS)}")
        for a in node.names:
            if a.name == "*":
                raise _V(f"line {node.lineno}: star import")
            self.aliases[a.asname or a.name] = f"{mod}.{a.name}"
            self._dotted(node, f"{mod}.{a.name}")

    def _dotted(self, node, dotted):
        if not dotted:
            return
        for p in FORBIDDEN:
            if dotted == p or dotted.startswith(p + "."):
                raise _V(f"line {node.lineno}: {dotted} is not allowed in a candidate")

    def visit_Name(self, node):
        if node.id in FORBIDDEN_BUILTINS:
            raise _V(f"line {node.lineno}: {node.id!r} is not allowed in a candidate")
        if node.id == "Model":
            raise _V(f"line {node.lineno}: 'Model' refers to the reference")

    def visit_Attribute(self, node):
        if node.attr.startswith("__") and node.attr.endswith("__") and node.attr != "__init__":
            raise _V(f"line {node.lineno}: dunder attribute {node.attr!r}")
        self._dotted(node, self.resolve(node))
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        name = self.resolve(f)
        if not self.in_init and not self.in_jit:
            if name and name.startswith("torch") and name not in HEAVY_CALLS:
                parts = name.split(".")
                if name.startswith("torch.nn.") or (len(parts) > 1 and parts[1] not in TORCH_ALLOWED
                                                    and parts[1] != "nn"):
                    raise _V(f"line {node.lineno}: {name}(...) outside __init__ and Triton kernels: torch is for "
                             f"allocation, views and the heavy op (conv, GEMM) only")
            if isinstance(f, ast.Attribute) and name is None and f.attr in COMPUTE_METHODS - HEAVY_METHODS:
                raise _V(f"line {node.lineno}: .{f.attr}(...) outside a Triton kernel")
        self.generic_visit(node)

    def visit_ClassDef(self, node):
        if node.name == "ModelNew":
            self.has_model_new = True
        self.generic_visit(node)

    def visit_FunctionDef(self, node):
        jit = any((self.resolve(d.func if isinstance(d, ast.Call) else d) or "") in
                  ("triton.jit", "triton.autotune", "triton.heuristics") for d in node.decorator_list)
        for d in node.decorator_list:
            self.visit(d)
        self.has_kernel |= jit
        init = node.name == "__init__"
        self.in_init += init
        self.in_jit += jit
        for child in (node.args, *node.body):
            self.visit(child)
        self.in_init -= init
        self.in_jit -= jit


def check_modelnew(source: str) -> StaticReport:
    if (big := oversize(source)) is not None:
        return big
    try:
        tree = parse_source(source)
    except SyntaxError as e:
        return StaticReport(False, f"syntax error: {f'line {e.lineno}: ' if e.lineno else ''}{e.msg}")
    c = _Check()
    try:
        c.visit(tree)
    except _V as v:
        return StaticReport(False, str(v))
    except (RecursionError, MemoryError):  # parsed, yet deeper than the checker's recursion goes
        return StaticReport(False, "expressions nested too deeply")
    if not c.has_model_new:
        return StaticReport(False, "no `class ModelNew(nn.Module)`: the KernelBench candidate contract")
    if not c.has_kernel:
        return StaticReport(False, "no Triton kernel: expected a @triton.jit function")
    return StaticReport(True)
