"""The linear-projection part of a template's config space (kernels_runtime.ops.linear), by phase and dtype."""
from __future__ import annotations

from llm4llm.taskspec import TaskSpec

LINEAR_OP = ("kernels_runtime.ops.linear", "linear")

# Prefill: the tl.dot path. Decode: M = batch <= 16, the GEMV path (the dot-path keys would be ignored there).
PREFILL = {"lin_BLOCK_M": [32, 64, 128], "lin_BLOCK_N": [32, 64, 128], "lin_BLOCK_K": [32, 64],
           "lin_num_warps": [2, 4, 8], "lin_num_stages": [2, 3, 4]}
DECODE = {"lin_GEMV_BLOCK_N": [16, 32, 64, 128], "lin_GEMV_BLOCK_K": [32, 64, 128, 256], "lin_num_warps": [1, 2, 4, 8],
          "lin_num_stages": [1, 2, 3], "lin_GEMV_SPLIT_K": [1, 2, 4, 8]}
PREFILL_DEFAULT = {"lin_BLOCK_M": 64, "lin_BLOCK_N": 64, "lin_BLOCK_K": 32, "lin_num_warps": 4, "lin_num_stages": 3}
DECODE_DEFAULT = {"lin_GEMV_BLOCK_N": 64, "lin_GEMV_BLOCK_K": 64, "lin_num_warps": 4, "lin_num_stages": 2}

# Pasted into rendered sources: the linear kwargs from CONFIG's lin_* keys.
LIN_KWARGS = "LIN = {k[4:]: v for k, v in CONFIG.items() if k.startswith('lin_')}\n"


def linear_space(spec: TaskSpec) -> dict[str, list]:
    space = dict(DECODE if spec.phase == "decode" else PREFILL)
    if spec.dtype in ("float32", "torch.float32") and spec.phase != "decode":
        space["lin_TF32"] = [False, True]  # TF32 dots are faster and miss the fp32 tolerance: learnable
    return space


def linear_default(spec: TaskSpec) -> dict:
    return dict(DECODE_DEFAULT if spec.phase == "decode" else PREFILL_DEFAULT)
