"""What the loop's phases hand each other (`moe_rl.train`, steps 1-3): typed records, not positional tuples."""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe_rl.algos.corrections import EngineWeight
from moe_rl.metrics.partial import Partial
from moe_rl.rollout.generate import Rollout
from moe_rl.routing import Routes


class Sampled(NamedTuple):
    """What the rollout gives the step (1.)."""

    rollout: Rollout
    rewards: torch.Tensor  # (B,) on the CPU, this rank's rows
    metrics: dict[str, float]  # this rank's reward/ (the step pools them over every rank) and engine's metrics


class OldPass(NamedTuple):
    """What the old-policy pass gives the updates (2.)."""

    logp: torch.Tensor  # (B, T) old_logp
    routes: Routes | None  # the old policy's native routes (None: a dense model)
    margins: torch.Tensor  # (B, T, L) k-th vs (k+1)-th router probability gaps
    scores: torch.Tensor  # (B, T, L, E) router selection probabilities
    weights: torch.Tensor | None  # (B, T, L, k) float32 combine weights (replay modes that force them), else None
    instruments: Partial | None = None  # the load and router instruments' partial sums (route steps), else None


class Batch(NamedTuple):
    """What every update of a step reads (3.): the rollout, its advantages, the old pass, the routes the
    updates replay (None: none) and the engine-gap correction (None: `rollout.is_correction=none`)."""

    rollout: Rollout
    adv: torch.Tensor  # (B,)
    old: OldPass
    replay: Routes | None
    correction: EngineWeight | None = None
