"""Staleness as the papers mean it: three named axes of `moe_rl.train` (docs/usage.md, "Three staleness axes").

- `optim.updates_per_rollout` = N (Qwen's off-policy N, arXiv 2512.01374): one rollout of P x G sequences split
  into N mini-batches of P x G / N; raising N shrinks the mini-batch and adds updates.
- `rollout.staleness` = S (VESPO's design, arXiv 2602.10693): the mini-batch stays P x G / N and the rollout grows
  S-fold (S x P prompts), one pass over it in S x N updates, so its last mini-batch is S x N - 1 updates stale.
  S = 1 is the N axis' run bitwise.
- `rollout.policy_lag` = k (asynchronous RL, AReaL's staleness bound, arXiv 2505.24298): the rollout of step t is
  sampled by the policy of step t - k (its weights at the start of that step; the cold start for t <= k), and
  trained on with AReaL's decoupled objective: the clip on pi_theta / pi_prox, with the proximal policy pi_prox the
  old pass (the weights at the start of step t), times the constant behaviour weight pi_prox / pi_behav
  (`behaviour_weight_kwargs`). k = 0 is today's run bitwise.

The keys' values are checked with the rollout config's own (`moe_rl.config.RolloutConfig.check`).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from torch import Tensor


def rollout_prompts(prompts_per_step: int, staleness: int) -> int:
    """Prompts of one rollout: `rollout.prompts_per_step` x `rollout.staleness`."""
    return prompts_per_step * staleness


def minibatch_count(updates_per_rollout: int, staleness: int) -> int:
    """Mini-batches (updates) of one rollout: N x S, each of (prompts_per_step x group_size) / N sequences."""
    return updates_per_rollout * staleness


def behaviour_weight_kwargs(*, token_loss: bool) -> dict[str, Any]:
    """`moe_rl.algos.corrections.engine_weight`'s arguments for the decoupled objective's plain behaviour weight
    w = pi_prox / pi_behav = exp(old_logp - rollout_logp), uncapped as AReaL's default (`behav_imp_weight_cap`
    None): a truncation at an infinite cap truncates nothing. Per token for a token loss; per sequence (the
    product of its tokens' weights) for a sequence loss, whose ratio is a sequence's. A run that sets
    `rollout.is_correction` weighs the same ratio by that correction instead (`mis` with `is_cap`: AReaL's cap)."""
    return dict(correction="tis", level="token" if token_loss else "sequence", cap=math.inf)


class PolicyLag:
    """The policy's weights at the start of each of the last k steps, so step t samples with step t - k's.

    Before step t the queue holds the versions of steps t - k .. t - 1 (fewer in the first k steps);
    `behaviour(live)` returns the oldest (the live weights when none is kept yet, at step 1) and keeps a copy of
    `live`, the weights at the start of step t. It holds k copies of the weights between steps (on the weights'
    device); `state`/`restore` carry them through a checkpoint.
    """

    def __init__(self, lag: int) -> None:
        if lag < 1:
            raise ValueError(f"rollout.policy_lag={lag}: a PolicyLag keeps k >= 1 versions (0: no lag, no copies)")
        self.lag = lag
        self.versions: deque[dict[str, Tensor]] = deque()

    def behaviour(self, live: dict[str, Tensor]) -> dict[str, Tensor]:
        """The weights this step samples with: those of k steps ago, or the oldest kept (`live` at step 1)."""
        if len(self.versions) == self.lag:
            state = self.versions.popleft()
        else:
            state = self.versions[0] if self.versions else live
        self.versions.append({name: t.detach().clone() for name, t in live.items()})
        return state

    def state(self) -> list[dict[str, Tensor]]:
        """The kept versions, oldest first, on the CPU (a checkpoint's plain data)."""
        return [{name: t.cpu() for name, t in version.items()} for version in self.versions]

    def restore(self, versions: list[dict[str, Tensor]], device: Any) -> None:
        """The versions `state` returned, back on `device`."""
        self.versions = deque({name: t.to(device) for name, t in version.items()} for version in versions)
