"""Save and restore a run's whole state (weights, optimizer, scheduler, RNG, collapse events, the loop's
history) through the world's `Dist` (one file, or one shard per rank): the loop hands over a `RunState`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from moe_rl.config import TrainConfig, config_hash, run_dir
from moe_rl.loop.cold_start import expected_key, run_member
from moe_rl.loop.distributed import Dist
from moe_rl.loop.staleness import PolicyLag
from moe_rl.metrics.collapse import HISTORY_KEYS as COLLAPSE_HISTORY_KEYS
from moe_rl.metrics.names import REWARD_ERRORS, REWARD_ZERO_VAR_GROUP_FRAC
from moe_rl.run.folder import RunWriter, check_run_dir, rng_state, set_rng_state

# The (step, value) series the loop keeps (and restores on resume): the collapse detector's and the verdict's.
LOOP_HISTORY_KEYS = (*COLLAPSE_HISTORY_KEYS, REWARD_ZERO_VAR_GROUP_FRAC, REWARD_ERRORS)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunState:
    """What a checkpoint holds of a run, besides the RNG: the objects are the loop's own, so a restore
    loads into them in place (`writer.events` and `history` included)."""

    policy: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ref: nn.Module | None  # the KL term's reference policy (None: algo.beta = 0)
    writer: RunWriter  # the run folder: its config hash, collapse events and streamed metrics
    history: dict[str, list[tuple[int, float]]]  # LOOP_HISTORY_KEYS' series
    cold_start_key: str | None
    lag: PolicyLag | None = None  # rollout.policy_lag's saved weights (None: no lag)


def save_state(dist: Dist, state: RunState, step: int) -> None:
    """The checkpoint of `step`: what `restore_state` needs to go on bitwise as if never stopped."""
    dist.save(
        state.writer.dir,
        step,
        state.policy,
        state.optimizer,
        state.ref,
        {
            "step": step,
            "scheduler": state.scheduler.state_dict(),
            "rng": rng_state(),
            "events": state.writer.events,
            "cold_start_key": state.cold_start_key,
            "config_hash": state.writer.config_hash,
            # rollout.policy_lag: the weights the next k steps sample with (moe_rl.loop.staleness.PolicyLag)
            **({"policy_lag": state.lag.state()} if state.lag is not None else {}),
        },
    )


def restore_state(dist: Dist, state: RunState) -> int:
    """Restore the last checkpoint of the run folder into `state` if there is one (a folder of another config
    or cold start is refused); the last completed step (0: none)."""
    writer = state.writer
    saved = dist.load(
        writer.dir,
        state.policy,
        state.optimizer,
        state.ref,
        config_hash=writer.config_hash,
        cold_start_key=state.cold_start_key,
    )
    if saved is None:
        writer.truncate_after(-1)  # parts of a run killed before its first checkpoint
        return 0
    state.scheduler.load_state_dict(saved["scheduler"])
    set_rng_state(saved["rng"])
    if state.lag is not None:
        state.lag.restore(saved["policy_lag"], next(state.policy.parameters()).device)
    writer.events = list(saved["events"])
    writer.truncate_after(saved["step"])
    state.history.update(dist.broadcast(writer.history(LOOP_HISTORY_KEYS)))  # only rank 0's writer reads
    log.info("resuming %s after step %d", writer.dir, saved["step"])
    return saved["step"]


def refuse_foreign_dir(cfg: TrainConfig, world_size: int) -> None:
    """RunDirectoryError when `cfg`'s run directory belongs to another run or another world (reads only)."""
    check_run_dir(
        run_dir(cfg),
        config_hash=config_hash(cfg),
        world_size=world_size,
        cold_start_key=expected_key(cfg.model, cfg.task, run_member(cfg), numerics=cfg.numerics),
    )
