"""Plain records passed between profiling, extraction and storage (no torch objects inside)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class ModuleRecord:
    """One module instance's inclusive time in one phase."""

    module_path: str  # "model.layers.3.self_attn" ("" is the top-level model)
    class_name: str  # "Qwen3Attention"
    family: str  # attention | mlp | norm | ssm_mixer | ssm_block | recurrent_block | ... (kernels_runtime.families)
    phase: str  # prefill | decode
    calls: int
    time_ms: float  # inclusive, summed over calls in this phase
    share: float = 0.0  # time_ms / phase time
    hotspot_score: float = 0.0  # share x phase weight
    depth: int = 0
    in_shapes: list[str] = field(default_factory=list)  # distinct "[1, 16, 64]:float32|..." signatures
    out_shapes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class PhaseInfo:
    phase: str
    forwards: int  # top-level forward calls in this phase
    time_ms: float
    weight: float  # share of the workload used for hotspot scores


@dataclass
class ProfileResult:
    phases: dict[str, PhaseInfo]
    records: list[ModuleRecord]
    hardware: dict  # {"device": "cpu"|"cuda", "gpu_name": ..., "capability": "9.0", "torch": ..., "triton": ...}
    timer: str  # "cuda_events" | "perf_counter"

    def ranked(self) -> list[ModuleRecord]:
        return sorted(self.records, key=lambda r: r.hotspot_score, reverse=True)
