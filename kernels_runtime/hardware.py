"""The GPUs the project tunes for, in one table: what the heuristics and gates need of a GPU (SM count, compute
capability, peak DRAM bandwidth), and the rule for a GPU the table does not name. docs/hardware.md gives each
number's source and the copy bandwidths measured on these GPUs.

Lookup: a device name matches a row whose `name` it contains (case-insensitive, the most specific row first); else
the first row of the same compute capability; else `TARGET`, the GPU a task profiled without hardware details (a CPU
run) is tuned for. Imports nothing but the standard library, so flows and storage can use it without CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str  # a substring of torch.cuda.get_device_name(), e.g. "H100 PCIe"
    capability: tuple[int, int]
    sm_count: int
    hbm_peak_gbps: float  # the datasheet's peak DRAM bandwidth, GB/s (1e9 bytes)

    @property
    def arch(self) -> int:
        """The capability as Triton's compile target names it: (9, 0) -> 90."""
        return self.capability[0] * 10 + self.capability[1]


# Most specific names first: "H100 PCIe" must win over "H100".
GPUS: tuple[GPU, ...] = (
    GPU("H200", (9, 0), 132, 4800.0),
    GPU("H100 PCIe", (9, 0), 114, 2000.0),
    GPU("H100", (9, 0), 132, 3350.0),  # SXM5 (HBM3)
    GPU("A100-SXM4-80GB", (8, 0), 108, 2039.0),
    GPU("A100", (8, 0), 108, 1555.0),  # 40 GB
)
TARGET = GPUS[0]

# Split heuristics aim for about this many waves of programs over the GPU's SMs.
WAVES = 2


def lookup(name: str | None = None, capability: tuple[int, int] | str | None = None) -> GPU:
    """The table's row for a device (see the module docstring for the rule). `capability` may be "9.0" as the
    profiler records it."""
    if name:
        low = name.lower()
        row = next((g for g in GPUS if g.name.lower() in low), None)
        if row is not None:
            return row
    cap = _capability(capability)
    return next((g for g in GPUS if g.capability == cap), TARGET) if cap else TARGET


def _capability(value: tuple[int, int] | str | None) -> tuple[int, int] | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        major, _, minor = value.partition(".")
        if not (major.isdigit() and (minor or "0").isdigit()):
            raise ValueError(f"capability: expected 'MAJOR.MINOR' such as '9.0', got {value!r}")
        return int(major), int(minor or 0)
    return int(value[0]), int(value[1])


def target_programs(sm_count: int = TARGET.sm_count) -> int:
    """How many programs a split launch aims for: WAVES waves over the SMs."""
    return WAVES * sm_count


__all__ = ["GPU", "GPUS", "TARGET", "WAVES", "lookup", "target_programs"]
