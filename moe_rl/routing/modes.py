"""Routing Replay modes: which routes a mode forces, in which passes, and how (docs/design.md §1).

The one table the loop (`moe_rl.train`), the config check, the TRL integration and the tests read,
instead of comparing mode names; adding a mode is a row here and a file in `experiments/conf/replay/`:
- `none`: the router's own routes everywhere;
- `r2`: the old-policy pass's routes, forced in every update (arXiv 2507.18071's Routing Replay);
- `r3`: the rollout's routes, forced in the old-policy pass and in every update (arXiv 2510.11370);
- `r2_threshold` / `r3_threshold`: the same, but a replayed expert is kept only where the live
  router's score on it is at least `replay.threshold` times the weakest live top-k score; a rejected
  slot is refilled from the live router's own top-k, in its order (prime-rl's router replay score
  threshold, PrimeIntellect-ai/prime-rl PR 2703, read to confirm the rule);
- `trr` (Total Router Recall, prime-rl PR 3523): the old-policy pass's ids *and* its combine
  weights, in float32, forced in every update. The recorded weights are constants, so the router
  gets no gradient through them (its only path to the loss here): under `trr` the router does not
  learn from the policy gradient. The weights come from the old-policy pass because the engines
  export ids only;
- `anchored`: the routes the frozen reference policy (the cold start) gives the same tokens, forced in
  the rollout (each decoded token's, from the reference's own pass alongside the sampler's:
  `moe_rl.routing.anchored`), in the old-policy pass and in every update (from a no-grad teacher-forced
  pass of the reference), so route drift from the start is zero by construction; the gate weights come
  from the live router, as under R2/R3.
Pure and torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

OLD = "old"  # the old-policy pass's routes
ROLLOUT = "rollout"  # the rollout's (generation's) routes
ANCHOR = "anchor"  # the frozen reference policy's routes on the same tokens, in the rollout too

R = TypeVar("R")


@dataclass(frozen=True)
class ReplayMode:
    """What a replay mode forces: `source` (OLD, ROLLOUT, ANCHOR or None: nothing), whether replayed experts
    pass the live router's score threshold, and whether the recorded combine weights are forced too."""

    source: str | None
    threshold: bool = False
    weights: bool = False

    @property
    def replays(self) -> bool:
        """The updates force recorded routes (every mode but `none`)."""
        return self.source is not None

    @property
    def replays_old(self) -> bool:
        """The updates force the old-policy pass's routes (R2's family)."""
        return self.source == OLD

    @property
    def replays_rollout(self) -> bool:
        """The updates force the rollout's routes (R3's family), so the rollout must record them."""
        return self.source == ROLLOUT

    @property
    def anchored(self) -> bool:
        """Every pass, the rollout's included, takes the frozen reference policy's routes."""
        return self.source == ANCHOR

    @property
    def old_pass_replays(self) -> bool:
        """The old-policy pass replays too (the rollout's or the reference's routes exist before it)."""
        return self.source in (ROLLOUT, ANCHOR)

    @property
    def ids_only(self) -> bool:
        """The recorded expert ids are forced as given: no threshold, no combine weights."""
        return not (self.threshold or self.weights)

    def threshold_of(self, threshold: float) -> float | None:
        """`replay.threshold` where this mode applies it, else None (no threshold)."""
        return threshold if self.threshold else None

    def pick(self, *, old: R, rollout: R, anchor: R | None = None) -> R | None:
        """The routes this mode forces in the updates, of the old pass's, the rollout's and the reference's."""
        return {OLD: old, ROLLOUT: rollout, ANCHOR: anchor, None: None}[self.source]


REPLAY_MODES: dict[str, ReplayMode] = {
    "none": ReplayMode(None),
    "r2": ReplayMode(OLD),
    "r3": ReplayMode(ROLLOUT),
    "r2_threshold": ReplayMode(OLD, threshold=True),
    "r3_threshold": ReplayMode(ROLLOUT, threshold=True),
    "trr": ReplayMode(OLD, weights=True),
    "anchored": ReplayMode(ANCHOR),
}


def replay_mode(name: str) -> ReplayMode:
    """The mode registered under `name`."""
    if name not in REPLAY_MODES:
        raise ValueError(f"unknown replay mode {name!r}; valid: {', '.join(REPLAY_MODES)}")
    return REPLAY_MODES[name]


def mode_names(**properties: bool) -> tuple[str, ...]:
    """The valid mode names, in table order; with keyword arguments, those whose `ReplayMode` properties
    have these values, e.g. `mode_names(ids_only=True)` or `mode_names(replays=True, weights=False)`."""
    return tuple(
        name for name, mode in REPLAY_MODES.items() if all(getattr(mode, k) == v for k, v in properties.items())
    )
