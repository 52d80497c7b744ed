"""KernelBench templates for the built-in proposer: render a `ModelNew` from the problem's captured graph.

- `kb.fused_tail` (origin "template"): the heavy op on cuDNN/cuBLAS, every other op in generated Triton kernels
  (pointwise chains inlined into their consumer, reductions and pools as one kernel each, epilogues fused into the
  store of the kernel before them).
- `kb.rewrite_fused_tail` (origin "rewrite"): the same after exact algebraic rewrites of the graph (a GEMM summed
  over its features becomes a GEMV with column-summed weights; reductions over size-1 dims are dropped). Each
  rewrite is proved per problem by the verifier on the fp32 reference, like any candidate; it applies only where a
  rewrite fired.
- `kb.gemm_epilogue` (origin "template"): GEMM problems with the GEMM itself in Triton (fp32 inputs, grouped tile
  order; tiles, stages and the dot precision in the config space: IEEE FMA dots, or TF32x3, three TF32 tensor-core
  products whose error the verifier must find within KernelBench's 1e-4) and the pointwise sub-graph after it
  computed on the accumulator before the store; the rest as in `kb.fused_tail`.
- `kb.conv_epilogue` (origin "template"): the same for convolutions (groups 1; transposed ones split by output phase,
  not dilated): an implicit GEMM in Triton over [output channels, output positions] tiles, TF32x3 or IEEE dots, the
  pointwise tail on the accumulator.
The config space is the kernels' tiles and warps; the search explores it like any template's.
"""
from __future__ import annotations

import ast
import copy
import hashlib
import textwrap
from typing import Any

from llm4llm.kernelbench import codegen
from llm4llm.search.templates.base import Template
from llm4llm.taskspec import TaskSpec

_GRAPHS: dict[str, tuple] = {}


def _graph(spec: TaskSpec):
    src = spec.static["source"]
    key = hashlib.sha256(src.encode()).hexdigest()
    if key not in _GRAPHS:
        from llm4llm.kernelbench.problem import capture

        _GRAPHS[key] = capture(src)
    return _GRAPHS[key]


def build_plan(spec: TaskSpec, cfg: dict[str, Any], rewrite: bool) -> tuple[codegen.Plan, list[str]]:
    gm, names, n_in, in_shapes = _graph(spec)
    gm = copy.deepcopy(gm)
    gm.graph.eliminate_dead_code()  # unused statistics and indices (impure ops such as bernoulli_ stay)
    applied = []
    codegen.fold_scalar_constants(gm)  # before the rewrites: a folded scalar is a scaling they can move
    if rewrite:
        if codegen.rewrite_gemm_sum(gm):
            applied.append("gemm_sum_to_gemv")
    if codegen.fold_size1_reductions(gm):
        applied.append("size1_reductions_dropped")
    if rewrite and codegen.cancel_self_subtraction(gm):
        applied.append("x_minus_x_is_zero")
    return codegen.generate(gm, names, n_in, cfg), applied


def render_source(spec: TaskSpec, cfg: dict[str, Any], rewrite: bool) -> str:
    from llm4llm.kernelbench.problem import init_source

    plan, applied = build_plan(spec, cfg, rewrite)
    _, _, n_in, in_shapes = _graph(spec)
    args = ", ".join(f"x{i}" for i in range(n_in))
    checks = [f"        assert tuple(x{i}.shape) == {tuple(s)!r} and x{i}.is_contiguous(), "
              f"'ModelNew is specialised to the problem shape {tuple(s)}'" for i, s in enumerate(in_shapes)]
    doc = (f'"""ModelNew for {spec.static.get("problem", spec.task_id)}: heavy ops {plan.heavy or ["none"]} on '
           f'cuDNN/cuBLAS, then Triton kernels {plan.kinds}; rewrites {applied or ["none"]}; config {cfg}."""')
    body = ["        " + line for line in plan.lines]
    return "\n".join([doc, "import torch", "import torch.nn as nn", "import triton", "import triton.language as tl",
                      codegen.HELPERS, *plan.kernels, "", "", "class ModelNew(nn.Module):",
                      _extend_init(init_source(spec.static["source"]), plan.init), "",
                      f"    def forward(self, {args}):", *checks, *body, ""])


def _extend_init(init: str, lines: list[str]) -> str:
    """The problem's `__init__` (source text) with `lines` appended at its body's indentation."""
    if not lines:
        return init
    fn = ast.parse(textwrap.dedent(init)).body[0]
    first = init.splitlines()[fn.body[0].lineno - 1]
    pad = first[:len(first) - len(first.lstrip())]
    return "\n".join([init.rstrip("\n"), *(pad + line for line in lines)])


def _space(spec: TaskSpec) -> dict[str, list]:
    return {"BLOCK": [1024, 512, 2048], "POOL_BLOCK": [256, 128, 512], "BLOCK_R": [1024, 256, 2048, 4096],
            "ROWS": [1, 2, 4, 8], "num_warps": [4, 8, 2], "epilogue": [True, False], "acc64": [True, False],
            "RSPLIT": [0, 1]}  # 0: a few long rows split over several programs each; 1: one program a row


