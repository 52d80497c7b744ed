"""TileMix routing: which tile groups of the causal score matrix go to the INT8 path, as a packed bitmask.

A tile group is `group_m` queries x `group_n` keys of one sequence (the same grid for every sequence, head and batch
row: a shorter sequence uses the top-left corner). Bit `j % 32` of word `j // 32` in row `i` set means group (i, j)
takes the INT8 path. Coverage is the fraction of the causally visible groups of a `seq_len` grid routed to INT8;
each template ranks the visible groups by how much they matter (16-bit first) and sends the lowest-ranked
`round(coverage x visible)` of them to INT8, so 0 is all 16-bit, 1 all INT8, and the INT8 set grows with coverage
(it is nested: a higher coverage keeps every INT8 group of a lower one, within one template and seed).

Templates:
- `sink_local`: the first keys (attention sinks) and the diagonal band stay 16-bit, the far past goes INT8 first.
- `bigbird`: BigBird's three parts share the 16-bit budget: a window around the diagonal, global keys (the first
  columns) and random groups; each ranks its own candidates and a group keeps 16-bit by its best rank.
- `row_random`: every query row routes the same fraction of its visible groups, chosen at random.
The diagonal groups are the last to go INT8 in every template (only at coverages near 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

TEMPLATES = ("sink_local", "bigbird", "row_random")
DEFAULT_GROUP = (128, 128)


@dataclass(eq=False)
class TileMask:
    """bits: int32 [n_rows, n_words] (packed, on the kernel's device); group_m x group_n tokens per group."""

    bits: torch.Tensor
    group_m: int
    group_n: int
    n_cols: int
    template: str = "custom"
    coverage: float | None = None  # the requested coverage (None for a hand-built mask)
    _routes: dict = field(default_factory=dict, repr=False)  # tilemix: routing lists per tile config, device bits

    @property
    def n_rows(self) -> int:
        return self.bits.shape[0]

    def unpack(self) -> torch.Tensor:
        """bool [n_rows, n_cols], True = INT8."""
        return unpack_bits(self.bits, self.n_cols)

    def to(self, device) -> TileMask:
        return TileMask(self.bits.to(device), self.group_m, self.group_n, self.n_cols, self.template, self.coverage)

    def realised_coverage(self, seq_len: int) -> float:
        """The INT8 fraction of the causally visible groups of one sequence of `seq_len` tokens."""
        vis = visible_groups(seq_len, self.group_m, self.group_n)
        route = self.unpack().cpu()[: vis.shape[0], : vis.shape[1]]
        return float((route & vis).sum()) / max(int(vis.sum()), 1)


def pack_bits(route: torch.Tensor) -> torch.Tensor:
    """bool [R, C] -> int32 [R, ceil(C / 32)], bit j % 32 of word j // 32."""
    R, C = route.shape
    words = (C + 31) // 32
    padded = torch.zeros(R, words * 32, dtype=torch.int64, device=route.device)
    padded[:, :C] = route.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=route.device) << torch.arange(32, device=route.device)
    packed = (padded.view(R, words, 32) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # two's complement int32


def unpack_bits(bits: torch.Tensor, n_cols: int) -> torch.Tensor:
    shifts = torch.arange(32, device=bits.device)
    full = (bits.to(torch.int64)[:, :, None] >> shifts) & 1  # [R, W, 32]
    return full.reshape(bits.shape[0], -1)[:, :n_cols].bool()


def visible_groups(seq_len: int, group_m: int, group_n: int) -> torch.Tensor:
    """bool [rows, cols]: group (i, j) holds at least one causally visible (query, key) pair."""
    rows, cols = -(-seq_len // group_m), -(-seq_len // group_n)
    i, j = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    return j * group_n <= torch.clamp((i + 1) * group_m - 1, max=seq_len - 1)


def _diagonal(i: torch.Tensor, j: torch.Tensor, group_m: int, group_n: int) -> torch.Tensor:
    # groups the causal boundary crosses (some but not all pairs visible)
    return (j + 1) * group_n - 1 > i * group_m


def _importance(template: str, rows: int, cols: int, group_m: int, group_n: int, gen: torch.Generator) -> torch.Tensor:
    """float64 [rows, cols], higher = keep 16-bit longer (ties are broken by the caller's random order)."""
    i, j = torch.arange(rows, dtype=torch.float64)[:, None], torch.arange(cols, dtype=torch.float64)[None, :]
    dist = (i * group_m / group_n - j).clamp_min(0)  # groups back from the diagonal, in key-group units
    if template == "sink_local":
        sink = (j == 0).expand(rows, cols)
        return torch.where(sink, 1e9, -dist)
    if template == "bigbird":
        # each part's rank as a quantile in (0, 1], higher first; a group keeps its best part's quantile
        window = 1.0 / (1.0 + dist)
        global_ = (1.0 / (1.0 + j)).expand(rows, cols)
        random = torch.rand(rows, cols, generator=gen, dtype=torch.float64)
        return torch.maximum(torch.maximum(_quantile(window), _quantile(global_)), _quantile(random))
    if template == "row_random":
        return torch.rand(rows, cols, generator=gen, dtype=torch.float64)
    raise ValueError(f"tilemix mask: expected a template in {TEMPLATES}, got {template!r}")


def _quantile(x: torch.Tensor) -> torch.Tensor:
    ranks = torch.empty(x.numel(), dtype=torch.float64)
    ranks[x.flatten().argsort(stable=True)] = torch.arange(1, x.numel() + 1, dtype=torch.float64)
    return (ranks / x.numel()).view_as(x)


def build_tile_mask(template: str, coverage: float, seq_len: int, *, group: tuple[int, int] = DEFAULT_GROUP,
                    seed: int = 0, device: str | torch.device = "cpu") -> TileMask:
    """The routing of `template` at `coverage` in [0, 1] for sequences up to `seq_len` tokens."""
    if not 0.0 <= coverage <= 1.0:
        raise ValueError(f"tilemix mask: expected coverage in [0, 1], got {coverage}")
    if seq_len <= 0 or min(group) <= 0:
        raise ValueError(f"tilemix mask: expected seq_len > 0 and positive group sizes, got {seq_len}, {group}")
    gm, gn = group
    vis = visible_groups(seq_len, gm, gn)
    rows, cols = vis.shape
    i, j = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    gen = torch.Generator().manual_seed(seed)
    score = _importance(template, rows, cols, gm, gn, gen)
    score = torch.where(_diagonal(i, j, gm, gn), score + 2e9, score)  # diagonal groups last
    route = torch.zeros(rows, cols, dtype=torch.bool)
    if template == "row_random":  # the same fraction in every row
        for r in range(rows):
            idx = vis[r].nonzero().flatten()
            n8 = int(round(coverage * idx.numel()))
            order = score[r, idx].argsort(stable=True)
            route[r, idx[order[:n8]]] = True
    else:
        idx = vis.flatten().nonzero().flatten()
        n8 = int(round(coverage * idx.numel()))
        tie = torch.rand(idx.numel(), generator=gen, dtype=torch.float64) * 1e-6
        order = (score.flatten()[idx] + tie).argsort(stable=True)
        route.view(-1)[idx[order[:n8]]] = True
    return TileMask(pack_bits(route).to(device), gm, gn, cols, template, coverage)


def uniform_mask(int8: bool, seq_len: int, *, group: tuple[int, int] = DEFAULT_GROUP,
                 device: str | torch.device = "cpu") -> TileMask:
    """Every group 16-bit (int8=False: the plain BF16 flash kernel) or every group INT8 (uniform INT8)."""
    gm, gn = group
    rows, cols = -(-seq_len // gm), -(-seq_len // gn)
    route = torch.full((rows, cols), bool(int8))
    return TileMask(pack_bits(route).to(device), gm, gn, cols, "all_int8" if int8 else "all_16bit",
                    1.0 if int8 else 0.0)
