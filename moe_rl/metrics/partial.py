"""Partial statistics: what a metric needs from some rows, so that many processes can pool their rows.

Every logged metric is computed in two steps: a pure function of this process's rows returns a
`Partial` (sums, maxima and per-row values), and a pure finalize function turns a `Partial` into the
metric. Between the two, `moe_rl.loop.distributed.Dist.merge` adds the sums, takes the maxima and
concatenates the rows of every process (in rank order); in a world of size 1 it returns its input,
so a one-process run finalizes exactly what its own rows give. The one-process metric functions
(`moe_rl.metrics.ratio_stats.ratio_stats`, `moe_rl.routing.compare_routes`, ...) are `finalize(parts(...))`.

Sums keep the dtype the one-process computation uses (float32 sums of float32 values stay float32),
so a world of size 1 logs bitwise what the metric functions return.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Partial:
    """Named tensors of one metric family, by how processes pool them."""

    sums: dict[str, Tensor] = field(default_factory=dict)  # added across processes
    maxima: dict[str, Tensor] = field(default_factory=dict)  # largest across processes
    rows: dict[str, Tensor] = field(default_factory=dict)  # concatenated along dim 0, in rank order

    def add(self, prefix: str, other: Partial) -> Partial:
        """Put `other`'s tensors under `prefix/` (families of one update merge in one collective)."""
        for mine, theirs in ((self.sums, other.sums), (self.maxima, other.maxima), (self.rows, other.rows)):
            mine.update({f"{prefix}/{k}": v for k, v in theirs.items()})
        return self

    def sub(self, prefix: str) -> Partial:
        """The tensors stored under `prefix/`, with the prefix removed."""
        n = len(prefix) + 1

        def pick(d: dict[str, Tensor]) -> dict[str, Tensor]:
            return {k[n:]: v for k, v in d.items() if k.startswith(f"{prefix}/")}

        return Partial(pick(self.sums), pick(self.maxima), pick(self.rows))

    def empty(self) -> Partial:
        """The same names and shapes with nothing in them: what a process without rows contributes."""
        return Partial(
            {k: torch.zeros_like(v) for k, v in self.sums.items()},
            {k: torch.full_like(v, -torch.inf) for k, v in self.maxima.items()},
            {k: v[:0] for k, v in self.rows.items()},
        )


def pool(parts: list[Partial]) -> Partial:
    """The partial statistics of the union of the rows behind `parts` (one per process, in rank order):
    sums added (in float64, returned in their own dtype), maxima taken, rows concatenated. Every part
    must hold the same names and shapes (rows: the same trailing shape); anything else would pair
    unrelated numbers, and raises."""
    first = parts[0]
    layout = _layout(first)
    for other in parts[1:]:
        if _layout(other) != layout:
            raise RuntimeError("processes pool different metric sets; every process must log the same keys")
    return Partial(
        {k: torch.stack([p.sums[k].double() for p in parts]).sum(0).to(v.dtype) for k, v in first.sums.items()},
        {k: torch.stack([p.maxima[k] for p in parts]).amax(0) for k in first.maxima},
        {k: torch.cat([p.rows[k] for p in parts]) for k in first.rows},
    )


def _layout(part: Partial) -> tuple:
    return (
        sorted((k, tuple(v.shape)) for k, v in part.sums.items()),
        sorted((k, tuple(v.shape)) for k, v in part.maxima.items()),
        sorted((k, tuple(v.shape[1:])) for k, v in part.rows.items()),
    )


def mean_parts(values: dict[str, float], weights: dict[str, float]) -> Partial:
    """Means of this process's rows with their denominators, one row (value, weight) per metric."""
    return Partial(rows={k: torch.tensor([[v, weights[k]]], dtype=torch.float64) for k, v in values.items()})


def mean_finalize(parts: Partial) -> dict[str, float]:
    """The mean over the union of the processes' rows from each one's (value, weight) row:
    sum_i w_i v_i / sum_i w_i over the rows of positive weight, exactly v_i when there is one such
    row (a world of size 1), and the first value when no row has weight (every row empty)."""
    out = {}
    for key, pairs in parts.rows.items():
        live = pairs[pairs[:, 1] > 0] if len(pairs) > 1 else pairs  # one row needs no weight test
        if len(live) > 1:
            out[key] = ((live[:, 0] * live[:, 1]).sum() / live[:, 1].sum()).item()
        elif len(pairs):
            out[key] = (live if len(live) else pairs)[0, 0].item()
    return out
