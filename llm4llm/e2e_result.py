"""The end-to-end measurement's fields, declared once: E2EResult, which llm4llm.evaluate fills while it measures
and the sandboxed child writes as a JSON line, and its frozen subclass llm4llm.stages.evaluate.E2ERow (plus the
GPU's name and the library versions), which the evaluate stage parses those lines into and storage writes as the
`e2e_results` columns. The field names are those columns: renaming one breaks stored rows. No torch here, so the
stages (which run evaluate in a child) read the fields without importing what measures them."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class E2EResult(BaseModel):
    """One variant's end-to-end measurements at one point. Mutable: the measuring code sets the ratios, the floor
    and the step time as it gets them; assignments are validated (a list of samples becomes a tuple), and an unknown
    field is an error."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    variant: str
    prefill_ms: float | None = None
    decode_ms_per_token: float | None = None
    total_ms: float | None = None
    tokens_per_s: float | None = None
    peak_mem_mb: float | None = None
    compile_s: float | None = None
    repeats: int = 0
    notes: str = ""
    total_samples_ms: tuple[float, ...] = ()  # every timed full run, in order (total_ms: their median)
    prefill_samples_ms: tuple[float, ...] = ()  # every timed one-token run (prefill_ms: their median)
    cpu_samples_ms: tuple[float, ...] = ()  # the main thread's CPU time of each timed full run
    # Ratios taken round by round (eager's run / this variant's run of the same round): median and p20-p80
    vs_eager: float | None = None
    vs_eager_p20: float | None = None
    vs_eager_p80: float | None = None
    vs_eager_cpu: float | None = None  # the same, on the main thread's CPU time of the full runs
    vs_eager_cpu_p20: float | None = None
    vs_eager_cpu_p80: float | None = None
    vs_compile: float | None = None
    vs_compile_p20: float | None = None
    vs_compile_p80: float | None = None
    # GPU time of one decode step (its CUDA graph replayed back to back; graph variants only), and the rest of
    # decode_ms_per_token: the host's share (generate's loop, dispatch) that no kernel removes
    gpu_step_ms: float | None = None
    host_overhead_ms: float | None = None
    # Decode-step floor: the model's weight bytes plus the KV cache a mean decode step of this batch reads, at the
    # copy bandwidth measured in this process
    hbm_floor_ms: float | None = None
    copy_gbps: float | None = None
    # The point measured (the workload's batch_size and prompt_len, or one of `evaluate --batch-sizes/--prompt-lens`)
    batch_size: int | None = None
    prompt_len: int | None = None
    # One decode step's ms in each timed round ((full run - prefill run) / steps): p20-p80 around
    # decode_ms_per_token; and the decode throughput, batch_size tokens a step
    decode_ms_p20: float | None = None
    decode_ms_p80: float | None = None
    decode_tokens_per_s: float | None = None

    def to_row(self) -> dict:
        """The fields as a dict, for json.dumps (the child's JSON line). Python mode, not JSON mode: an infinite or
        NaN ratio is written as json.dumps writes it, not turned into null."""
        return self.model_dump()
