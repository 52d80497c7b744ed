"""The linear-projection part of a template's config space (kernels_runtime.ops.linear), by phase and dtype."""
from __future__ import annotations

from kernels_runtime.hardware import TARGET
from llm4llm.taskspec import TaskSpec

LINEAR_OP = ("kernels_runtime.ops.linear", "linear")

# Prefill: the tl.dot path. Decode: M = batch <= 16, the GEMV path (the dot-path keys would be ignored there).
PREFILL = {"lin_BLOCK_M": [32, 64, 128], "lin_BLOCK_N": [32, 64, 128], "lin_BLOCK_K": [32, 64],
           "lin_num_warps": [2, 4, 8], "lin_num_stages": [2, 3, 4]}
DECODE = {"lin_GEMV_BLOCK_N": [16, 32, 64, 128], "lin_GEMV_BLOCK_K": [32, 64, 128, 256], "lin_num_warps": [1, 2, 4, 8],
          "lin_num_stages": [1, 2, 3], "lin_GEMV_SPLIT_K": [1, 2, 4, 8]}
PREFILL_DEFAULT = {"lin_BLOCK_M": 64, "lin_BLOCK_N": 64, "lin_BLOCK_K": 32, "lin_num_warps": 4, "lin_num_stages": 3}
DECODE_DEFAULT = {"lin_GEMV_BLOCK_N": 64, "lin_GEMV_BLOCK_K": 64, "lin_num_warps": 4, "lin_num_stages": 2}


def linear_space(spec: TaskSpec) -> dict[str, list]:
    space = dict(DECODE if spec.phase == "decode" else PREFILL)
    if spec.dtype in ("float32", "torch.float32") and spec.phase != "decode":
        space["lin_TF32"] = [False, True]  # TF32 dots are faster and miss the fp32 tolerance: learnable
    return space


def linear_default(spec: TaskSpec) -> dict:
    return dict(DECODE_DEFAULT if spec.phase == "decode" else PREFILL_DEFAULT)


SMS_DEFAULT = TARGET.sm_count  # for task specs profiled without an SM count (a CPU profile)


def sm_count(spec: TaskSpec) -> int:
    """The SM count of the GPU the task was profiled on (profiler.hardware_info), else SMS_DEFAULT."""
    return int(spec.hardware.get("sm_count") or SMS_DEFAULT)


def gemv_occupancy(n: int, sms: int = SMS_DEFAULT) -> dict:
    """Decode GEMV keys that give an [*, K] x [K, n] projection at least one program per SM: 32-wide column blocks
    and K split in 1, 2, 4 or 8 until cdiv(n, 32) x split >= sms (the op never splits finer than one 128-deep K
    tile a program), 8 warps, no pipelining. A seed, because a local search from an unsplit default that leaves
    most SMs idle (mamba-130m's n = 768: 48 programs on 132 SMs) stays in that default's neighbourhood."""
    return {"lin_GEMV_BLOCK_N": 32, "lin_GEMV_BLOCK_K": 128, "lin_num_warps": 8, "lin_num_stages": 1,
            "lin_GEMV_SPLIT_K": occupancy_split(n, sms, 32)}


def occupancy_split(n: int, sms: int, block_n: int, k_tiles: int | None = None) -> int:
    """The smallest K split in 1, 2, 4, 8 that gives a GEMV of n outputs in block_n-wide column blocks at least one
    program per SM, never more splits than the K tiles there are (k_tiles, when given)."""
    blocks = -(-n // block_n)
    return next((s for s in (1, 2, 4, 8) if blocks * s >= sms or (k_tiles is not None and s >= k_tiles)), 8)


def occupancy_seeds(default_fn, output: str = "out", extras: tuple = ()):
    """seeds_fn of a decode template whose largest launch is a GEMV writing `output`: its default with the GEMV
    keys of `gemv_occupancy` for that output's width on the task's GPU (SM count from the profile's hardware); then,
    for each of `extras` (spec, sms) -> dict of further keys (or None), that seed with those keys too."""

    def seeds(spec: TaskSpec) -> list[dict]:
        sig = next((c.outputs.get(output) for c in spec.cases if c.outputs.get(output)), None)
        if spec.phase != "decode" or sig is None or not sig.shape:
            return []
        sms = sm_count(spec)
        base = {**default_fn(spec), **gemv_occupancy(int(sig.shape[-1]), sms)}
        more = [extra(spec, sms) for extra in extras]
        return [base] + [{**base, **m} for m in more if m]

    return seeds


def programs_block(width: int, blocks: list[int], sms: int = SMS_DEFAULT) -> int:
    """The largest of `blocks` (ascending) that cuts `width` into at least `sms` programs, else the smallest."""
    fits = [b for b in blocks if -(-width // b) >= sms]
    return fits[-1] if fits else blocks[0]


def sm90_capable(spec: TaskSpec) -> bool:
    """Whether the task's GPU is sm_90+ (TMA, programmatic dependent launch): on a task profiled on an older GPU the
    search never tries them. A CPU task may (the interpreter runs those kernels, the sm_90 compile check builds
    them)."""
    cap = spec.hardware.get("capability")
    try:
        return cap is None or int(str(cap).split(".")[0]) >= 9
    except ValueError:
        return False


def task_rows(spec: TaskSpec) -> int:
    """The most rows (tokens: batch x new positions) a captured case feeds the task's first input."""
    name = spec.input_names[0] if spec.input_names else None
    return max((_prod(c.inputs[name].shape[:-1]) for c in spec.cases if name in c.inputs), default=1)


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out