def _gemm_space(spec: TaskSpec) -> dict[str, list]:
    # tf32x3 first (the default): the IEEE-dot GEMM ran at 0.40-0.50x of cuBLAS's fp32 GEMM on all 17 GEMM problems
    # that tried it; the verifier holds TF32x3 to KernelBench's 1e-4 like any candidate
    return {**_space(spec), "gemm": ["triton"], "BM": [128, 64], "BN": [128, 64, 256], "BK": [32, 16],
            "gemm_warps": [8, 4], "gemm_stages": [3, 4], "gemm_precision": ["tf32x3", "ieee"]}


def _conv_channels(spec: TaskSpec) -> tuple[int, int, bool]:
    """(input, output) channels of the problem's widest convolution, and whether any convolution is transposed."""
    gm = _graph(spec)[0]
    convs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == codegen.aten.convolution.default]
    return (max((codegen._shape(n.args[0])[1] for n in convs), default=0),
            max((codegen._shape(n)[1] for n in convs), default=0), any(bool(n.args[6]) for n in convs))


def _conv_space(spec: TaskSpec) -> dict[str, list]:
    """tf32x3 first, as for the GEMM. With 16 input channels or more the channels-last kernel first: its loads run
    16 bytes wide along channels, where the NC* kernel gathers 4 bytes at a time (its sweep
    lost to cuDNN on every 2-D conv, and won only on two strided 3-D transposed
    ones). Its first tile, 64
    output channels x 128 positions with 4 warps, was the best or within 3 % of the best of the sweep on 12 of the
    13 such problems swept (problem 54: 4.5 % behind a 128 x 256 tile); the GEMM template's 128 x 128 tile with 8
    warps, the default of the full run there, took 0.98-1.45x its time. With fewer (3-8 input
    channels) the NC* kernel, whose K loop runs over channels x taps together: there it beat cuDNN (problem 6: 2.7x
    eager), with 4 warps and 32-deep K steps up to 32 output channels. With 4-12 input channels (a multiple of 4)
    and no transposed conv, channels last with the K loop flattened over (tap, channel) first, the channels-last
    tile: the NC* kernel lost to cuDNN with the fused tail on each such problem (8, 90, 92 in the sweeps, 82 in the
    run), and the flattened loop keeps 16-byte loads (PTX for sm_90: `cp.async.cg` 16); it has not run on a GPU yet."""
    ci, co, transposed = _conv_channels(spec)
    cl_tiles = {"BCO": [64, 128], "BP": [128, 64, 256], "CK": [32, 16], "conv_warps": [4, 8], "conv_stages": [3, 4],
                "conv_precision": ["tf32x3", "ieee"]}
    if ci >= 16:
        return {**_space(spec), "conv": ["triton"], "conv_layout": ["cl", "nc"], **cl_tiles}
    if ci >= 4 and ci % 4 == 0 and not transposed:
        return {**_space(spec), "conv": ["triton"], "conv_layout": ["clk", "nc", "cl"], **cl_tiles}
    small = co <= 32
    return {**_space(spec), "conv": ["triton"], "conv_layout": ["nc", "cl"], "BCO": [128, 64], "BP": [128, 64, 256],
            "CK": [32, 16] if small else [16, 32], "conv_warps": [4, 8] if small else [8, 4],
            "conv_stages": [3, 4] if small else [4, 3], "conv_precision": ["tf32x3", "ieee"]}


def _applies(rewrite: bool, space=_space, needs_gemm: bool = False, needs_conv: bool = False):
    def why_not(spec: TaskSpec) -> str | None:
        if spec.family != "kernelbench":
            return "not a KernelBench task"
        try:
            plan, applied = build_plan(spec, {k: v[0] for k, v in space(spec).items()}, rewrite)
        except codegen.Unsupported as e:
            return f"graph not covered: {e}"
        if rewrite and not {"gemm_sum_to_gemv", "x_minus_x_is_zero"} & set(applied):
            return "no exact rewrite applies"
        if needs_gemm and not any(h.startswith("triton_gemm_") for h in plan.heavy):
            return "no GEMM (addmm/mm) in the graph"
        if needs_conv and not any(h.startswith("triton_conv") for h in plan.heavy):
            return "no convolution the Triton implicit GEMM takes (groups 1; a transposed one not dilated)"
        return None
    return why_not


def _render(rewrite: bool):
    return lambda spec, cfg: render_source(spec, cfg, rewrite)


TEMPLATES = [
    Template(name="kb.rewrite_fused_tail", family="kernelbench", phases=("forward",), requires=(),
             space_fn=_space, render_fn=_render(True), applies_fn=_applies(True)),
    Template(name="kb.fused_tail", family="kernelbench", phases=("forward",), requires=(),
             space_fn=_space, render_fn=_render(False), applies_fn=_applies(False)),
    Template(name="kb.gemm_epilogue", family="kernelbench", phases=("forward",), requires=(),
             space_fn=_gemm_space, render_fn=_render(False), applies_fn=_applies(False, _gemm_space, True)),
    Template(name="kb.conv_epilogue", family="kernelbench", phases=("forward",), requires=(),
             space_fn=_conv_space, render_fn=_render(False),
             applies_fn=_applies(False, _conv_space, needs_conv=True)),
]
ORIGIN = {"kb.fused_tail": "template", "kb.rewrite_fused_tail": "rewrite", "kb.gemm_epilogue": "template",
          "kb.conv_epilogue": "template"}


def origin_of(template: str, proposer: str) -> str:
    """Where a candidate came from, as migration 007 records it: template, rewrite or llm."""
    if template in ORIGIN:
        return ORIGIN[template]
    return "llm" if proposer.startswith("llm") or not template else "template"
