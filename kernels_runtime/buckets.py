"""Decode batch buckets: the batch sizes a bundle verified, and the only ones its decode kernels take.

Serving engines capture decode graphs at a few batch sizes (1, 2, 4, 8, 16, 32) and pad a batch to the next one;
a bundle over a serving regime does the same. Extraction runs each bucket of the regime (llm4llm/regime.py), so every
decode task's cases hold them and the verifier checks each; the guard of a decode patch admits those batches only
(Guard.batch_buckets, guards.check_batch), so one graph per bucket covers the regime. `generate` pads a batch to its
bucket with copies of its last sequence (whole extra rows: a decoder's rows never mix, so the padding needs no mask
and the real rows' results are the unpadded ones) and hands back the real rows. A batch past the largest bucket
runs as it came: the patched modules' guards send it to the original forwards and count it, and so does this
wrapper. The bucket choice and the padding are pure functions, tested on the CPU; a GPU shows the graphs' gain.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)  # the serving engines' usual decode-graph sizes
_ATTR = "_llm4llm_batch_buckets"  # on the model: the BucketedGenerate wrapping its generate


def buckets_within(lo: int, hi: int) -> tuple[int, ...]:
    """The buckets a regime of batches lo..hi verifies: BATCH_BUCKETS inside it, and hi itself (a batch up to the
    regime's largest pads no further than it)."""
    if not 1 <= lo <= hi:
        raise ValueError(f"buckets_within: expected 1 <= lo <= hi, got {lo}..{hi}")
    inside = [b for b in BATCH_BUCKETS if lo <= b <= hi]
    return tuple(inside + ([hi] if hi not in inside else []))


def bucket_for(batch: int, buckets: tuple[int, ...] | list[int]) -> int | None:
    """The smallest bucket that holds `batch` rows, None when none does (a batch past the largest)."""
    return min((b for b in buckets if b >= batch), default=None) if batch >= 1 else None


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t: [B, ...] -> [rows, ...], rows >= B, the last row repeated."""
    if rows < t.shape[0]:
        raise ValueError(f"pad_rows: expected rows >= {t.shape[0]}, got {rows}")
    if rows == t.shape[0]:
        return t
    return torch.cat([t, t[-1:].expand(rows - t.shape[0], *t.shape[1:])])


def pad_batch(kwargs: dict[str, Any], batch: int, rows: int) -> dict[str, Any]:
    """Every tensor argument with `batch` leading rows padded to `rows` (pad_rows); the rest as given."""
    return {k: pad_rows(v, rows) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == batch else v
            for k, v in kwargs.items()}


def unpad(out: Any, batch: int, rows: int) -> Any:
    """The first `batch` rows of every tensor with `rows` leading rows, through dicts (generate's ModelOutput),
    tuples and lists (its per-step scores); other values as they are."""
    if rows == batch:
        return out
    if isinstance(out, torch.Tensor):
        return out[:batch] if out.dim() and out.shape[0] == rows else out
    if hasattr(out, "keys") and hasattr(out, "values"):
        return type(out)(**{k: unpad(v, batch, rows) for k, v in out.items()})
    if isinstance(out, (tuple, list)):
        return type(out)(unpad(v, batch, rows) for v in out)
    return out


def batch_of(args: tuple, kwargs: dict) -> int | None:
    """generate's batch: the rows of input_ids (or inputs_embeds), None when it has neither."""
    ids = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("input_ids")
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    return int(ids.shape[0]) if isinstance(ids, torch.Tensor) and ids.dim() else None


@dataclass
class BucketedGenerate:
    """`generate` with its batch padded to the bucket (see the module docstring). `counts`: calls by what was done:
    "padded B -> bucket", "bucket B", or the reason a call ran as it came."""

    original: Callable
    buckets: tuple[int, ...]
    counts: Counter = field(default_factory=Counter)
    saved: Any = None  # an instance attribute `generate` the wrapper replaced, put back on disable

    def __call__(self, *args, **kwargs):
        batch = batch_of(args, kwargs)
        rows = bucket_for(batch, self.buckets) if batch is not None else None
        if rows is None:
            self.counts[outside_reason(batch, self.buckets)] += 1
            return self.original(*args, **kwargs)
        self.counts[f"bucket {rows}" if rows == batch else f"padded {batch} -> {rows}"] += 1
        if rows == batch:
            return self.original(*args, **kwargs)
        if args:  # input_ids given positionally
            kwargs = {"input_ids": args[0], **kwargs}
            args = args[1:]
        return unpad(self.original(*args, **pad_batch(kwargs, batch, rows)), batch, rows)


def outside_reason(batch: int | None, buckets: tuple[int, ...]) -> str:
    """The counted reason of a call no bucket takes."""
    if batch is None:
        return "batch: expected input_ids or inputs_embeds, got neither"
    return f"batch: expected at most {max(buckets)} (verified buckets {list(buckets)}), got {batch}"


def enable_batch_buckets(model: torch.nn.Module, buckets: tuple[int, ...] | list[int]) -> BucketedGenerate:
    """Wrap `model.generate` (an instance attribute) so that each call's batch pads to its bucket. Idempotent for
    the same buckets; other buckets replace the wrapper's."""
    buckets = tuple(sorted(set(buckets)))
    if not buckets or buckets[0] < 1:
        raise ValueError(f"enable_batch_buckets: expected batch sizes >= 1, got {list(buckets)}")
    existing = model.__dict__.get(_ATTR)
    if existing is not None:
        existing.buckets = buckets
        return existing
    wrapper = BucketedGenerate(model.generate, buckets, saved=model.__dict__.get("generate"))
    model.__dict__[_ATTR] = wrapper
    model.generate = wrapper
    return wrapper


def disable_batch_buckets(model: torch.nn.Module) -> dict[str, int] | None:
    """Put `generate` back; returns the wrapper's counts (None when none was installed)."""
    wrapper = model.__dict__.pop(_ATTR, None)
    if wrapper is None:
        return None
    model.__dict__.pop("generate", None)
    if wrapper.saved is not None:
        model.generate = wrapper.saved
    return dict(wrapper.counts)


def batch_buckets_of(model: torch.nn.Module) -> BucketedGenerate | None:
    return model.__dict__.get(_ATTR)
