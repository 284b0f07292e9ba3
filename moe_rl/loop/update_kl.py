"""`kl/update_k3`'s passes (docs/design.md §3): each update's own step as a divergence, the policy's log-probs of
the update's rows (a seeded subsample of them, `metrics.update_kl_rows`) before and after the optimizer step."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from moe_rl.loop.step_metrics import instruments_due, local_positions, split_subsample, update_kl_metrics
from moe_rl.metrics.accumulator import Metrics
from moe_rl.metrics.names import KL_UPDATE_K3_ACTING
from moe_rl.rollout.generate import Rollout, forward_logp
from moe_rl.routing import RouteReplay, Routes


def update_kl_seed(seed: int, step: int) -> int:
    """Seed of `step`'s subsample: a stream of its own, like `split_seed`, so that no training stream moves."""
    return seed * 1_000_151 + step + 130_363


def scored_updates(step: int, window: int | None, route_every: int, updates: int) -> list[bool]:
    """Which of `step`'s `updates` score `kl/update_k3` (`metrics.update_kl_window`): all of them on every step of
    the early window 1..`window` (every step with `window` None); after it, on the route instruments' steps
    (multiples of `route_every`), one, in rotation over the steps (the k-th such step scores update k mod N), so
    the run's mean is an unbiased estimate at a fraction of the cost; none on the others."""
    if window is None or step <= window:
        return [True] * updates
    if not instruments_due(step, route_every):
        return [False] * updates
    one = (step // route_every) % updates
    return [u == one for u in range(updates)]


def kl_rows(
    keep: int | None,
    seed: int,
    step: int,
    minibatches: tuple[Tensor, ...],
    first: int,
    count: int,
    scored: list[bool] | None = None,
) -> list[Tensor | None]:
    """Per mini-batch (global row ids), the positions among this process's rows (it holds [first, first + count)) of
    the `keep` rows `kl/update_k3` scores, drawn from `update_kl_seed`; every row with `keep` None; None (nothing
    scored) with `keep` 0 and for the mini-batches `scored` (`scored_updates`; None: all) leaves out. One subsample
    of the global mini-batch, whatever the world size, and the same draws whichever updates are scored."""
    if keep == 0:
        return [None] * len(minibatches)
    generator = torch.Generator().manual_seed(update_kl_seed(seed, step))
    picks = [split_subsample(len(rows), keep, generator) for rows in minibatches]
    scored = scored if scored is not None else [True] * len(minibatches)
    return [
        local_positions(rows, torch.arange(len(rows)) if picked is None else picked, first, count) if use else None
        for rows, picked, use in zip(minibatches, picks, scored)
    ]


def native_logp(policy: PreTrainedModel, rollout: Rollout, rows: Tensor, temperature: float) -> Tensor:
    """log pi_theta of `rows` with the current weights and the router's own routes (no replay, no grad)."""
    with torch.no_grad():
        return forward_logp(policy, rollout, rows, temperature=temperature)[0]


def acting_logp(policy: PreTrainedModel, rollout: Rollout, rows: Tensor, temperature: float, routes: Routes) -> Tensor:
    """log pi_theta of `rows` with the current weights under `routes` (the routes the policy acts with), no grad."""
    with torch.no_grad(), RouteReplay(policy, routes):
        return forward_logp(policy, rollout, rows, temperature=temperature)[0]


class UpdateKL:
    """One update's `kl/update_k3`: the scored rows' log-probs before the optimizer step (the loss's own where it
    did not replay, else one more pass under the router's own routes), then after it (`emit`). With `acting` (the
    update's rows' routes where the policy acts with routes not its router's: anchored), also
    `kl/update_k3/acting` under them (before: the loss's own log-probs, which were under them)."""

    def __init__(
        self,
        policy: PreTrainedModel,
        rollout: Rollout,
        rows: Tensor,
        scored: Tensor,
        logp: Tensor,
        replayed: bool,
        temperature: float,
        acting: Routes | None = None,
    ) -> None:
        # a process holding none of the subsample still runs the passes, on its first row, so that every process
        # joins their collectives (FSDP); it then keeps none of it
        self.run: Tensor = scored if scored.numel() else torch.zeros(1, dtype=torch.long)
        self.keep = slice(None) if scored.numel() else slice(0, 0)
        self.policy, self.rollout, self.rows, self.temperature = policy, rollout, rows[self.run], temperature
        self.before = native_logp(policy, rollout, self.rows, temperature) if replayed else logp.detach()[self.run]
        self.acting = None if acting is None else acting[self.run]
        self.acting_before = None if acting is None else logp.detach()[self.run]

    def emit(self, acc: Metrics, mask: Tensor) -> None:
        """After the optimizer step: the pass with the new weights, and the metric into the update's `acc`
        (`mask`: the update's valid response tokens, (b, T))."""
        after = native_logp(self.policy, self.rollout, self.rows, self.temperature)
        valid = mask[self.run][self.keep]
        update_kl_metrics(acc, self.before[self.keep], after[self.keep], valid)
        if self.acting is not None and self.acting_before is not None:
            acted = acting_logp(self.policy, self.rollout, self.rows, self.temperature, self.acting)
            update_kl_metrics(acc, self.acting_before[self.keep], acted[self.keep], valid, key=KL_UPDATE_K3_ACTING)


def update_kl(
    policy: PreTrainedModel,
    rollout: Rollout,
    rows: Tensor,
    scored: Tensor | None,
    logp: Tensor,
    replayed: bool,
    temperature: float,
    acting: Routes | None = None,
) -> UpdateKL | None:
    """The update's `UpdateKL` on the rows at positions `scored` of `rows` (`acting`: the routes those rows act
    with where not the router's own); None when nothing is scored (off)."""
    return None if scored is None else UpdateKL(policy, rollout, rows, scored, logp, replayed, temperature, acting)
