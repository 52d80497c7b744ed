"""Host code of the norm templates: RMSNorm (Llama's, Gemma's 1 + weight, row-blocked, Mamba2's gated) and
LayerNorm, one op call each."""
from __future__ import annotations

from kernels_runtime.hosts import static_value
from kernels_runtime.ops.layernorm import layernorm as _layernorm
from kernels_runtime.ops.rmsnorm import gated_rmsnorm, rmsnorm, rmsnorm_rows

EPS_NAMES = ("variance_epsilon", "eps", "rms_norm_eps")


def rmsnorm_op(config: dict, x: str = "hidden_states", gemma: bool = False):
    warps = config["num_warps"]

    def entry(inputs, weights, state, static):
        eps = float(static_value(static, *EPS_NAMES))
        return {"out": rmsnorm(inputs[x], weights["weight"], eps, num_warps=warps, gemma=gemma)}
    return entry


def rmsnorm_rows_op(config: dict, x: str = "hidden_states"):
    rows, warps = config["ROWS"], config["num_warps"]

    def entry(inputs, weights, state, static):
        eps = float(static_value(static, *EPS_NAMES))
        return {"out": rmsnorm_rows(inputs[x], weights["weight"], eps, rows=rows, num_warps=warps)}
    return entry


def gated_rmsnorm_op(config: dict):
    rows, warps = config["ROWS"], config["num_warps"]

    def entry(inputs, weights, state, static):
        eps = float(static_value(static, *EPS_NAMES))
        return {"out": gated_rmsnorm(inputs["hidden_states"], inputs.get("gate"), weights["weight"], eps, rows=rows,
                                     num_warps=warps)}
    return entry


def layernorm_op(config: dict, x: str = "hidden_states"):
    rows, warps = config["ROWS"], config["num_warps"]

    def entry(inputs, weights, state, static):
        eps = float(static_value(static, "eps", *EPS_NAMES))
        return {"out": _layernorm(inputs[x], weights["weight"], weights.get("bias"), eps, rows=rows,
                                  num_warps=warps)}
    return entry
