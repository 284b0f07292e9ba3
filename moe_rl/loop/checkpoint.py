"""Save and restore a run's whole state (weights, optimizer, scheduler, RNG, collapse events, the loop's
history) through the world's `Dist` (one file, or one shard per rank), for `moe_rl.train.Trainer`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from moe_rl.config import TrainConfig, config_hash, run_dir
from moe_rl.loop.cold_start import expected_key, member_config
from moe_rl.metrics.collapse import HISTORY_KEYS as COLLAPSE_HISTORY_KEYS
from moe_rl.metrics.names import REWARD_ERRORS, REWARD_ZERO_VAR_GROUP_FRAC
from moe_rl.run.folder import check_run_dir, rng_state, set_rng_state

if TYPE_CHECKING:
    from moe_rl.train import Trainer

# The (step, value) series the loop keeps (and restores on resume): the collapse detector's and the verdict's.
LOOP_HISTORY_KEYS = (*COLLAPSE_HISTORY_KEYS, REWARD_ZERO_VAR_GROUP_FRAC, REWARD_ERRORS)

log = logging.getLogger(__name__)


def save_state(trainer: Trainer, step: int) -> None:
    """The checkpoint of `step`: what `restore_state` needs to go on bitwise as if never stopped."""
    trainer.dist.save(
        trainer.writer.dir,
        step,
        trainer.policy,
        trainer.optimizer,
        trainer.ref,
        {
            "step": step,
            "scheduler": trainer.scheduler.state_dict(),
            "rng": rng_state(),
            "events": trainer.writer.events,
            "cold_start_key": trainer.cold_info.get("key"),
            "config_hash": trainer.writer.config_hash,
        },
    )


def restore_state(trainer: Trainer) -> int:
    """Restore the last checkpoint of the trainer's run folder if there is one (a folder of another config
    or cold start is refused); the last completed step (0: none)."""
    writer = trainer.writer
    state = trainer.dist.load(
        writer.dir,
        trainer.policy,
        trainer.optimizer,
        trainer.ref,
        config_hash=writer.config_hash,
        cold_start_key=trainer.cold_info.get("key"),
    )
    if state is None:
        writer.truncate_after(-1)  # parts of a run killed before its first checkpoint
        return 0
    trainer.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    writer.events = list(state["events"])
    writer.truncate_after(state["step"])
    trainer.history.update(trainer.dist.broadcast(writer.history(LOOP_HISTORY_KEYS)))  # only rank 0's writer reads
    log.info("resuming %s after step %d", writer.dir, state["step"])
    return state["step"]


def refuse_foreign_dir(cfg: TrainConfig, world_size: int) -> None:
    """RunDirectoryError when `cfg`'s run directory belongs to another run or another world (reads only)."""
    check_run_dir(
        run_dir(cfg),
        config_hash=config_hash(cfg),
        world_size=world_size,
        cold_start_key=expected_key(
            cfg.model, cfg.task, member_config(cfg.cold_start, cfg.seed), numerics=cfg.numerics
        ),
    )
