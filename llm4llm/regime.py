"""The serving regime a workload may declare: the batch sizes and prompt and decode lengths a server will see.

```toml
[regime]
batch_sizes = {min = 1, max = 8}   # or a list: [1, 2, 4, 8]
prompt_lens = {min = 128, max = 2048}
decode_lens = [64]                 # optional; default: the workload's decode_len
padding = "left"                   # optional; default "none": every row of a batch is prompt_len long
```
The workload's own batch_size / prompt_len / decode_len are the representative point (profiled, timed, and what
acceptance measures end to end) and must lie inside the regime. Extraction also runs the regime's corners (every
combination of each axis's smallest and largest value, decoding the fewest tokens), so each task's captured cases
hold the corner shapes: the verifier checks candidates there, and the guards (llm4llm.patchspec.guard_for: each
dim's observed min..max) admit the box between them, nothing outside. A call outside falls back, is counted in the
patch report by reason, and the report suggests re-profiling over a wider regime.

Decode runs at batch buckets (kernels_runtime.buckets: a list axis's sizes, or 1, 2, 4, 8, 16, 32 inside a span and
its max), as serving engines capture decode graphs: extraction also runs each bucket that is not a corner (at the
shortest prompt), so every decode task is verified at each bucket, and its guard admits those batches only.

`padding = "left"` asks for padded batches, as serving code batches requests of different lengths for `generate`:
each row's prompt length is drawn (seeded) between the regime's shortest prompt and the batch's prompt_len, the
first row is prompt_len long, and the shorter rows are left-padded to it with zeros in the attention mask
(`row_prompt_lens`; the reference script examples/scripts/hf_generate.py builds its inputs from it). Tasks captured
from such batches carry the padding mask, so the verifier judges kernels on it.
"""
from __future__ import annotations

import random
from itertools import product
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator


class Span(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min: StrictInt = Field(gt=0)
    max: StrictInt = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> "Span":
        if self.min > self.max:
            raise ValueError(f"expected min <= max, got min {self.min} > max {self.max}")
        return self


Axis = Span | list[StrictInt]


def _lo_hi(axis: Axis) -> tuple[int, int]:
    if isinstance(axis, Span):
        return axis.min, axis.max
    return min(axis), max(axis)


class Regime(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_sizes: Axis
    prompt_lens: Axis
    decode_lens: Axis | None = None
    padding: Literal["none", "left"] = "none"

    @model_validator(mode="after")
    def _non_empty(self) -> "Regime":
        for name in ("batch_sizes", "prompt_lens", "decode_lens"):
            v = getattr(self, name)
            if isinstance(v, list) and (not v or min(v) < 1):
                raise ValueError(f"{name}: expected a non-empty list of sizes >= 1, got {v}")
        return self

    def contains(self, batch: int, prompt: int, decode: int | None = None) -> str | None:
        """None when the point lies inside, else which axis it leaves."""
        for name, value in (("batch_sizes", batch), ("prompt_lens", prompt), ("decode_lens", decode)):
            axis = getattr(self, name)
            if axis is None or value is None:
                continue
            lo, hi = _lo_hi(axis)
            if not lo <= value <= hi:
                return f"{name}: {value} outside {lo}..{hi}"
        return None

    def corners(self, decode_len: int) -> list[tuple[int, int, int]]:
        """(batch, prompt, decode) at every combination of each axis's extremes; each decodes the fewest tokens
        the regime declares (at least 2: one decode step is captured past the prompt's)."""
        dec = max(2, _lo_hi(self.decode_lens)[0] if self.decode_lens is not None else decode_len)
        return [(b, p, dec) for b, p in product(sorted(set(_lo_hi(self.batch_sizes))),
                                                sorted(set(_lo_hi(self.prompt_lens))))]

    def batch_buckets(self) -> tuple[int, ...]:
        """The decode batches a bundle over the regime verifies: a list axis's sizes, else the standard buckets
        inside the span and its max (kernels_runtime.buckets.buckets_within)."""
        from kernels_runtime.buckets import buckets_within

        if isinstance(self.batch_sizes, list):
            return tuple(sorted(set(self.batch_sizes)))
        return buckets_within(self.batch_sizes.min, self.batch_sizes.max)

    def points(self, decode_len: int) -> list[tuple[int, int, int]]:
        """The corners, then (bucket, shortest prompt, fewest tokens) for each bucket no corner runs."""
        corners = self.corners(decode_len)
        seen = {b for b, _, _ in corners}
        prompt, dec = corners[0][1], corners[0][2]
        return corners + [(b, prompt, dec) for b in self.batch_buckets() if b not in seen]

    def row_prompt_lens(self, batch: int, prompt_len: int, seed: int) -> list[int]:
        """Each row's prompt length in a batch padded to `prompt_len`: all prompt_len without padding; with
        `padding = "left"` the first row prompt_len and the others drawn (seeded) from the regime's shortest prompt
        (at most prompt_len) up to prompt_len: distinct and shorter than prompt_len while the span allows."""
        if self.padding == "none" or batch == 1:
            return [prompt_len] * batch
        lo = min(_lo_hi(self.prompt_lens)[0], prompt_len)
        rng, shorter = random.Random(seed), range(lo, prompt_len)
        if 0 < batch - 1 <= len(shorter):  # distinct lengths, each row padded, while the span allows
            return [prompt_len, *rng.sample(shorter, batch - 1)]
        return [prompt_len, *(rng.randint(lo, prompt_len) for _ in range(batch - 1))]
