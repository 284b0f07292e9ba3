"""The old-policy pass (step 2 of `moe_rl.train`): `old_logp`, the old policy's routes and, on the steps
that run the route instruments, what the expert-load and router instruments need; under anchored routing,
the frozen reference's routes it and the updates replay (`anchor_routes`)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from moe_rl.loop.records import OldPass
from moe_rl.metrics.partial import Partial
from moe_rl.rollout.generate import Rollout, forward_logp
from moe_rl.routing import RoutedPass, RouteRecorder, Routes
from moe_rl.routing.expert_load import instrument_parts
from moe_rl.routing.layers import returns_router_logits
from moe_rl.routing.modes import ReplayMode


def old_pass(
    policy: PreTrainedModel,
    rollout: Rollout,
    mode: ReplayMode | None,
    *,
    instruments: bool,
    scores: bool,
    threshold: float | None,
    temperature: float,
    anchor: Routes | None = None,
) -> OldPass:
    """old_logp, the old policy's native routes, margins and router scores on the rollout tokens, and the
    combine weights the experts received when the replay mode forces them (`trr`); a dense model (`mode`
    None) has no routes (None), margins or scores (empty). Margins and scores only feed the route instruments
    (and RSPO's factor, which reads the scores): without `instruments` they are left empty too. With
    `instruments`, the pass also returns the router logits' and the expert load's partial sums
    (`moe_rl.routing.expert_load.instrument_parts`): the same forward, its router logits recorded by the route hooks
    (asking transformers for them, `output_router_logits`, would also compute the load-balancing loss, and its
    output capture breaks a compiled model's graph). `anchor`: the
    reference's routes (`anchor_routes`), which an anchored mode's old pass replays."""
    if mode is None:
        with torch.no_grad():
            old_logp, _ = forward_logp(policy, rollout, temperature=temperature)
        return OldPass(old_logp, None, torch.empty(0), torch.empty(0), None)
    replay = mode.pick(old=None, rollout=rollout.routes, anchor=anchor) if mode.old_pass_replays else None
    logits = instruments and returns_router_logits(policy)  # where `output_router_logits` would have returned them
    routed = RoutedPass(
        policy,
        replay,
        margins=instruments,
        scores=scores,
        weights=mode.weights,
        logits=logits,
        threshold=threshold,
    )
    parts: Partial | None = None
    with torch.no_grad(), routed:
        old_logp, _ = forward_logp(policy, rollout, temperature=temperature)
    native = routed.native.with_mask(rollout.token_mask)
    if instruments:
        parts = instrument_parts(native, routed.logits if logits else None, rollout.routes)
    return OldPass(
        old_logp,
        native,
        routed.margins if instruments else torch.empty(0),
        routed.scores if scores else torch.empty(0),
        routed.weights if mode.weights else None,
        parts,
    )


def anchor_routes(anchor: PreTrainedModel | None, rollout: Rollout, *, temperature: float) -> Routes | None:
    """The routes the frozen `anchor` gives the rollout's tokens (None without one): a no-grad teacher-forced pass,
    the same call as the old pass's (so an anchor with the old policy's weights gives the old pass's routes bitwise)."""
    if anchor is None:
        return None
    with torch.no_grad(), RouteRecorder(anchor) as recorder:
        forward_logp(anchor, rollout, temperature=temperature)
    return recorder.routes.with_mask(rollout.token_mask)
