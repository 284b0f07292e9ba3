"""The ratio split's extra pass (docs/design.md §3): the update's rows scored under the routing it did not use."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from moe_rl.rollout.generate import Rollout, forward_logp
from moe_rl.routing import RoutedPass, Routes

Score = Callable[[Rollout, torch.Tensor, Routes | None, Routes], tuple[torch.Tensor, Routes]]


class SplitPass(NamedTuple):
    """What the split's pass gives the update's metrics (`moe_rl.loop.step_metrics.split_metrics`)."""

    logp: torch.Tensor  # (s, T) log pi_theta under the routing the update did not use, on the scored rows
    routes: Routes  # the routes that pass used, on the scored rows
    rows: torch.Tensor | None  # (s,) positions of the scored rows among the update's rows; None: all of them


def split_pass(
    score: Score, rollout: Rollout, rows: torch.Tensor, replay: Routes | None, old: Routes, scored: torch.Tensor | None
) -> SplitPass:
    """`score` (`other_routing_logp` with the loop's weights) on the rows at positions `scored` of `rows` (None:
    all), and those positions. A process holding none of the subsample still runs the pass, on its first row,
    so that every process joins the pass's collectives (FSDP); it then keeps none of it."""
    if scored is None:
        logp, routes = score(rollout, rows, replay, old)
        return SplitPass(logp, routes, None)
    run = scored if scored.numel() else torch.zeros(1, dtype=torch.long)
    logp, routes = score(rollout, rows[run], replay[run] if replay is not None else None, old[run])
    keep = slice(None) if scored.numel() else slice(0, 0)
    return SplitPass(logp[keep], routes[keep], scored)


def other_routing_logp(
    policy: PreTrainedModel,
    rollout: Rollout,
    rows: torch.Tensor,
    replay: Routes | None,
    old: Routes,
    *,
    temperature: float,
) -> tuple[torch.Tensor, Routes]:
    """(log pi_theta, routes used) of `rows` with the current weights under the routing the update did
    not use: the router's own routes when it replays `replay`, the old pass's routes `old` when it
    does not. One extra forward, no grad, before the optimizer step."""
    with torch.no_grad(), RoutedPass(policy, old if replay is None else None) as routed:
        logp, _ = forward_logp(policy, rollout, rows, temperature=temperature)
    return logp, routed.used.with_mask(rollout.token_mask[rows])
