"""GELU MLP `fc2(gelu(fc1(x)))` with optional biases: GPTNeoXMLP, PhiMLP, GPTJMLP, FalconMLP, GPT-2-like MLPs.

No kernel of its own: two launches of kernels_runtime.ops.linear, the GELU fused into the up projection's epilogue
(erf or tanh approximation). Numerics follow HF's op boundaries: the up projection plus bias is rounded to x's dtype
(nn.Linear's output) before the activation, the activation is computed in fp32 and rounded, the down projection
accumulates in fp32 and rounds once. HF's NewGELUActivation evaluates its tanh formula op by op in x's dtype; here
it is the same formula in fp32, rounded once (closer to the exact value, not bitwise HF's in 16-bit dtypes).
"""
from __future__ import annotations

import torch

from kernels_runtime.ops.linear import linear

# torch.nn.functional.gelu's `approximate` -> the linear op's epilogue
EPILOGUE = {"none": "gelu", "tanh": "gelu_tanh"}


def gelu_mlp_ref(x: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor | None, w_down: torch.Tensor,
                 b_down: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """x: [..., H], w_up: [I, H], b_up: [I], w_down: [H, I], b_down: [H] -> [..., H], in x's dtype, op by op as HF
    computes it (pass float64 tensors for the exact value)."""
    h = torch.nn.functional.linear(x, w_up, b_up)  # [..., I]
    h = torch.nn.functional.gelu(h, approximate=approximate)
    return torch.nn.functional.linear(h, w_down, b_down)  # [..., H]


def gelu_mlp(x: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor | None, w_down: torch.Tensor,
             b_down: torch.Tensor | None, approximate: str = "none", **lin) -> torch.Tensor:
    """x: [..., H], w_up: [I, H], b_up: [I] or None, w_down: [H, I], b_down: [H] or None (nn.Linear layout; any
    strides, so a Conv1D weight [in, out] passes as its `.T` view) -> [..., H] in x's dtype. `approximate` in
    "none" | "tanh" as for torch.nn.functional.gelu; `lin`: the linear op's config keys, for both projections."""
    if approximate not in EPILOGUE:
        raise ValueError(f"gelu_mlp: expected approximate in {list(EPILOGUE)}, got {approximate!r}")
    H = x.shape[-1]
    if w_up.dim() != 2 or w_up.shape[1] != H or w_down.dim() != 2 or tuple(w_down.shape) != (H, w_up.shape[0]):
        raise ValueError(f"gelu_mlp: expected w_up [I, {H}] and w_down [{H}, I], got {tuple(w_up.shape)}, "
                         f"{tuple(w_down.shape)}")
    for name, b, n in (("b_up", b_up, w_up.shape[0]), ("b_down", b_down, H)):
        if b is not None and tuple(b.shape) != (n,):
            raise ValueError(f"gelu_mlp: expected {name} [{n}], got {tuple(b.shape)}")
    h = linear(x, w_up, b_up, EPILOGUE[approximate], round_pre=True, **lin)  # [..., I]
    return linear(h, w_down, b_down, **lin)  # [..., H]
