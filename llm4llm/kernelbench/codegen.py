"""From a KernelBench problem's captured graph to a `ModelNew` source: the heavy op (conv, conv-transpose, GEMM) on
cuDNN/cuBLAS, everything else as generated Triton kernels.

The graph is the problem's forward captured by `make_fx` under fake tensors (aten ops, static shapes). Its nodes
are classified as heavy (convolution, addmm, mm, bmm), view, pointwise, reduction (sum/mean/amax/amin/max/min over
dims, softmax, group/layer/batch norm) or pool (max/avg pool). Pointwise chains are never materialised: they are
inlined, as Triton expressions, into the kernel that consumes them (a reduction's or a pool's loads, or the store
of an output), so each kernel reads the heavy op's output once per pass. A kernel whose output only feeds one
pointwise chain of the same shape computes that chain before its store (epilogue fusion).

Shapes and strides are baked into the kernels as literals: a KernelBench problem has one input shape, and the
candidate checks it at the top of forward. Nothing here is trusted: every rendering is judged by the verifier.

Constants of the forward are covered generically. A one-element tensor constant whose value the capture knows
(`torch.tensor(2.0)` in forward) is folded into the expressions that use it as a literal (`fold_scalar_constants`),
so it lands in the fused epilogue's code. Any other tensor constant (a few values made in forward, a plain tensor
attribute of the model) becomes a non-persistent buffer of `ModelNew`, registered at the end of its constructor, and
is read by the kernels like a weight; registered buffers and parameters already arrive as placeholders.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch

aten = torch.ops.aten


class Unsupported(Exception):
    """The graph holds something the code generator does not handle (the template then does not apply)."""


# A reduction with fewer rows than SPLIT_BELOW_ROWS and long rows (4 blocks a chunk at least) is split so that about
# SPLIT_PROGRAMS programs (some 15 an SM on a 132-SM GPU) stream it. Below 264 rows (BatchNorm's 64-128 channels,
# problems 52 and 72) the split took them from 0.53x / 0.37x of eager to 1.03x / 1.40x;
# up to 1024 it splits one more problem of the 50, 60's GroupNorm (512 rows of 492K elements, 4 chunks a row), not
# yet timed. Rows of 1024 and more are already 8 programs an SM unsplit.
SPLIT_BELOW_ROWS, SPLIT_PROGRAMS = 1024, 2048
HEAVY = {aten.convolution.default, aten.addmm.default, aten.mm.default, aten.bmm.default}
VIEWS = {aten.view.default, aten.unsqueeze.default, aten.squeeze.dims, aten.squeeze.dim, aten.permute.default,
         aten.t.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default}
IDENTITY = {aten.alias.default, aten.clone.default, aten.detach.default, aten.lift_fresh_copy.default}
REDUCE = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.max.dim, aten.min.dim,
          aten._softmax.default, aten.native_group_norm.default, aten.native_layer_norm.default,
          aten.native_batch_norm.default}
POOL = {aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default, aten.avg_pool2d.default,
        aten.avg_pool3d.default}

# Pointwise ops: a format string over the operand expressions (Triton, fp32).
_UNARY = {
    aten.tanh.default: "_tanh({0})", aten.exp.default: "tl.exp({0})", aten.log.default: "tl.log({0})",
    aten.sigmoid.default: "(1.0 / (1.0 + tl.exp(-({0}))))", aten.relu.default: "tl.maximum({0}, 0.0)",
    aten.abs.default: "tl.abs({0})", aten.neg.default: "(-({0}))", aten.log1p.default: "_log1p({0})",
    aten.sqrt.default: "tl.sqrt({0})", aten.rsqrt.default: "(1.0 / tl.sqrt({0}))", aten.erf.default: "_erf({0})",
}
_BINARY = {
    aten.add.Tensor: "({0} + {1})", aten.sub.Tensor: "({0} - {1})", aten.mul.Tensor: "({0} * {1})",
    aten.div.Tensor: "({0} / {1})", aten.maximum.default: "tl.maximum({0}, {1})",
    aten.minimum.default: "tl.minimum({0}, {1})", aten.add_.Tensor: "({0} + {1})", aten.div_.Scalar: "({0} / {1})",
    aten.mul_.Tensor: "({0} * {1})", aten.div.Scalar: "({0} / {1})", aten.mul.Scalar: "({0} * {1})",
    aten.add.Scalar: "({0} + {1})", aten.sub.Scalar: "({0} - {1})", aten.pow.Tensor_Scalar: "_pow({0}, {1})",
    aten.gt.Scalar: "({0} > {1})", aten.lt.Scalar: "({0} < {1})", aten.ge.Scalar: "({0} >= {1})",
    aten.le.Scalar: "({0} <= {1})", aten.eq.Scalar: "({0} == {1})", aten.gt.Tensor: "({0} > {1})",
    aten.lt.Tensor: "({0} < {1})", aten.eq.Tensor: "({0} == {1})",
}
POINTWISE = set(_UNARY) | set(_BINARY) | {
    aten.where.self, aten.clamp.default, aten.hardtanh.default, aten.leaky_relu.default, aten.gelu.default,
    aten.scalar_tensor.default, aten.hardswish.default, aten.softplus.default, aten.mish.default,
    aten.silu.default, aten.clamp_min.default, aten.clamp_max.default, aten.full.default,
}

HELPERS = '''
@triton.jit
def _tanh(x):
    # tanh from exp of a non-positive argument: exact to fp32 rounding, no overflow
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _log1p(x):
    # log1p without cancellation for small x (Goldberg): log(u) * x / (u - 1), u = 1 + x
    u = 1.0 + x
    d = u - 1.0
    return tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _erf(x):
    return tl.math.erf(x)


@triton.jit
def _pow(x, p):
    return tl.exp(p * tl.log(x))
'''


# Placeholder meta key the capture sets on a plain tensor attribute of the model (neither parameter nor buffer): the
# candidate reads it through a buffer of its own, which `.to(device)` moves with the module.
ATTRIBUTE_META = "kb_attribute"
# A tensor constant is written into the candidate's source value by value: up to this many elements.
CONSTANT_MAX_NUMEL = 4096


def _lit(v: Any) -> str:
    if isinstance(v, bool):
        return "1.0" if v else "0.0"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and math.isnan(v):
            return "float('nan')"
        if isinstance(v, float) and math.isinf(v):
            return "float('inf')" if v > 0 else "float('-inf')"
        return repr(float(v))
    raise Unsupported(f"constant {v!r}")


def _shape(n) -> tuple[int, ...]:
    v = n.meta.get("val")
    if isinstance(v, (tuple, list)):
        v = v[0]
    return tuple(int(s) for s in v.shape)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


@dataclass
class Buf:
    """A materialised tensor of the candidate's forward: a Python variable with known shape and strides."""

    var: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass
class Plan:
    """What the renderer needs: the lines of forward and the kernels, plus facts the proposer records."""

    lines: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)
    heavy: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    init: list[str] = field(default_factory=list)  # lines appended to ModelNew's constructor (constant buffers)


@dataclass
class _ReduceSpec:
    """What a reduction node computes: the op, the reduced dims (None for group norm) and a norm's parameters."""

    op: str
    dims: list[int] | None
    full_out: bool = False  # output has the input's shape (softmax, norms) vs the reduced shape
    weight: Any = None
    bias: Any = None
    eps: float = 0.0
    groups: int = 0


@dataclass
class _RowSpace:
    """A reduction's iteration space: `nrows` rows of `R` reduced elements; `idx` indexes the input at loop element
    `kk` once the `ilines` ran."""

    nrows: int
    R: int
    idx: list[str]
    ilines: list[str]
    chan: str | None = None  # group norm's channel index (its affine parameters are per channel)
    kidx: list[str] = field(default_factory=list)  # the kept dims' indices of a row
    dims: list[int] = field(default_factory=list)  # the reduced dims


