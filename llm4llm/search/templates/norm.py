"""norm family: LayerNorm with or without bias (torch.nn.LayerNorm: GPT-NeoX, Phi, StableLM, GPT-J), Llama-style
RMSNorm (`weight * normed.to(input dtype)`) over the last dim, and Mamba2's gated
RMSNorm (`MambaRMSNormGated`: `weight * rmsnorm(x * silu(gate)).to(input dtype)`, normalised over the whole last dim,
as HF 5.17 does)."""
from __future__ import annotations

from llm4llm.search.templates.base import Template, header, short_class
from llm4llm.taskspec import TaskSpec

EPS_NAMES = '"variance_epsilon", "eps", "rms_norm_eps"'


def _applies(spec: TaskSpec) -> str | None:
    if "Gemma" in short_class(spec):
        return "norm: Gemma-style RMSNorm scales by (1 + weight); not this template's numerics"
    if spec.input_names != ["hidden_states"] or spec.weight_names != ["weight"]:
        return f"norm: expected inputs ['hidden_states'] and weights ['weight'], got {spec.input_names}, " \
               f"{spec.weight_names} (gated norms are out of scope)"
    return None


def _applies_gemma(spec: TaskSpec) -> str | None:
    if "Gemma" not in short_class(spec):
        return f"norm.rmsnorm_gemma: written for Gemma-style RMSNorm (1 + weight), not {short_class(spec)}"
    if len(spec.input_names) != 1 or spec.weight_names != ["weight"]:
        return f"norm.rmsnorm_gemma: expected one input and weights ['weight'], got {spec.input_names}, " \
               f"{spec.weight_names}"
    return None


def _render_gemma(spec: TaskSpec, config: dict) -> str:
    x = spec.input_names[0]
    return header("norm.rmsnorm_gemma", spec, ["from kernels_runtime.ops.rmsnorm import rmsnorm"], config) + f'''

def entry(inputs, weights, state, static):
    eps = float(_static(static, {EPS_NAMES}))
    return {{"out": rmsnorm(inputs["{x}"], weights["weight"], eps, num_warps=CONFIG["num_warps"], gemma=True)}}
'''


def _render_op(spec: TaskSpec, config: dict) -> str:
    return header("norm.rmsnorm_op", spec, ["from kernels_runtime.ops.rmsnorm import rmsnorm"], config) + f'''

def entry(inputs, weights, state, static):
    eps = float(_static(static, {EPS_NAMES}))
    return {{"out": rmsnorm(inputs["hidden_states"], weights["weight"], eps, num_warps=CONFIG["num_warps"])}}
'''


def _render_rows(spec: TaskSpec, config: dict) -> str:
    return header("norm.rmsnorm_rows", spec, [], config) + f'''

@triton.jit
def _rmsnorm_rows_kernel(X, W, Y, n_rows, N, eps, stride_x, stride_y,
                         ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # ROWS rows per program: small hidden sizes (and decode's few rows) need fewer, fuller programs
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)  # [ROWS, BLOCK_N]
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)  # [ROWS]
    xn = (xf * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], (w[None, :] * xn).to(Y.dtype.element_ty), mask=mask)


def entry(inputs, weights, state, static):
    x, w = inputs["hidden_states"], weights["weight"]
    eps = float(_static(static, {EPS_NAMES}))
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = x.dtype if x.dtype == w.dtype else torch.float32  # torch.promote_types for float pairs
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    y2 = y.view(-1, n)
    rows = CONFIG["ROWS"]
    if x2.shape[0] > 0:
        _rmsnorm_rows_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, w, y2, x2.shape[0], n, eps, x2.stride(0), y2.stride(0),
            ROWS=rows, BLOCK_N=triton.next_power_of_2(n), num_warps=CONFIG["num_warps"])
    return {{"out": y}}
'''


def _applies_gated(spec: TaskSpec) -> str | None:
    if spec.input_names not in (["hidden_states", "gate"], ["hidden_states"]) or spec.weight_names != ["weight"]:
        return f"norm.rmsnorm_gated: expected inputs ['hidden_states', 'gate'] and weights ['weight'], got " \
               f"{spec.input_names}, {spec.weight_names}"
    if "Gated" not in short_class(spec):
        return f"norm.rmsnorm_gated: written for MambaRMSNormGated, not {short_class(spec)}"
    return None


