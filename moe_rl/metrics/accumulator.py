"""One update's or one step's metrics, gathered from the code that computes them.

Each metric family is emitted once, where its inputs are computed: its partial statistics (`Partial`,
moe_rl.metrics.partial) and the function that turns them, pooled over the processes, into logged
metrics. `finalize` pools every family in one collective and finalizes each; a family that was not
emitted (a dense model's route comparisons, a step without the route instruments) logs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from moe_rl.metrics.partial import Partial

Finalize = Callable[[Partial], Mapping[str, float]]


class Metrics:
    """The metric families emitted so far, and the exact values every process shares (a gradient norm)."""

    def __init__(self) -> None:
        self.parts = Partial()  # every family's tensors under `family/`
        self._families: list[tuple[str, Finalize]] = []
        self._values: dict[str, float] = {}

    def add(self, family: str, parts: Partial, finalize: Finalize) -> None:
        """Emit `family`: its partial statistics, finalized after pooling by `finalize(pooled)`."""
        if "/" in family or any(family == name for name, _ in self._families):
            raise ValueError(f"metric family {family!r}: a name without '/', emitted once")
        self.parts.add(family, parts)
        self._families.append((family, finalize))

    def put(self, values: Mapping[str, float]) -> None:
        """Metrics that need no pooling: the same on every process."""
        self._values.update(values)

    def finalize(self, merge: Callable[[Partial], Partial] = lambda parts: parts) -> dict[str, float]:
        """The metrics: every family's partial statistics pooled by `merge` (`Dist.merge`), then finalized."""
        pooled = merge(self.parts)
        out: dict[str, float] = {}
        for family, finalize in self._families:
            out.update(finalize(pooled.sub(family)))
        out.update(self._values)
        return out