class Gen:
    """One pass over the graph in topological order, emitting forward lines and kernels."""

    def __init__(self, gm: torch.fx.GraphModule, names: dict[str, str], cfg: dict[str, Any]):
        self.gm, self.names, self.cfg = gm, names, cfg
        self.bufs: dict[Any, Buf] = {}
        self.plan = Plan()
        self.n_kernel = 0
        self.users = {n: list(n.users) for n in gm.graph.nodes}
        self.fused_into: dict[Any, Any] = {}  # pointwise output node -> kernel node computing it in its store

    # ---------------------------------------------------------------- classification
    def kind(self, n) -> str:
        if n.op == "placeholder":
            return "input"
        if n.op == "output":
            return "output"
        if n.op == "get_attr":
            return "constant"
        t = n.target
        if t is operator.getitem:
            return "getitem"
        if t in HEAVY:
            return "heavy"
        if t in VIEWS:
            return "view"
        if t in IDENTITY:
            return "identity"
        if t in REDUCE:
            return "reduce"
        if t in POOL:
            return "pool"
        if t in POINTWISE:
            return "pointwise"
        if t in (aten.empty.memory_format, aten.empty_permuted.default, aten.bernoulli_.float):
            return "rng"
        raise Unsupported(f"op {t}")

    # ---------------------------------------------------------------- expressions
    def expr(self, n, idx: list[str], out_shape: tuple[int, ...], pre: list[str], bind: dict, memo: dict) -> str:
        """A Triton expression of node `n` at index `idx` (one expression per dim of `out_shape`, the shape the
        value is broadcast to); loads and temporaries are appended to `pre`."""
        if not isinstance(n, torch.fx.Node):
            return _lit(n)
        shape = _shape(n)
        my_idx = self._bcast_idx(idx, out_shape, shape)
        key = (n, tuple(my_idx))
        if key in memo:
            return memo[key]
        if n in bind:
            return bind[n]
        k = self.kind(n)
        if k == "getitem" and self.kind(n.args[0]) == "rng":
            raise Unsupported("rng outside dropout")
        if n in self.bufs:
            v = self._load(self.bufs[n], my_idx, pre)
        elif k == "identity":
            v = self.expr(n.args[0], my_idx, shape, pre, bind, memo)
        elif k == "pointwise":
            v = self._pointwise(n, my_idx, shape, pre, bind, memo)
        else:
            raise Unsupported(f"value {n.name} ({k}) used before it was stored")
        name = f"v{len(memo)}"
        pre.append(f"{name} = {v}")
        memo[key] = name
        return name

    @staticmethod
    def _bcast_idx(idx: list[str], out_shape: tuple, shape: tuple) -> list[str]:
        if len(shape) > len(out_shape):
            if all(s == 1 for s in shape[:len(shape) - len(out_shape)]):
                return ["0"] * (len(shape) - len(out_shape)) + list(idx)
            raise Unsupported(f"broadcast {shape} -> {out_shape}")
        tail = idx[len(idx) - len(shape):] if shape else []
        return [("0" if s == 1 and o != 1 else i) for s, o, i in zip(shape, out_shape[len(out_shape) - len(shape):],
                                                                      tail)]

    def _load(self, b: Buf, idx: list[str], pre: list[str]) -> str:
        flat = getattr(self, "flat", None)
        if flat is not None and b.shape == flat[0] and b.strides == _strides(b.shape) and list(idx) == flat[1]:
            # same shape and layout as the kernel's iteration space: the flat offset, no index arithmetic
            return f"tl.load({b.var}_ptr + offs, mask=MASK, other=0.0)"
        terms = [f"({i}) * {st}" for i, s, st in zip(idx, b.shape, b.strides) if s != 1 and i != "0"]
        if not terms:  # a scalar (or the first element): in bounds, no mask
            return f"tl.load({b.var}_ptr)"
        return f"tl.load({b.var}_ptr + {' + '.join(terms)}, mask=MASK, other=0.0)"

    def _pointwise(self, n, idx, shape, pre, bind, memo) -> str:
        t = n.target
        a = [self.expr(x, idx, shape, pre, bind, memo) if isinstance(x, torch.fx.Node) else x for x in n.args]
        if t in _UNARY:
            return _UNARY[t].format(a[0])
        if t in _BINARY:
            x, y = a[0], a[1]
            x = x if isinstance(n.args[0], torch.fx.Node) else _lit(x)
            y = y if isinstance(n.args[1], torch.fx.Node) else _lit(y)
            if t in (aten.add.Tensor, aten.sub.Tensor) and len(n.args) > 2 or n.kwargs.get("alpha", 1) != 1:
                y = f"({y} * {_lit(n.kwargs.get('alpha', n.args[2] if len(n.args) > 2 else 1))})"
            return _BINARY[t].format(x, y)
        if t == aten.where.self:
            c, x, y = (self.expr(v, idx, shape, pre, bind, memo) if isinstance(v, torch.fx.Node) else _lit(v)
                       for v in n.args)
            return f"tl.where({c}, {x}, {y})"
        if t == aten.scalar_tensor.default:
            return _lit(n.args[0])
        if t == aten.full.default:  # a constant tensor (from a cancellation rewrite): a block of its value
            return f"tl.full(MASK.shape, {_lit(n.args[1])}, tl.float32)"
        if t in (aten.clamp.default, aten.hardtanh.default, aten.clamp_min.default, aten.clamp_max.default):
            x = a[0]
            lo = n.args[1] if len(n.args) > 1 else n.kwargs.get("min", -1.0 if t == aten.hardtanh.default else None)
            hi = n.args[2] if len(n.args) > 2 else n.kwargs.get("max", 1.0 if t == aten.hardtanh.default else None)
            if t == aten.clamp_max.default:
                lo, hi = None, n.args[1]
            if lo is not None:
                x = f"tl.maximum({x}, {_lit(lo)})"
            if hi is not None:
                x = f"tl.minimum({x}, {_lit(hi)})"
            return x
        if t == aten.leaky_relu.default:
            s = n.args[1] if len(n.args) > 1 else 0.01
            return f"tl.where({a[0]} > 0, {a[0]}, {a[0]} * {_lit(s)})"
        if t == aten.gelu.default:
            if n.kwargs.get("approximate", "none") != "none":
                return (f"(0.5 * {a[0]} * (1.0 + _tanh(0.7978845608028654 * ({a[0]} + 0.044715 * {a[0]} * {a[0]}"
                        f" * {a[0]}))))")
            return f"(0.5 * {a[0]} * (1.0 + _erf({a[0]} * 0.7071067811865476)))"
        if t == aten.hardswish.default:
            return f"({a[0]} * tl.minimum(tl.maximum({a[0]} + 3.0, 0.0), 6.0) / 6.0)"
        if t == aten.silu.default:
            return f"({a[0]} / (1.0 + tl.exp(-({a[0]}))))"
        if t == aten.softplus.default:
            return f"tl.where({a[0]} > 20.0, {a[0]}, _log1p(tl.exp({a[0]})))"
        if t == aten.mish.default:
            return f"({a[0]} * _tanh(tl.where({a[0]} > 20.0, {a[0]}, _log1p(tl.exp({a[0]})))))"
        raise Unsupported(f"pointwise {t}")

    # ---------------------------------------------------------------- kernels
    def _wide(self, leaves, numel: int) -> str:
        """int64 index arithmetic only where some offset can pass 2**31: int64 division and modulo cost several
        times int32's per element, enough to make a fused elementwise tail slower than eager's separate kernels."""
        big = max([numel, *(math.prod(self.bufs[l].shape) for l in leaves)]) >= 2**31 - 2**20
        return ".to(tl.int64)" if big else ""

    def _new(self) -> str:
        self.n_kernel += 1
        return f"_k{self.n_kernel}"

    def _leaves(self, n, acc: set, bind: dict) -> set:
        """Stored tensors an inlined expression of `n` reads."""
        if not isinstance(n, torch.fx.Node) or n in bind:
            return acc
        if n in self.bufs:
            acc.add(n)
            return acc
        for a in n.args:
            if isinstance(a, torch.fx.Node):
                self._leaves(a, acc, bind)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.fx.Node):
                        self._leaves(b, acc, bind)
        return acc

    def _epilogue(self, n):
        """The last node of the pointwise sub-graph after `n` (same shape, every intermediate value used only inside
        it, every other operand already stored) that the kernel of `n` can store instead of `n`, or None: chains
        (`x * s`, leaky_relu) and small DAGs (`x * s + x`, KernelBench's residual adds of a detached clone)."""
        nodes = list(self.gm.graph.nodes)
        group = [n]
        inside = {n}
        for u in nodes[nodes.index(n) + 1:]:
            if u.op != "call_function" or self.kind(u) not in ("pointwise", "identity") or _shape(u) != _shape(n):
                continue
            ins = [a for a in u.args if isinstance(a, torch.fx.Node)]
            if not any(a in inside for a in ins):
                continue
            if all(a in inside or a in self.bufs for a in ins):
                group.append(u)
                inside.add(u)
        for i in range(len(group) - 1, 0, -1):
            part = set(group[:i + 1])
            if all(u in part for m in group[:i] for u in self.users[m]):
                return group[i]
        return None

    def _store_value(self, n, idx, shape, pre, bind, memo) -> tuple[Any, str]:
        """(node stored, expression): the epilogue chain of n when it fuses, else n itself."""
        tgt = self._epilogue(n) if self.cfg.get("epilogue", True) else None
        if tgt is not None:
            try:
                sub_pre: list[str] = []
                v = self.expr(tgt, idx, shape, sub_pre, bind, dict(memo))
                pre.extend(sub_pre)
                return tgt, v
            except Unsupported:
                pass
        return n, bind[n]

    def var(self) -> str:
        self.n_var = getattr(self, "n_var", 0) + 1
        return f"t{self.n_var}"

    def _alloc(self, node, shape) -> Buf:
        var = self.var()
        self.plan.lines.append(f"{var} = torch.empty({tuple(shape)!r}, device=x0.device, dtype=torch.float32)")
        b = Buf(var, tuple(shape), _strides(tuple(shape)))
        self.bufs[node] = b
        return b

    def _args_sig(self, leaves: list) -> tuple[str, str]:
        ptrs = ", ".join(f"{self.bufs[l].var}_ptr" for l in leaves)
        call = ", ".join(self.bufs[l].var for l in leaves)
        return ptrs, call

    def pointwise_kernel(self, n, out_node=None) -> None:
        """Store the inlined value of `n` (shape S) with one program per BLOCK elements."""
        shape = _shape(n)
        numel = math.prod(shape)
        pre: list[str] = []
        idx = self._decompose("offs", shape, pre)
        body: list[str] = []
        self.flat = (shape, idx)
        try:
            v = self.expr(n, idx, shape, body, {}, {})
        finally:
            self.flat = None
        leaves = sorted(self._leaves(n, set(), {}), key=lambda x: self.bufs[x].var)
        out = self._alloc(out_node or n, shape)
        name = self._new()
        ptrs, call = self._args_sig(leaves)
        blk = self.cfg.get("BLOCK", 1024)
        src = [f"@triton.jit", f"def {name}({ptrs}{', ' if ptrs else ''}{out.var}_ptr, BLOCK: tl.constexpr):",
               f"    offs = tl.program_id(0){self._wide(leaves, numel)} * BLOCK + tl.arange(0, BLOCK)",
               f"    MASK = offs < {numel}"]
        src += [f"    {l}" for l in pre + body]
        src.append(f"    tl.store({out.var}_ptr + offs, {v}, mask=MASK)")
        self.plan.kernels.append("\n".join(src))
        self.plan.lines.append(f"{name}[(triton.cdiv({numel}, {blk}),)]({call}{', ' if call else ''}{out.var}, "
                               f"BLOCK={blk}, num_warps={self.cfg.get('num_warps', 4)})")
        self.plan.kinds.append("pointwise")

    @staticmethod
    def _decompose(var: str, shape: tuple[int, ...], pre: list[str], prefix: str = "i") -> list[str]:
        idx = []
        rem = var
        for d in range(len(shape) - 1, -1, -1):
            s = shape[d]
            name = f"{prefix}{d}"
            if d == 0:
                pre.append(f"{name} = {rem}")
            else:
                pre.append(f"{name} = {rem} % {s}")
                pre.append(f"{prefix}r{d} = {rem} // {s}")
                rem = f"{prefix}r{d}"
            idx.append(name)
        return list(reversed(idx))

    def pool_kernel(self, n) -> None:
        t = n.target
        src_node = n.args[0]
        in_shape, out_shape = _shape(src_node), _shape(n)
        nsp = 3 if t in (aten.max_pool3d_with_indices.default, aten.avg_pool3d.default) else 2
        ks = list(n.args[1]) if len(n.args) > 1 else []
        ks = ks * nsp if len(ks) == 1 else ks
        st = list(n.args[2]) if len(n.args) > 2 and n.args[2] else ks
        st = st * nsp if len(st) == 1 else st
        pad = list(n.args[3]) if len(n.args) > 3 else [0]
        pad = pad * nsp if len(pad) == 1 else pad
        is_max = t in (aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default)
        if is_max:
            dil = list(n.args[4]) if len(n.args) > 4 else [1]
            ceil = n.args[5] if len(n.args) > 5 else False
            if any(d != 1 for d in dil):
                raise Unsupported("dilated pool")
        else:
            ceil = n.args[4] if len(n.args) > 4 else False
            include_pad = n.args[5] if len(n.args) > 5 else True
            div_override = n.args[6] if len(n.args) > 6 else None
            if div_override is not None or (any(pad) and not include_pad):
                raise Unsupported("avg pool divisor options")
        if ceil:
            raise Unsupported("ceil_mode pool")
        numel = math.prod(out_shape)
        pre: list[str] = []
        oidx = self._decompose("offs", out_shape, pre, "o")
        body: list[str] = []
        memo: dict = {}
        acc = "acc"
        fill = "float('-inf')" if is_max else "0.0"
        body.append(f"acc = tl.full([BLOCK], {fill}, tl.float32)")
        nb = len(in_shape) - nsp
        import itertools

        for tap in itertools.product(*[range(k) for k in ks]):
            idx = list(oidx[:nb])
            conds = []
            for d in range(nsp):
                e = f"({oidx[nb + d]} * {st[d]} + {tap[d] - pad[d]})"
                idx.append(e)
                if pad[d]:
                    conds.append(f"({e} >= 0) & ({e} < {in_shape[nb + d]})")
            tp: list[str] = []
            v = self.expr(src_node, idx, in_shape, tp, {}, memo)
            body += tp
            if conds:
                c = " & ".join(conds)
                v = f"tl.where({c}, {v}, {fill})"
            body.append(f"acc = tl.maximum(acc, {v})" if is_max else f"acc = acc + {v}")
        if not is_max:
            body.append(f"acc = acc / {float(math.prod(ks))}")
        name = self._new()
        res_node = n
        if is_max:  # the values output (getitem 0) is the node later ops use
            gi = [u for u in self.users[n] if u.target is operator.getitem and self.users[u]]
            if any(u.args[1] != 0 for u in gi):
                raise Unsupported("pool indices used")
            res_node = gi[0] if gi else n
        bind = {res_node: "acc"}
        stored, v = self._store_value(res_node, oidx, out_shape, body, bind, memo)
        leaves = sorted(self._leaves(src_node, set(), {}) | self._leaves(stored, set(), bind),
                        key=lambda x: self.bufs[x].var)
        out = self._alloc(stored, out_shape)
        if stored is not res_node:
            self.fused_into[stored] = res_node
        ptrs, call = self._args_sig(leaves)
        blk = self.cfg.get("POOL_BLOCK", 256)
        src = [f"@triton.jit", f"def {name}({ptrs}, {out.var}_ptr, BLOCK: tl.constexpr):",
               f"    offs = tl.program_id(0){self._wide(leaves, numel)} * BLOCK + tl.arange(0, BLOCK)",
               f"    MASK = offs < {numel}"]
        src += [f"    {l}" for l in pre + body]
        src.append(f"    tl.store({out.var}_ptr + offs, {v}, mask=MASK)")
        self.plan.kernels.append("\n".join(src))
        self.plan.lines.append(f"{name}[(triton.cdiv({numel}, {blk}),)]({call}, {out.var}, BLOCK={blk}, "
                               f"num_warps={self.cfg.get('num_warps', 4)})")
        self.plan.kinds.append("pool")

    def reduce_kernel(self, n) -> None:
        """One program per ROWS rows; a loop over the reduced elements per pass (two passes for softmax and the
        norms: statistics, then the normalised store)."""
        t = n.target
        x = n.args[0]
        L = _shape(x)
        spec = self._reduce_spec(n, len(L))
        pre: list[str] = []
        space = self._reduce_space(spec, L, pre)
        R, nrows = space.R, space.nrows
        ROWS = self.cfg.get("ROWS", 1)
        BR = min(self.cfg.get("BLOCK_R", 1024), triton_next_pow2(R))
        if R <= self.cfg.get("BLOCK_R", 1024) and nrows >= 4096:
            ROWS = max(ROWS, max(1, min(64, 4096 // triton_next_pow2(R))))
        rs = self._rsplit(spec, nrows, R, BR)
        if rs > 1:
            self._split_reduce(n, spec, x, L, space, pre, BR, rs)
            return
        leaves = self._leaves(x, set(), {})
        body = self._reduce_statistics(spec, x, L, space)
        name = self._new()
        res_node = n
        if t in (aten.max.dim, aten.min.dim, aten.native_group_norm.default, aten.native_layer_norm.default,
                 aten.native_batch_norm.default):
            res_node = self._values_output(n, f"{t} statistics used")
        if spec.full_out:
            lines, stored, extra_leaves = self._reduce_final_pass(spec, res_node, x, L, space)
        else:
            lines, stored, extra_leaves = self._reduce_row_store(res_node, len(L), space)
        body += lines
        for w in (spec.weight, spec.bias):
            if isinstance(w, torch.fx.Node):
                leaves |= self._leaves(w, set(), {})
        leaves |= extra_leaves
        leaves = sorted(leaves, key=lambda l: self.bufs[l].var)
        out = self._alloc(stored, _shape(stored))
        if stored is not res_node:
            self.fused_into[stored] = res_node
        ptrs, call = self._args_sig(leaves)
        src = [f"@triton.jit", f"def {name}({ptrs}, OUT_ptr, ROWS: tl.constexpr, BR: tl.constexpr):",
               f"    rows = (tl.program_id(0){self._wide(leaves, nrows * R)} * ROWS + tl.arange(0, ROWS))[:, None]",
               f"    ROWMASK = rows < {nrows}"]
        src += [f"    {l}" for l in pre + body]
        self.plan.kernels.append("\n".join(src))
        self.plan.lines.append(f"{name}[(triton.cdiv({nrows}, {ROWS}),)]({call}, {out.var}, ROWS={ROWS}, BR={BR}, "
                               f"num_warps={self.cfg.get('num_warps', 4)})")
        self.plan.kinds.append(spec.op)

    def _rsplit(self, spec: _ReduceSpec, nrows: int, R: int, BR: int) -> int:
        """Programs a row's reduction is split over: a few long rows (BatchNorm's channels over N x H x W) would
        leave most SMs idle with one program a row. RSPLIT in the config: 0 picks (below SPLIT_BELOW_ROWS rows,
        about SPLIT_PROGRAMS programs, chunks of at least 4 blocks), 1 never splits, N splits in N. Softmax is never
        split."""
        want = int(self.cfg.get("RSPLIT", 0))
        if spec.op == "softmax" or want == 1 or (not want and nrows >= SPLIT_BELOW_ROWS):
            return 1
        rs = want or min(64, -(-SPLIT_PROGRAMS // nrows), -(-R // (4 * BR)))
        rs = max(1, min(rs, -(-R // BR)))
        return rs if rs > 1 else 1

    def _split_reduce(self, n, spec: _ReduceSpec, x, L, space: _RowSpace, pre: list[str], BR: int,
                      rs: int) -> None:
        """A reduction split over `rs` chunks of each row: per-chunk partials (sums, extrema, or a norm's chunk
        mean and squared deviations about it) into an fp64 workspace, then one launch that combines them in a fixed
        order (Chan's formula for the variance) and stores the result (or, for the norms, normalises its chunk)."""
        R, nrows = space.R, space.nrows
        CH = -(-(-(-R // rs)) // BR) * BR  # whole blocks a chunk
        rs = -(-R // CH)
        leaves = self._leaves(x, set(), {})
        ws = self.var()
        self.plan.lines.append(f"{ws} = torch.empty(({nrows}, {rs}, 2), device=x0.device, dtype=torch.float64)")
        head = [f"    rows = (tl.program_id(0){self._wide(leaves, nrows * R)} + tl.arange(0, 1))[:, None]",
                f"    ROWMASK = rows < {nrows}", "    chunk = tl.program_id(1)", f"    lo = chunk * {CH}",
                f"    hi = tl.minimum(lo + {CH}, {R})"]
        body = self._split_partials(spec, x, L, space, rs)
        ptrs, call = self._args_sig(sorted(leaves, key=lambda l: self.bufs[l].var))
        name = self._new()
        self.plan.kernels.append("\n".join([f"@triton.jit", f"def {name}({ptrs}, WS_ptr, BR: tl.constexpr):", *head,
                                            *(f"    {l}" for l in pre + body)]))
        warps = self.cfg.get("num_warps", 4)
        self.plan.lines.append(f"{name}[({nrows}, {rs})]({call}, {ws}, BR={BR}, num_warps={warps})")
        self.plan.kinds.append(f"{spec.op} partials ({rs} chunks a row)")
        res_node = n
        if n.target in (aten.max.dim, aten.min.dim, aten.native_group_norm.default, aten.native_layer_norm.default,
                        aten.native_batch_norm.default):
            res_node = self._values_output(n, f"{n.target} statistics used")
        comb = self._split_combine(spec, R, rs, CH)
        if spec.full_out:
            lines, stored, extra = self._reduce_final_pass(spec, res_node, x, L, space, "lo", "hi")
            grid = f"({nrows}, {rs})"
        else:
            lines, stored, extra = self._reduce_row_store(res_node, len(L), space)
            grid = f"({nrows},)"
        for w in (spec.weight, spec.bias):
            if isinstance(w, torch.fx.Node):
                leaves |= self._leaves(w, set(), {})
        leaves = sorted(leaves | extra, key=lambda l: self.bufs[l].var)
        out = self._alloc(stored, _shape(stored))
        if stored is not res_node:
            self.fused_into[stored] = res_node
        ptrs, call = self._args_sig(leaves)
        name = self._new()
        self.plan.kernels.append("\n".join([f"@triton.jit", f"def {name}({ptrs}, WS_ptr, OUT_ptr, BR: tl.constexpr):",
                                            *head, *(f"    {l}" for l in pre + comb + lines)]))
        self.plan.lines.append(f"{name}[{grid}]({call}, {ws}, {out.var}, BR={BR}, num_warps={warps})")
        self.plan.kinds.append(f"{spec.op} from partials")

    def _split_partials(self, spec: _ReduceSpec, x, L, space: _RowSpace, rs: int) -> list[str]:
        """One chunk's partials into WS[row, chunk, 0:2]."""
        acc_t = "tl.float64" if self.cfg.get("acc64", True) else "tl.float32"

        def loop(update):
            p, v = self._reduce_input(x, L, space)
            return self._reduce_loop(space, p + update(v), "lo", "hi")

        at = f"WS_ptr + rows * {2 * rs} + chunk * 2"
        if spec.op in ("max", "min"):
            fill = "float('-inf')" if spec.op == "max" else "float('inf')"
            fn = "tl.maximum" if spec.op == "max" else "tl.minimum"
            body = [f"acc = tl.full([1, BR], {fill}, tl.float32)"]
            body += loop(lambda v: [f"acc = {fn}(acc, tl.where(MASK, {v}, {fill}))"])
            body.append(f"part = {'tl.max' if spec.op == 'max' else 'tl.min'}(acc, axis=1)[:, None]")
            return body + [f"tl.store({at}, part.to(tl.float64), mask=ROWMASK)"]
        body = [f"acc = tl.zeros([1, BR], {acc_t})"]
        body += loop(lambda v: [f"acc += tl.where(MASK, {v}, 0.0).to({acc_t})"])
        body.append("part = tl.sum(acc, axis=1)[:, None].to(tl.float64)")
        if spec.op in ("sum", "mean"):
            return body + [f"tl.store({at}, part, mask=ROWMASK)"]
        body.append("mean_c = part / (hi - lo).to(tl.float64)")
        body.append(f"acc2 = tl.zeros([1, BR], {acc_t})")
        body += loop(lambda v: [f"dv = tl.where(MASK, {v} - mean_c.to(tl.float32), 0.0).to({acc_t})",
                                "acc2 += dv * dv"])
        body.append("m2 = tl.sum(acc2, axis=1)[:, None].to(tl.float64)")
        return body + [f"tl.store({at}, mean_c, mask=ROWMASK)", f"tl.store({at} + 1, m2, mask=ROWMASK)"]

    @staticmethod
    def _split_combine(spec: _ReduceSpec, R: int, rs: int, CH: int) -> list[str]:
        """The row's partials combined in chunk order: `res`, or a norm's `mean` and `rstd`."""
        p2 = triton_next_pow2(rs)
        lines = [f"cs = tl.arange(0, {p2})[None, :]", f"CMASK = ROWMASK & (cs < {rs})",
                 f"wsr = WS_ptr + rows * {2 * rs} + cs * 2"]
        if spec.op in ("max", "min"):
            fill = "float('-inf')" if spec.op == "max" else "float('inf')"
            red = "tl.max" if spec.op == "max" else "tl.min"
            return lines + [f"res = {red}(tl.load(wsr, mask=CMASK, other={fill}), axis=1)[:, None].to(tl.float32)"]
        if spec.op in ("sum", "mean"):
            lines.append("res64 = tl.sum(tl.load(wsr, mask=CMASK, other=0.0), axis=1)[:, None]")
            return lines + [f"res = (res64{f' / {float(R)}' if spec.op == 'mean' else ''}).to(tl.float32)"]
        return lines + [
            "mc = tl.load(wsr, mask=CMASK, other=0.0)",
            "m2 = tl.load(wsr + 1, mask=CMASK, other=0.0)",
            f"nc = tl.minimum(tl.maximum({R} - cs * {CH}, 0), {CH}).to(tl.float64)",
            f"mean64 = tl.sum(nc * mc, axis=1)[:, None] / {float(R)}",
            "dm = mc - mean64",
            "var64 = tl.sum(m2 + nc * dm * dm, axis=1)[:, None] / " + f"{float(R)}",
            "mean = mean64.to(tl.float32)",
            f"rstd = (1.0 / tl.sqrt(var64 + {spec.eps!r})).to(tl.float32)"]

    def _values_output(self, n, what: str):
        """The node later ops read for a multi-output op (its getitem 0), refusing graphs that read other outputs."""
        gi = [u for u in self.users[n] if u.target is operator.getitem and self.users[u]]
        if any(u.args[1] != 0 for u in gi):
            raise Unsupported(what)
        return gi[0] if gi else n

    def _reduce_spec(self, n, nd: int) -> _ReduceSpec:
        """What reduction node `n` computes: its op, the dims it reduces and a norm's affine parameters."""
        t = n.target
        if t in (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default):
            dims = n.args[1] if len(n.args) > 1 else list(range(nd))
            dims = [dims] if isinstance(dims, int) else list(dims or range(nd))
            op = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.amax.default: "max",
                  aten.amin.default: "min"}[t]
            return _ReduceSpec(op, dims)
        if t in (aten.max.dim, aten.min.dim):
            self._values_output(n, "argmax/argmin used")
            return _ReduceSpec("max" if t == aten.max.dim else "min", [n.args[1]])
        if t == aten._softmax.default:
            return _ReduceSpec("softmax", [n.args[1]], full_out=True)
        if t == aten.native_group_norm.default:
            return _ReduceSpec("group_norm", None, full_out=True, weight=n.args[1], bias=n.args[2],
                               eps=float(n.args[7]), groups=int(n.args[6]))
        if t == aten.native_layer_norm.default:
            k = len(n.args[1])
            return _ReduceSpec("layer_norm", list(range(nd - k, nd)), full_out=True, weight=n.args[2],
                               bias=n.args[3], eps=float(n.args[4]))
        if t == aten.native_batch_norm.default:
            if not bool(n.args[5]):
                raise Unsupported("eval-mode batch norm")
            return _ReduceSpec("batch_norm", [d for d in range(nd) if d != 1], full_out=True, weight=n.args[1],
                               bias=n.args[2], eps=float(n.args[7]))
        raise Unsupported(f"reduction {t}")

    def _reduce_space(self, spec: _ReduceSpec, L: tuple[int, ...], pre: list[str]) -> _RowSpace:
        """Rows and reduced elements of a reduction over input shape `L`; the row index lines go to `pre`."""
        nd = len(L)
        if spec.op == "group_norm":
            G = spec.groups
            C = L[1]
            S = math.prod(L[2:])
            cpg = C // G
            pre += [f"rn = rows // {G}", f"rg = rows % {G}"]
            lines = [f"kc = kk // {S}", f"ks = kk % {S}", f"cc = rg * {cpg} + kc"]
            sp = self._decompose("ks", L[2:], lines, "s") if len(L) > 2 else []
            return _RowSpace(L[0] * G, cpg * S, ["rn", "cc", *sp], lines, chan="cc")
        dims = sorted({d % nd for d in spec.dims})
        kept = [d for d in range(nd) if d not in dims]
        nrows = math.prod(L[d] for d in kept) if kept else 1
        R = math.prod(L[d] for d in dims)
        kidx = self._decompose("rows", tuple(L[d] for d in kept), pre, "r") if kept else []
        lines: list[str] = []
        ridx = self._decompose("kk", tuple(L[d] for d in dims), lines, "q")
        full, ki, ri = [], iter(kidx), iter(ridx)
        for d in range(nd):
            full.append(next(ri) if d in dims else next(ki))
        return _RowSpace(nrows, R, full, lines, kidx=kidx, dims=dims)

    def _reduce_input(self, x, L, space: _RowSpace) -> tuple[list[str], str]:
        """(lines, name): the reduction's input at the loop's element, inlined afresh in each pass."""
        p: list[str] = []
        v = self.expr(x, space.idx, L, p, {}, {})
        return p, v

    @staticmethod
    def _reduce_loop(space: _RowSpace, inner: list[str], lo: str = "0", hi: str | None = None) -> list[str]:
        """One pass over the reduced elements [lo, hi) (all of them by default), BR at a time, running `inner` on
        each block."""
        hi = hi or str(space.R)
        out = [f"for k0 in range({lo}, {hi}, BR):",
               "    kk = k0 + tl.arange(0, BR)[None, :]",
               f"    MASK = ROWMASK & (kk < {hi})"]
        out += [f"    {l}" for l in list(space.ilines) + inner]
        return out

    def _reduce_statistics(self, spec: _ReduceSpec, x, L, space: _RowSpace) -> list[str]:
        """The statistics passes: `res` for sum/mean/max/min, the row max and sum for softmax, `mean` and `rstd`
        for the norms."""
        op, R = spec.op, space.R

        def loop(update):
            p, v = self._reduce_input(x, L, space)
            return self._reduce_loop(space, p + update(v))

        acc_t = "tl.float64" if self.cfg.get("acc64", True) else "tl.float32"
        body: list[str] = []
        if op in ("sum", "mean"):
            body.append(f"acc = tl.zeros([ROWS, BR], {acc_t})")
            body += loop(lambda v: [f"acc += tl.where(MASK, {v}, 0.0).to({acc_t})"])
            body.append(f"res = tl.sum(acc, axis=1)[:, None].to(tl.float32)")
            if op == "mean":
                body.append(f"res = res / {float(R)}")
        elif op in ("max", "min"):
            fill = "float('-inf')" if op == "max" else "float('inf')"
            fn = "tl.maximum" if op == "max" else "tl.minimum"
            body.append(f"acc = tl.full([ROWS, BR], {fill}, tl.float32)")
            body += loop(lambda v: [f"acc = {fn}(acc, tl.where(MASK, {v}, {fill}))"])
            body.append(f"res = {'tl.max' if op == 'max' else 'tl.min'}(acc, axis=1)[:, None]")
        elif op == "softmax":
            body += ["m_acc = tl.full([ROWS, BR], float('-inf'), tl.float32)", "s_acc = tl.zeros([ROWS, BR], tl.float32)"]
            body += loop(lambda v: [
                f"xv = tl.where(MASK, {v}, float('-inf'))",
                "m_new = tl.maximum(m_acc, xv)",
                "s_acc = s_acc * tl.exp(m_acc - tl.where(m_new == float('-inf'), 0.0, m_new)) + "
                "tl.where(MASK, tl.exp(xv - tl.where(m_new == float('-inf'), 0.0, m_new)), 0.0)",
                "m_acc = m_new"])
            body += ["m_row = tl.max(m_acc, axis=1)[:, None]",
                     "s_row = tl.sum(s_acc * tl.exp(m_acc - m_row), axis=1)[:, None]"]
        else:  # norms: mean, then variance about it (two passes, as torch computes them)
            body.append(f"acc = tl.zeros([ROWS, BR], {acc_t})")
            body += loop(lambda v: [f"acc += tl.where(MASK, {v}, 0.0).to({acc_t})"])
            body.append(f"mean = (tl.sum(acc, axis=1)[:, None] / {float(R)}).to(tl.float32)")
            body.append(f"acc2 = tl.zeros([ROWS, BR], {acc_t})")
            body += loop(lambda v: [f"dv = tl.where(MASK, {v} - mean, 0.0).to({acc_t})", "acc2 += dv * dv"])
            body.append(f"rstd = (1.0 / tl.sqrt(tl.sum(acc2, axis=1)[:, None] / {float(R)} + {spec.eps!r}))"
                        f".to(tl.float32)")
        return body

    def _reduce_final_pass(self, spec: _ReduceSpec, res_node, x, L, space: _RowSpace, lo: str = "0",
                           hi: str | None = None) -> tuple[list[str], Any, set]:
        """(lines, node stored, leaves it reads): the pass storing the normalised value (and the epilogue) at every
        element of [lo, hi), for softmax and the norms."""
        p, xv = self._reduce_input(x, L, space)
        idx = space.idx
        if spec.op == "softmax":
            p.append(f"y = tl.exp({xv} - m_row) / s_row")
        else:
            p.append(f"y = ({xv} - mean) * rstd")
            if spec.weight is not None:
                p.append(f"y = y * {self._param(spec.weight, idx, L, space.chan, p, spec.op)}")
            if spec.bias is not None:
                p.append(f"y = y + {self._param(spec.bias, idx, L, space.chan, p, spec.op)}")
        bind = {res_node: "y"}
        stored, v = self._store_value(res_node, idx, L, p, bind, {})
        leaves = self._leaves(stored, set(), bind)
        p.append(f"tl.store(OUT_ptr + {self._offset(_strides(L), L, idx)}, {v}, mask=MASK)")
        return self._reduce_loop(space, p, lo, hi), stored, leaves

    def _reduce_row_store(self, res_node, nd: int, space: _RowSpace) -> tuple[list[str], Any, set]:
        """(lines, node stored, leaves it reads): the per-row store of `res` at the reduced tensor's layout."""
        out_shape = _shape(res_node)
        oidx = []
        ki = iter(space.kidx)
        keep_dim = len(out_shape) == nd
        for d in range(nd):
            if d in space.dims:
                if keep_dim:
                    oidx.append("0")
            else:
                oidx.append(next(ki))
        bind = {res_node: "res"}
        p: list[str] = []
        stored, v = self._store_value(res_node, oidx, out_shape, p, bind, {})
        leaves = self._leaves(stored, set(), bind)
        off = self._offset(_strides(out_shape), out_shape, oidx)
        lines = ["MASK = ROWMASK", *p,
                 f"tl.store(OUT_ptr + {'0 * rows' if off == '0' else off}, {v}, mask=ROWMASK)"]
        return lines, stored, leaves

    def _acc_output(self, n, idx: list[str], shape, own: list) -> tuple[str, list[str], list, Buf]:
        """A GEMM-like kernel's output: the value stored at `idx` (the pointwise sub-graph after `n` computed on the
        accumulator `acc`, when it fuses), its lines, the stored tensors it reads besides the kernel's own operands
        `own`, and the allocated output."""
        bind: dict = {n: "acc"}
        pre: list[str] = []
        self.flat = None
        stored, v = self._store_value(n, idx, tuple(shape), pre, bind, {})
        mine = {o.var for o in own if o is not None}
        leaves = sorted((l for l in self._leaves(stored, set(), bind) if self.bufs[l].var not in mine),
                        key=lambda l: self.bufs[l].var)
        out = self._alloc(stored, tuple(shape))
        if stored is not n:
            self.fused_into[stored] = n
        return v, pre, leaves, out

    def _acc_store(self, src: list[str], b: Buf | None, bidx: str, nb: int, pre: list[str], off: str, v: str) -> None:
        """The bias (indexed by `bidx`, `nb` long), the epilogue's lines and the masked store close the kernel."""
        if b is not None:
            src.append(f"    acc = acc + tl.load({b.var}_ptr + {bidx}, mask={bidx} < {nb}, other=0.0)")
        src += [f"    {l}" for l in pre]
        src.append(f"    tl.store(OUT_ptr + {off}, {v}, mask=MASK)")
        self.plan.kernels.append("\n".join(src))

    def gemm_kernel(self, n, x: Buf, w: Buf, b: Buf | None) -> None:
        """out = epilogue(x @ w + b) in one Triton kernel: an fp32 GEMM with IEEE-precision dots (TF32 would miss
        1e-4), grouped tile order for L2 reuse, and the pointwise sub-graph after the GEMM computed on the
        accumulator tile before the store."""
        M, K = x.shape
        K2, N = w.shape
        if K2 != K or (b is not None and b.shape != (N,)):
            raise Unsupported("GEMM operand shapes")
        v, pre, leaves, out = self._acc_output(n, ["rm", "rn"], (M, N), [x, w, b])
        name = self._new()
        ptrs = [f"{x.var}_ptr", f"{w.var}_ptr", *([f"{b.var}_ptr"] if b is not None else []),
                *(f"{self.bufs[l].var}_ptr" for l in leaves)]
        call = [x.var, w.var, *([b.var] if b is not None else []), *(self.bufs[l].var for l in leaves)]
        sxm, sxk = x.strides
        swk, swn = w.strides
        # ieee: fp32 FMA dots; tf32x3: three TF32 tensor-core products (hi*hi + hi*lo + lo*hi), near-fp32 accuracy
        # that the verifier must still find within KernelBench's 1e-4 (TF32 alone is not offered)
        precision = self.cfg.get("gemm_precision", "ieee")
        if precision not in ("ieee", "tf32x3"):
            raise Unsupported(f"gemm_precision {precision!r}: expected 'ieee' or 'tf32x3'")
        src = [f"@triton.jit",
               f"def {name}({', '.join(ptrs)}, OUT_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, "
               f"GROUP_M: tl.constexpr):",
               "    pid = tl.program_id(0)",
               f"    num_m = tl.cdiv({M}, BM)",
               f"    num_n = tl.cdiv({N}, BN)",
               "    group = GROUP_M * num_n",
               "    first_m = (pid // group) * GROUP_M",
               "    gsz = tl.minimum(num_m - first_m, GROUP_M)",
               "    pid_m = first_m + (pid % group) % gsz",
               "    pid_n = (pid % group) // gsz",
               "    rm = (pid_m * BM + tl.arange(0, BM))[:, None]",
               "    rn = (pid_n * BN + tl.arange(0, BN))[None, :]",
               "    rk = tl.arange(0, BK)",
               "    acc = tl.zeros([BM, BN], tl.float32)",
               f"    for k0 in range(0, {K}, BK):",
               "        kk = k0 + rk",
               f"        a = tl.load({x.var}_ptr + rm * {sxm} + kk[None, :] * {sxk}, mask=(rm < {M}) & "
               f"(kk[None, :] < {K}), other=0.0)",
               f"        bt = tl.load({w.var}_ptr + kk[:, None] * {swk} + rn * {swn}, mask=(kk[:, None] < {K}) & "
               f"(rn < {N}), other=0.0)",
               f"        acc += tl.dot(a, bt, input_precision=\"{precision}\")",
               f"    MASK = (rm < {M}) & (rn < {N})"]
        self._acc_store(src, b, "rn", N, pre, f"rm * {N} + rn", v)
        c = self.cfg
        bm, bn = c.get("BM", 128), c.get("BN", 128)
        self.plan.lines.append(
            f"{name}[(triton.cdiv({M}, {bm}) * triton.cdiv({N}, {bn}),)]({', '.join(call)}, {out.var}, BM={bm}, "
            f"BN={bn}, BK={c.get('BK', 32)}, GROUP_M=8, num_warps={c.get('gemm_warps', 8)}, "
            f"num_stages={c.get('gemm_stages', 3)})")
        self.plan.kinds.append("triton_gemm+epilogue")
        self.plan.heavy.append(f"triton_gemm_{precision}")

    def conv_kernel(self, n, x: Buf, w: Buf, b: Buf | None, stride, pad, dil, transposed: bool = False) -> None:
        """out = epilogue(conv(x, w) + b) as one implicit GEMM in Triton (groups 1). The pointwise sub-graph after the
        conv is computed on the accumulator before the store, as in `gemm_kernel`. cuDNN's strict-fp32 convs run on
        the FMA pipes (slowest on strided 3-D transposed convs); TF32x3 dots run on
        the tensor cores, and the verifier holds them to KernelBench's 1e-4. `conv_layout` picks the geometry:
        "nc" (`_ConvGeometry`: [output channels, positions] tiles over the NC* tensors), "cl" and "clk" (channels-last
        copies made by the forward; `_ConvGeometryCL`, `_ConvGeometryCLK`).
        A transposed conv is split by output phase (o + pad) mod stride: within a phase only the taps
        k = phase + stride * t reach an output, from input position o // stride - t, so each program's tile is one
        phase and its K loop has no dead taps (a plain gather would waste 7 of 8 taps of a stride-2 3-D one)."""
        NB, CI, *S = x.shape
        if transposed:
            CI2, CO, *KS = w.shape
        else:
            CO, CI2, *KS = w.shape
        out_shape = tuple(_shape(n))
        if CI2 != CI or len(KS) != len(S) or (b is not None and b.shape != (CO,)):
            raise Unsupported("conv operand shapes")
        if w.strides != _strides(w.shape):
            raise Unsupported("conv weight not contiguous")
        if transposed and any(d != 1 for d in dil):
            raise Unsupported("dilated transposed conv")
        precision = self.cfg.get("conv_precision", "tf32x3")
        if precision not in ("ieee", "tf32x3"):
            raise Unsupported(f"conv_precision {precision!r}: expected 'ieee' or 'tf32x3'")
        layout = self.cfg.get("conv_layout", "nc")
        geos = {"nc": _ConvGeometry, "cl": _ConvGeometryCL, "clk": _ConvGeometryCLK}
        if layout not in geos:
            raise Unsupported(f"conv_layout {layout!r}: expected one of {sorted(geos)}")
        cl = layout != "nc"
        geo = geos[layout](x, w, out_shape, stride, pad, dil, transposed)
        v, pre, leaves, out = self._acc_output(n, geo.idx, out_shape, [x, w, b])
        name = self._new()
        xk, wk = x, w
        if cl:  # channels-last copies of the input and the weight: the K loop's loads run along input channels
            xk, wk = Buf(f"{x.var}_cl", x.shape, x.strides), Buf(f"{w.var}_cl", w.shape, w.strides)
            sp = ", ".join(str(2 + d) for d in range(len(S)))
            self.plan.lines += [f"{xk.var} = {x.var}.permute(0, {sp}, 1).contiguous()",
                                f"{wk.var} = {w.var}.permute({sp}, {'0, 1' if transposed else '1, 0'}).contiguous()"]
        ops = [xk, wk, *([b] if b is not None else []), *(self.bufs[l] for l in leaves)]
        c = self.cfg
        bc, bp = min(c.get("BCO", 128), max(16, triton_next_pow2(CO))), c.get("BP", 128)
        ntc, ntp = -(-CO // bc), -(-geo.M // bp)
        wide = self._wide(leaves, max(math.prod(out_shape), math.prod(x.shape)))
        src = [f"@triton.jit",
               f"def {name}({', '.join(f'{o.var}_ptr' for o in ops)}, OUT_ptr, BC: tl.constexpr, BP: tl.constexpr, "
               f"BK: tl.constexpr):",
               "    pid = tl.program_id(0)",
               f"    pid_c = pid % {ntc}",  # the channel tiles of one position tile run together
               f"    ph = pid // {ntc * ntp}",
               f"    rp = ((pid // {ntc}) % {ntp}){wide} * BP + tl.arange(0, BP)",
               "    rc = pid_c * BC + tl.arange(0, BC)",
               *(f"    {l}" for l in geo.position_lines()),
               *(f"    {l}" for l in geo.k_loop(xk.var, wk.var, precision, c.get("CK", 32))),
               f"    MASK = {geo.mask}"]
        self._acc_store(src, b, geo.rcb, CO, pre, self._offset(_strides(out_shape), out_shape, geo.idx), v)
        self.plan.lines.append(
            f"{name}[({geo.phases * ntp * ntc},)]({', '.join(o.var for o in ops)}, {out.var}, BC={bc}, BP={bp}, "
            f"BK={c.get('CK', 32)}, num_warps={c.get('conv_warps', 8)}, num_stages={c.get('conv_stages', 3)})")
        self.plan.kinds.append("triton_conv+epilogue")
        self.plan.heavy.append(f"triton_conv{'_transpose' if transposed else ''}{len(S)}d_{precision}")

    def _param(self, w, idx, L, chan, p, op) -> str:
        """An affine parameter of a norm at element `idx`: per channel (group/batch norm) or over the normalised
        trailing dims (layer norm)."""
        if op == "group_norm":
            return self._load(self.bufs[w], [chan], p) if w in self.bufs else self.expr(w, [chan], (_shape(w)[0],),
                                                                                          p, {}, {})
        if op == "batch_norm":
            return self.expr(w, [idx[1]], (_shape(w)[0],), p, {}, {})
        ws = _shape(w)
        return self.expr(w, idx[len(idx) - len(ws):], ws, p, {}, {})

    @staticmethod
    def _offset(strides, shape, idx) -> str:
        terms = [f"({i}) * {st}" for i, s, st in zip(idx, shape, strides) if s != 1 and i != "0"]
        return " + ".join(terms) if terms else "0"


class _ConvGeometry:
    """Index expressions of a conv's implicit GEMM: the output positions a program's tile covers (`position_lines`,
    `idx` for the store and the epilogue, `PMASK`) and the K loop over (input channel, taps)."""

    def __init__(self, x: Buf, w: Buf, out_shape, stride, pad, dil, transposed: bool):
        self.x, self.w, self.out_shape = x, w, out_shape
        self.stride, self.pad, self.dil, self.t = list(stride), list(pad), list(dil), transposed
        NB, CI, *self.S = x.shape
        self.KS = list(w.shape[2:])
        self.O = list(out_shape[2:])
        self.nd = len(self.S)
        self.CO = w.shape[1] if transposed else w.shape[0]
        if transposed:
            # per dim: J positions j a phase (o = s * j + r - p), T taps t a phase (k = r + s * t)
            self.J = [-(-(o + p) // s) for o, p, s in zip(self.O, self.pad, self.stride)]
            self.T = [-(-k // s) for k, s in zip(self.KS, self.stride)]
            self.phases = math.prod(self.stride)
        else:
            self.J, self.T, self.phases = self.O, self.KS, 1
        self.M = NB * math.prod(self.J)
        self.KT = CI * math.prod(self.T)
        P, C = self.POS, self.CH  # the tile's position and channel axes, as broadcast suffixes
        self.idx = [f"j0{P}", f"rc{C}", *(f"o{d + 1}{P}" for d in range(self.nd))]
        self.rcb = f"rc{C}"
        self.mask = f"(rc{C} < {self.CO}) & PMASK{P}"

    POS, CH = "[None, :]", "[:, None]"

    def _positions(self, lines: list[str]) -> list[str]:
        """The batch and per-phase position indices j0, j1.. of the tile's rp (and r0..: a transposed conv's phase
        of each spatial dim)."""
        jidx = Gen._decompose("rp", (self.x.shape[0], *self.J), lines, prefix="j")
        if self.t:
            Gen._decompose("ph", tuple(self.stride), lines, prefix="r")
        return jidx

    def position_lines(self) -> list[str]:
        lines: list[str] = []
        jidx = self._positions(lines)
        sx = self.x.strides
        if self.t:
            valid = []
            for d in range(self.nd):
                s, p, jd = self.stride[d], self.pad[d], jidx[1 + d]
                lines.append(f"o{d + 1} = {jd} * {s} + r{d} - {p}")
                valid.append(f"(o{d + 1} >= 0) & (o{d + 1} < {self.O[d]})")
            terms = [f"j0 * {sx[0]}"] + [f"{jidx[1 + d]} * {sx[2 + d]}" for d in range(self.nd)]
            lines.append(f"xbase = {' + '.join(terms)}")
            lines.append(f"PMASK = (rp < {self.M}) & {' & '.join(valid)}")
        else:
            for d in range(self.nd):
                lines.append(f"o{d + 1} = {jidx[1 + d]}")
            terms = [f"j0 * {sx[0]}"] + [f"(o{d + 1} * {self.stride[d]} - {self.pad[d]}) * {sx[2 + d]}"
                                        for d in range(self.nd)]
            lines.append(f"xbase = {' + '.join(terms)}")
            lines.append(f"PMASK = rp < {self.M}")
        return lines

    def k_loop(self, xv: str, wv: str, precision: str, bk: int = 32) -> list[str]:
        """A [BC, BK] weight tile times a [BK, BP] gather of x; taps outside the input (padding, a phase's edge)
        and a phase's taps past the kernel masked to zero."""
        CI, nd, sx = self.x.shape[1], self.nd, self.x.strides
        kdec: list[str] = []
        tidx = Gen._decompose("kk", (CI, *self.T), kdec, prefix="q")  # q0: the input channel, q1..: the tap
        KV = math.prod(self.KS)
        kmask = [f"(kk < {self.KT})"]
        if self.t:
            # tap k = r + s * t (its flat index in w[ci, co, k...]); input position j - t
            for d in range(nd):
                kdec.append(f"k{d + 1} = r{d} + {self.stride[d]} * {tidx[1 + d]}")
                if self.KS[d] % self.stride[d]:
                    kmask.append(f"(k{d + 1} < {self.KS[d]})")
            kflat = " + ".join(f"k{d + 1} * {math.prod(self.KS[d + 1:])}" for d in range(nd))
            woff = f"{tidx[0]}[None, :] * {self.CO * KV} + rc[:, None] * {KV} + ({kflat})[None, :]"
            koff = [f"{tidx[0]} * {sx[1]}"] + [f"-{tidx[1 + d]} * {sx[2 + d]}" for d in range(nd)]
            pos = [(f"(j{1 + d}[None, :] - {tidx[1 + d]}[:, None])", self.S[d]) for d in range(nd)]
        else:
            woff = f"rc[:, None] * {self.KT} + kk[None, :]"
            koff = [f"{tidx[0]} * {sx[1]}"] + [f"{tidx[1 + d]} * {self.dil[d] * sx[2 + d]}" for d in range(nd)]
            pos = [(f"(o{1 + d}[None, :] * {self.stride[d]} - {self.pad[d]} + {tidx[1 + d]}[:, None] * "
                    f"{self.dil[d]})", self.S[d]) for d in range(nd)
                   if self.pad[d] or (self.O[d] - 1) * self.stride[d] + (self.KS[d] - 1) * self.dil[d] >= self.S[d]]
        bounds = "".join(f" & ({e} >= 0) & ({e} < {s})" for e, s in pos)
        km = " & ".join(kmask)
        return ["acc = tl.zeros([BC, BP], tl.float32)",
                f"for k0 in range(0, {self.KT}, BK):",
                "    kk = k0 + tl.arange(0, BK)",
                *(f"    {l}" for l in kdec),
                f"    KM = {km}",
                f"    koff = {' + '.join(koff)}",
                f"    wt = tl.load({wv}_ptr + {woff}, mask=(rc[:, None] < {self.CO}) & KM[None, :], other=0.0)",
                f"    xt = tl.load({xv}_ptr + koff[:, None] + xbase[None, :], mask=KM[:, None] & PMASK[None, :]"
                f"{bounds}, other=0.0)",
                f"    acc += tl.dot(wt, xt, input_precision=\"{precision}\")"]


class _ConvGeometryCL(_ConvGeometry):
    """The channels-last implicit GEMM (torch inductor's conv template does the same): x and w copied to
    [N, *spatial, C_in] and [*taps, C_in, C_out] by the forward, the tile [output positions, output channels], the
    K loop over (tap, block of input channels), so both operands load along contiguous channels (16-byte loads when
    C_in and C_out are multiples of 4) and every bound check is per position, not per element."""

    POS, CH = "[:, None]", "[None, :]"

    def position_lines(self) -> list[str]:
        lines: list[str] = []
        jidx = self._positions(lines)
        CI = self.x.shape[1]
        if self.t:
            for d in range(self.nd):
                lines.append(f"o{d + 1} = {jidx[1 + d]} * {self.stride[d]} + r{d} - {self.pad[d]}")
            valid = " & ".join(f"(o{d + 1} >= 0) & (o{d + 1} < {self.O[d]})" for d in range(self.nd))
            lines.append(f"PMASK = (rp < {self.M}) & {valid}")
        else:
            lines += [f"o{d + 1} = {jidx[1 + d]}" for d in range(self.nd)]
            lines.append(f"PMASK = rp < {self.M}")
        lines.append(f"xb = j0 * {math.prod(self.S) * CI}")
        return lines

    def k_loop(self, xv: str, wv: str, precision: str, bk: int = 32) -> list[str]:
        CI, nd = self.x.shape[1], self.nd
        row = [math.prod(self.S[d + 1:]) * CI for d in range(nd)]  # x_cl's stride of spatial dim d
        tdec: list[str] = []
        tidx = Gen._decompose("tap", tuple(self.T), tdec, prefix="t")
        ncb = -(-CI // bk)
        body = [f"c0 = (it % {ncb}) * BK", f"tap = it // {ncb}", *tdec, "cc = c0 + tl.arange(0, BK)",
                f"CM = cc < {CI}"]
        pm, terms = ["PMASK"], []
        if self.t:
            for d in range(nd):
                k, s_, t = f"k{d + 1}", self.stride[d], tidx[d]
                if self.KS[d] % s_:  # a phase with fewer taps than T: its extra tap reads no x (the weight index
                    # is clamped in range; a scalar condition is not used as a load mask, which the interpreter refuses)
                    body.append(f"i{d + 1} = tl.where(r{d} + {s_} * {t} < {self.KS[d]}, j{d + 1} - {t}, -1)")
                    body.append(f"{k} = tl.minimum(r{d} + {s_} * {t}, {self.KS[d] - 1})")
                else:
                    body.append(f"i{d + 1} = j{d + 1} - {t}")
                    body.append(f"{k} = r{d} + {s_} * {t}")
            kflat = " + ".join(f"k{d + 1} * {math.prod(self.KS[d + 1:])}" for d in range(nd))
        else:
            for d in range(nd):
                body.append(f"i{d + 1} = o{d + 1} * {self.stride[d]} - {self.pad[d]} + {tidx[d]} * {self.dil[d]}")
            kflat = "tap"
        for d in range(nd):
            terms.append(f"i{d + 1} * {row[d]}")
            pm.append(f"(i{d + 1} >= 0) & (i{d + 1} < {self.S[d]})")
        wm = f"CM[:, None] & (rc[None, :] < {self.CO})"
        body += [f"PM = {' & '.join(pm)}",
                 f"xt = tl.load({xv}_ptr + (xb + {' + '.join(terms)})[:, None] + cc[None, :], "
                 f"mask=PM[:, None] & CM[None, :], other=0.0)",
                 f"wt = tl.load({wv}_ptr + (({kflat}) * {CI} + cc)[:, None] * {self.CO} + rc[None, :], "
                 f"mask={wm}, other=0.0)",
                 f"acc += tl.dot(xt, wt, input_precision=\"{precision}\")"]
        return ["acc = tl.zeros([BP, BC], tl.float32)",
                f"for it in range({math.prod(self.T) * ncb}):",
                *(f"    {l}" for l in body)]


class _ConvGeometryCLK(_ConvGeometryCL):
    """Channels last with the K loop over (tap, input channel) flattened, for a few input channels (4-12): a K block
    spans several taps, each a run of C_in contiguous channels (16-byte loads when C_in is a multiple of 4), where
    the tap-by-tap loop would leave most of a 16-deep K step empty. Convolutions only, not transposed."""

    def __init__(self, *a):
        super().__init__(*a)
        if self.t:
            raise Unsupported("flattened channels-last K loop: not for transposed convs")

    def k_loop(self, xv: str, wv: str, precision: str, bk: int = 32) -> list[str]:
        CI, nd = self.x.shape[1], self.nd
        row = [math.prod(self.S[d + 1:]) * CI for d in range(nd)]
        kdec: list[str] = []
        tidx = Gen._decompose("tk", tuple(self.T), kdec, prefix="t")  # the tap of each K element
        pos = " + ".join(["xb"] + [f"(o{d + 1} * {self.stride[d]} - {self.pad[d]}) * {row[d]}" for d in range(nd)])
        koff = " + ".join([f"{tidx[d]} * {self.dil[d] * row[d]}" for d in range(nd)] + ["ci"])
        bounds = ""
        for d in range(nd):
            if self.pad[d] or (self.O[d] - 1) * self.stride[d] + (self.KS[d] - 1) * self.dil[d] >= self.S[d]:
                e = (f"(o{d + 1}[:, None] * {self.stride[d]} - {self.pad[d]} + {tidx[d]}[None, :] * "
                     f"{self.dil[d]})")
                bounds += f" & ({e} >= 0) & ({e} < {self.S[d]})"
        return [f"xpos = {pos}",
                "acc = tl.zeros([BP, BC], tl.float32)",
                f"for k0 in range(0, {self.KT}, BK):",
                "    kk = k0 + tl.arange(0, BK)",
                f"    ci = kk % {CI}",
                f"    tk = kk // {CI}",
                *(f"    {l}" for l in kdec),
                f"    KM = kk < {self.KT}",
                f"    xt = tl.load({xv}_ptr + xpos[:, None] + ({koff})[None, :], "
                f"mask=PMASK[:, None] & KM[None, :]{bounds}, other=0.0)",
                f"    wt = tl.load({wv}_ptr + kk[:, None] * {self.CO} + rc[None, :], "
                f"mask=KM[:, None] & (rc[None, :] < {self.CO}), other=0.0)",
                f"    acc += tl.dot(xt, wt, input_precision=\"{precision}\")"]


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# -------------------------------------------------------------------------------------------------------- driver

def _dropouts(gm) -> tuple[dict, set]:
    """mul(x, div_(bernoulli_(empty, keep), keep)): torch's dropout as make_fx decomposes it. The candidate calls
    torch's own dropout on x there, so its mask comes from the same RNG stream as the reference's."""
    found, skip = {}, set()
    for b in gm.graph.nodes:
        if b.op == "call_function" and b.target == aten.bernoulli_.float:
            keep = float(b.args[1])
            for d in b.users:
                if d.target in (aten.div_.Scalar, aten.div.Scalar) and abs(float(d.args[1]) - keep) < 1e-12:
                    for m in d.users:
                        if m.target == aten.mul.Tensor:
                            x = m.args[0] if m.args[1] is d else m.args[1]
                            found[m] = (x, 1.0 - keep)
                            skip |= {b, d, b.args[0]}
    return found, skip


def generate(gm: torch.fx.GraphModule, param_names: list[str], n_inputs: int, cfg: dict[str, Any]) -> Plan:
    """Walk the graph: placeholders are `params` (in `param_names` order) then the inputs."""
    g = Gen(gm, {}, cfg)
    lines = g.plan.lines
    drop, skip = _dropouts(gm)
    _bind_placeholders(g, param_names, n_inputs)
    skip = skip | _bind_constants(g)
    for n in gm.graph.nodes:
        if n.op in ("placeholder",) or n in skip:
            continue
        if n.op == "output":
            outs = n.args[0]
            outs = outs if isinstance(outs, (list, tuple)) else [outs]
            if len(outs) != 1:
                raise Unsupported("several outputs")
            b = _stored(g, outs[0])
            lines.append(f"return {b.var}")
            break
        if not g.users[n]:
            continue  # running-statistics updates and other values nothing reads
        if n in drop:
            _dropout(g, n, *drop[n])
            continue
        k = g.kind(n)
        if k in ("pointwise", "identity", "getitem"):
            continue  # inlined into the kernels that read them (or stored on demand by `_stored`)
        if k == "heavy":
            _heavy(g, n)
        elif k == "view":
            _view(g, n)
        elif k == "reduce":
            g.reduce_kernel(n)
        elif k == "pool":
            g.pool_kernel(n)
        elif k == "rng":
            raise Unsupported("random op outside dropout")
        else:
            raise Unsupported(f"node {n.name} ({k})")
    return g.plan


def _bind_placeholders(g: Gen, param_names: list[str], n_inputs: int) -> None:
    """Parameters become `p{i} = self.<name>` lines, inputs the forward's arguments `x{i}`. A plain tensor attribute
    the forward reads is copied, in the constructor, into a non-persistent fp32 buffer (moved with the module, absent
    from the state dict the verifier binds), and read from there."""
    ph = [n for n in g.gm.graph.nodes if n.op == "placeholder"]
    if len(ph) != len(param_names) + n_inputs:
        raise Unsupported(f"expected {len(param_names) + n_inputs} placeholders, got {len(ph)}")
    for i, n in enumerate(ph):
        shape = _shape(n)
        if i < len(param_names):
            var = f"p{i}"
            if not n.meta.get(ATTRIBUTE_META):
                g.plan.lines.append(f"{var} = {_attribute(param_names[i])}")
            elif g.users[n]:
                g.plan.init.append(f"self.register_buffer('_kb_{var}', torch.as_tensor({_attribute(param_names[i])})"
                                   f".to(torch.float32).clone().contiguous(), persistent=False)")
                g.plan.lines.append(f"{var} = self._kb_{var}")
        else:
            var = f"x{i - len(param_names)}"
        g.bufs[n] = Buf(var, shape, _strides(shape))


def _attribute(path: str) -> str:
    """`self.<path>`, through get_submodule where a module on the path has no identifier name (`blocks.0.c`)."""
    prefix, _, name = path.rpartition(".")
    if all(p.isidentifier() for p in path.split(".")):
        return f"self.{path}"
    return f"self.get_submodule({prefix!r}).{name}"


def constant_value(gm: torch.fx.GraphModule, n) -> torch.Tensor | None:
    """The value of a get_attr constant when the capture knows it: a real tensor (made from data in forward), or a
    fake one that carries its constant (fake mode keeps one-element constants). None for a fake tensor of unknown
    value."""
    from torch._subclasses.fake_tensor import FakeTensor

    v = getattr(gm, n.target)
    if isinstance(v, FakeTensor):
        v = v.constant
    return v if isinstance(v, torch.Tensor) else None


def _pylit(v: float) -> str:
    """A Python (not Triton) literal: inf and nan as float(...) calls."""
    return repr(v) if math.isfinite(v) else f"float('{v}')"


def _constant_buffer(g: Gen, n) -> None:
    """A tensor constant of the graph as a non-persistent fp32 buffer of ModelNew, written value by value into its
    constructor; the kernels read it like a weight."""
    v = constant_value(g.gm, n)
    if v is None:
        raise Unsupported(f"graph constant {n.target} of unknown value")
    if v.numel() > CONSTANT_MAX_NUMEL:
        raise Unsupported(f"graph constant of {v.numel()} elements (at most {CONSTANT_MAX_NUMEL} written out)")
    shape = tuple(int(s) for s in v.shape)
    values = ", ".join(_pylit(float(x)) for x in v.detach().double().flatten().tolist())
    var = f"c{len(g.plan.init)}"
    g.plan.init.append(f"self.register_buffer('_kb_{var}', torch.tensor([{values}], dtype=torch.float32).view("
                       f"{shape!r}), persistent=False)")
    g.plan.lines.append(f"{var} = self._kb_{var}")
    g.bufs[n] = Buf(var, shape, _strides(shape))
    g.plan.kinds.append("constant buffer")


def _bind_constants(g: Gen) -> set:
    """Tensor constants, and their copies and views, bound before the first kernel is planned, as the placeholders
    are: an epilogue fuses only operands already stored, and a constant's view comes after the heavy op in the
    graph. Returns the nodes bound."""
    bound: set = set()
    for n in g.gm.graph.nodes:
        if not g.users[n]:
            continue
        if n.op == "get_attr":
            _constant_buffer(g, n)
        elif g.kind(n) in ("identity", "view") and isinstance(n.args[0], torch.fx.Node) and n.args[0] in bound:
            if g.kind(n) == "identity":
                g.bufs[n] = g.bufs[n.args[0]]  # a copy of a constant (lift_fresh_copy): nothing writes either
            else:
                _view(g, n)
        else:
            continue
        bound.add(n)
    return bound


def _stored(g: Gen, a) -> Buf:
    """Make sure node a is a stored tensor (a pointwise chain gets a kernel of its own)."""
    if a in g.bufs:
        return g.bufs[a]
    k = g.kind(a)
    if k in ("pointwise", "identity"):
        g.pointwise_kernel(a)
        return g.bufs[a]
    raise Unsupported(f"{a.name} ({k}) is not stored")


def _dropout(g: Gen, n, x, p: float) -> None:
    b = _stored(g, x)
    var = g.var()
    g.plan.lines.append(f"{var} = torch.nn.functional.dropout({b.var}, {p!r}, True)")
    g.bufs[n] = Buf(var, b.shape, b.strides)
    g.plan.kinds.append("dropout (torch, same RNG stream)")


def _heavy(g: Gen, n) -> None:
    """A convolution or matmul: a torch call (cuDNN/cuBLAS), or the Triton GEMM when the config asks for it."""
    lines = g.plan.lines
    args = [_stored(g, a) if isinstance(a, torch.fx.Node) else a for a in n.args]
    var = g.var()
    if n.target == aten.convolution.default:
        x, w, b, stride, pad, dil, transposed, opad, groups = args
        nd = len(stride)
        if g.cfg.get("conv") == "triton" and groups == 1 and (not transposed or all(d == 1 for d in dil)):
            g.conv_kernel(n, x, w, b, stride, pad, dil, transposed)
            return
        bvar = b.var if b is not None else "None"
        if transposed:
            lines.append(f"{var} = torch.nn.functional.conv_transpose{nd}d({x.var}, {w.var}, {bvar}, "
                         f"{tuple(stride)}, {tuple(pad)}, {tuple(opad)}, {groups}, {tuple(dil)})")
        else:
            lines.append(f"{var} = torch.nn.functional.conv{nd}d({x.var}, {w.var}, {bvar}, {tuple(stride)}, "
                         f"{tuple(pad)}, {tuple(dil)}, {groups})")
        g.plan.heavy.append(f"conv{'_transpose' if transposed else ''}{nd}d")
    elif n.target in (aten.addmm.default, aten.mm.default) and g.cfg.get("gemm") == "triton":
        if n.target == aten.addmm.default:
            if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
                raise Unsupported("addmm alpha/beta")
            b, x, w = args[:3]
        else:
            b, (x, w) = None, args[:2]
        g.gemm_kernel(n, x, w, b)
        return
    elif n.target == aten.addmm.default:
        b, x, w = args[:3]
        if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
            raise Unsupported("addmm alpha/beta")
        lines.append(f"{var} = torch.addmm({b.var}, {x.var}, {w.var})")
        g.plan.heavy.append("addmm")
    elif n.target == aten.mm.default:
        lines.append(f"{var} = torch.mm({args[0].var}, {args[1].var})")
        g.plan.heavy.append("mm")
    else:
        lines.append(f"{var} = torch.bmm({args[0].var}, {args[1].var})")
        g.plan.heavy.append("bmm")
    shape = _shape(n)
    g.bufs[n] = Buf(var, shape, _strides(shape))


def _view(g: Gen, n) -> None:
    """A permute (strides permuted, no copy) or a view of a contiguous tensor."""
    b = _stored(g, n.args[0])
    var = g.var()
    shape = _shape(n)
    if n.target in (aten.permute.default, aten.t.default):
        perm = list(n.args[1]) if n.target == aten.permute.default else [1, 0]
        g.plan.lines.append(f"{var} = {b.var}.permute({tuple(perm)})")
        g.bufs[n] = Buf(var, shape, tuple(b.strides[p] for p in perm))
    elif n.target == aten.expand.default:
        raise Unsupported("expand")
    else:
        if b.strides != _strides(b.shape):
            raise Unsupported("view of a strided tensor")
        g.plan.lines.append(f"{var} = {b.var}.view({tuple(shape)})")
        g.bufs[n] = Buf(var, shape, _strides(shape))


# -------------------------------------------------------------------------------------------------------- rewrites

def _meta(node, shape):
    node.meta["val"] = torch.empty(shape, device="meta")
    return node


SCALAR_LINEAR = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar}


def rewrite_gemm_sum(gm: torch.fx.GraphModule) -> int:
    """sum_j (x W^T + b)_ij * c = c * (x . sum_j W_j + sum_j b_j): a GEMM whose every output is summed over the
    feature dim (after scalings) becomes a GEMV with the column-summed weight. Exact in real arithmetic (the fp32
    sums are reassociated; the verifier judges the result at 1e-4). Returns how many GEMMs it rewrote."""
    count = 0
    graph = gm.graph
    for h in list(graph.nodes):
        if h.op != "call_function" or h.target not in (aten.addmm.default, aten.mm.default):
            continue
        if h.target == aten.addmm.default:
            bias, x, wt = h.args[:3]
        else:
            bias, (x, wt) = None, h.args[:2]
        if not (isinstance(wt, torch.fx.Node) and wt.target in (aten.permute.default, aten.t.default)):
            continue
        W = wt.args[0]
        chain, cur = [], h
        while len(cur.users) == 1:
            u = next(iter(cur.users))
            if u.target in SCALAR_LINEAR and u.args[0] is cur and not isinstance(u.args[1], torch.fx.Node):
                chain.append(u)
                cur = u
                continue
            break
        if len(cur.users) != 1:
            continue
        s = next(iter(cur.users))
        if s.target not in (aten.sum.dim_IntList, aten.mean.dim) or s.args[0] is not cur:
            continue
        dims = s.args[1]
        dims = [dims] if isinstance(dims, int) else list(dims)
        if [d % 2 for d in dims] != [1]:
            continue
        keep = bool(s.args[2]) if len(s.args) > 2 else bool(s.kwargs.get("keepdim", False))
        N, K = _shape(x)
        M = _shape(W)[0]
        with graph.inserting_before(s):
            ws = _meta(graph.call_function(aten.sum.dim_IntList, (W, [0])), (K,))
            xw = _meta(graph.call_function(aten.mul.Tensor, (x, ws)), (N, K))
            acc = _meta(graph.call_function(aten.sum.dim_IntList, (xw, [1], True)), (N, 1))
            if bias is not None:
                bs = _meta(graph.call_function(aten.sum.dim_IntList, (bias, [0], True)), (1,))
                acc = _meta(graph.call_function(aten.add.Tensor, (acc, bs)), (N, 1))
            for c in chain:
                acc = _meta(graph.call_function(c.target, (acc, c.args[1])), (N, 1))
            if s.target == aten.mean.dim:
                acc = _meta(graph.call_function(aten.div.Tensor, (acc, float(M))), (N, 1))
            if not keep:
                acc = _meta(graph.call_function(aten.squeeze.dims, (acc, [1])), (N,))
        s.replace_all_uses_with(acc)
        for dead in [s, *reversed(chain), h]:
            graph.erase_node(dead)
        count += 1
    if count:
        graph.eliminate_dead_code()
        gm.recompile()
    return count


_SCALAR_USERS = set(_BINARY) | {aten.where.self}


def fold_scalar_constants(gm: torch.fx.GraphModule) -> int:
    """A one-element tensor constant of known value (`x * torch.tensor(2.0)`) becomes a Python scalar in the
    arguments of the pointwise ops that read it (through copies and views), so its literal is inlined into the
    kernel that computes them, epilogues included. Where an op has no tensor operand left, or the constant feeds
    anything else, the constant stays and is stored as a buffer. Returns how many uses it folded."""
    count = 0

    def fold(node, value) -> None:
        nonlocal count
        for u in list(node.users):
            if u.op != "call_function":
                continue
            if u.target in IDENTITY or u.target in VIEWS:
                fold(u, value)
            elif u.target in _SCALAR_USERS and not u.kwargs:
                first = 1 if u.target == aten.where.self else 0  # where's condition stays a tensor
                args = tuple(value if a is node and i >= first else a for i, a in enumerate(u.args))
                if any(isinstance(a, torch.fx.Node) for a in args):
                    u.args = args
                    count += 1

    for n in list(gm.graph.nodes):
        if n.op == "get_attr" and (v := constant_value(gm, n)) is not None and v.numel() == 1:
            fold(n, v.item())
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count


def fold_size1_reductions(gm: torch.fx.GraphModule) -> int:
    """A sum/mean/amax/amin/max/min whose reduced dims all have size 1 returns its input (with keepdim); such ops
    stay in KernelBench chains after an earlier reduction. Rewritten to the identity (max/min: their values)."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default,
                                                       aten.amin.default, aten.max.dim, aten.min.dim):
            continue
        x = n.args[0]
        L = _shape(x)
        dims = n.args[1] if len(n.args) > 1 else list(range(len(L)))
        dims = [dims] if isinstance(dims, int) else list(dims)
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        if not dims or any(L[d % len(L)] != 1 for d in dims) or not keep:
            continue
        if n.target in (aten.max.dim, aten.min.dim):
            gi = list(n.users)
            if any(u.target is not operator.getitem or u.args[1] != 0 for u in gi):
                continue
            for u in gi:
                u.replace_all_uses_with(x)
                gm.graph.erase_node(u)
        else:
            n.replace_all_uses_with(x)
        gm.graph.erase_node(n)
        count += 1
    if count:
        gm.recompile()
    return count


def cancel_self_subtraction(gm: torch.fx.GraphModule) -> int:
    """x - x = 0 for every finite x (KernelBench chains produce it: `x - x.mean(dim=1, keepdim=True)` after a
    reduction to size 1, once `fold_size1_reductions` made the mean x itself). The difference becomes a constant
    zero tensor and whatever only fed it (the GEMM) goes with dead-code elimination. Exact for finite values; where
    x is inf or NaN the reference gives NaN, and the verifier's draws judge that like any other output."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target == aten.sub.Tensor and n.args[0] is n.args[1] \
                and n.kwargs.get("alpha", 1) == 1:
            shape = list(_shape(n))
            with gm.graph.inserting_before(n):
                z = _meta(gm.graph.call_function(aten.full.default, (shape, 0.0)), tuple(shape))
            n.replace_all_uses_with(z)
            gm.graph.erase_node(n)
            count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count