def _render_gated(spec: TaskSpec, config: dict) -> str:
    return header("norm.rmsnorm_gated", spec, ["from kernels_runtime.ops.selective_scan import _rnd"], config) + f'''
_TLD = {{torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}}


@triton.jit
def _gated_rmsnorm_kernel(X, Z, W, Y, n_rows, N, eps, stride_x, stride_z, stride_y,
                          HAS_Z: tl.constexpr, IN_DTYPE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # h = x * silu(gate) in fp32; y = w * (h * rsqrt(mean(h^2) + eps)).to(x.dtype)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(Z + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = h * (z * tl.sigmoid(z))
    rstd = tl.rsqrt(tl.sum(h * h, axis=1) / N + eps)  # [ROWS]
    hn = _rnd(h * rstd[:, None], IN_DTYPE)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], (w[None, :] * hn).to(Y.dtype.element_ty), mask=mask)


def _rows2d(t, n):
    t2 = t.reshape(-1, n)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def entry(inputs, weights, state, static):
    x, w, z = inputs["hidden_states"], weights["weight"], inputs.get("gate")
    eps = float(_static(static, {EPS_NAMES}))
    n = x.shape[-1]
    x2 = _rows2d(x, n)
    z2 = _rows2d(z, n) if z is not None else x2
    out_dtype = x.dtype if x.dtype == w.dtype else torch.float32  # torch.promote_types for float pairs
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    y2 = y.view(-1, n)
    rows = CONFIG["ROWS"]
    if x2.shape[0] > 0:
        _gated_rmsnorm_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, z2, w, y2, x2.shape[0], n, eps, x2.stride(0), z2.stride(0), y2.stride(0), HAS_Z=z is not None,
            IN_DTYPE=_TLD[x.dtype], ROWS=rows, BLOCK_N=triton.next_power_of_2(n), num_warps=CONFIG["num_warps"])
    return {{"out": y}}
'''


def _applies_layernorm(spec: TaskSpec) -> str | None:
    if len(spec.input_names) != 1 or spec.weight_names not in (["weight", "bias"], ["weight"]):
        return f"norm.layernorm: expected one input and weights ['weight'(, 'bias')], got {spec.input_names}, " \
               f"{spec.weight_names}"
    shape = spec.static.get("normalized_shape")
    if not isinstance(shape, list) or len(shape) != 1:
        return f"norm.layernorm: expected a normalized_shape over the last dim, got {shape!r}"
    return None


def _render_layernorm(spec: TaskSpec, config: dict) -> str:
    x = spec.input_names[0]
    return header("norm.layernorm", spec, [], config) + f'''

@triton.jit
def _layernorm_rows_kernel(X, W, B, Y, n_rows, N, eps, stride_x, stride_y,
                           HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # torch's layer_norm: mean and biased variance in fp32, (x - mean) * rstd * w + b, one rounding at the store
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N  # [ROWS]
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
    y = xc * rstd[:, None] * tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def entry(inputs, weights, state, static):
    x, w, b = inputs["{x}"], weights["weight"], weights.get("bias")
    eps = float(_static(static, "eps", {EPS_NAMES}))
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, n)
    rows = CONFIG["ROWS"]
    if x2.shape[0] > 0:
        _layernorm_rows_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, w, b if b is not None else w, y2, x2.shape[0], n, eps, x2.stride(0), y2.stride(0),
            HAS_BIAS=b is not None, ROWS=rows, BLOCK_N=triton.next_power_of_2(n), num_warps=CONFIG["num_warps"])
    return {{"out": y}}
'''


TEMPLATES = [
    Template(name="norm.layernorm", family="norm", phases=("prefill", "decode"), requires=(),
             space_fn=lambda spec: {"ROWS": [1, 2, 4, 8, 16], "num_warps": [1, 2, 4, 8]},
             render_fn=_render_layernorm, applies_fn=_applies_layernorm,
             default_fn=lambda spec: {"ROWS": 4, "num_warps": 4}),
    Template(name="norm.rmsnorm_op", family="norm", phases=("prefill", "decode"),
             requires=(("kernels_runtime.ops.rmsnorm", "rmsnorm"),),
             space_fn=lambda spec: {"num_warps": [1, 2, 4, 8, 16]}, render_fn=_render_op, applies_fn=_applies,
             default_fn=lambda spec: {"num_warps": 4}),
    Template(name="norm.rmsnorm_gemma", family="norm", phases=("prefill", "decode"),
             requires=(("kernels_runtime.ops.rmsnorm", "rmsnorm_gemma_ref"),),
             space_fn=lambda spec: {"num_warps": [1, 2, 4, 8, 16]}, render_fn=_render_gemma,
             applies_fn=_applies_gemma, default_fn=lambda spec: {"num_warps": 4}),
    Template(name="norm.rmsnorm_rows", family="norm", phases=("prefill", "decode"), requires=(),
             space_fn=lambda spec: {"ROWS": [1, 2, 4, 8, 16], "num_warps": [1, 2, 4, 8]}, render_fn=_render_rows,
             applies_fn=_applies, default_fn=lambda spec: {"ROWS": 4, "num_warps": 4}),
    Template(name="norm.rmsnorm_gated", family="norm", phases=("prefill", "decode"),
             requires=(("kernels_runtime.ops.selective_scan", "_rnd"),),
             space_fn=lambda spec: {"ROWS": [1, 2, 4, 8, 16], "num_warps": [1, 2, 4, 8]}, render_fn=_render_gated,
             applies_fn=_applies_gated, default_fn=lambda spec: {"ROWS": 4, "num_warps": 4}),
]
