"""Candidate from template norm.rmsnorm_gemma for a norm/decode task (bfloat16)."""
import torch
import triton
import triton.language as tl
from kernels_runtime.ops.rmsnorm import rmsnorm

CONFIG = {'num_warps': 8}

def _static(static, *names):
    for n in names:
        if n in static:
            return static[n]
    raise KeyError(f"static: expected one of {names}, got {sorted(static)}")


def entry(inputs, weights, state, static):
    eps = float(_static(static, "variance_epsilon", "eps", "rms_norm_eps"))
    return {"out": rmsnorm(inputs["x"], weights["weight"], eps, num_warps=CONFIG["num_warps"], gemma=True)}
