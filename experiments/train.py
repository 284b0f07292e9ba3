"""Hydra entry point: the glue between Hydra's composed config and `moe_rl.train.train`.

    python experiments/train.py algo=gspo replay=none seed=1
    python experiments/train.py -m +preset=compare                      # the headline sweep
    python experiments/train.py -m +preset=compare hydra/launcher=joblib hydra.launcher.n_jobs=2
    torchrun --nproc_per_node=4 experiments/train.py algo=gspo       # one run over 4 processes (FSDP2)

Defaults live in the dataclasses of `moe_rl.config` (registered below); config groups and
presets in `experiments/conf/preset/` hold only deltas (`+preset=NAME experiment=MINE` names a run
from a preset). A run whose directory already holds a finished `status.json` is skipped, so rerunning
an interrupted multirun completes it. A config that validation refuses, or data or a reward that cannot be
read, ends the command with one line (`error: <why>`, exit status 1; `HYDRA_FULL_ERROR=1`: the traceback).
What the launch needs of the run layer (the run folder's name, a finished folder, the sweep's progress) is
`moe_rl.run.launch`.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from moe_rl.config import TrainConfig, config_hash, to_train_config, validate
from moe_rl.metrics.status import INVALID
from moe_rl.run.atomic import write_atomic
from moe_rl.run.folder import read_status, write_status
from moe_rl.run.launch import finished_status, interrupted_line, refuse_old_preset_spelling
from moe_rl.tasks.rewards import TaskInputError

ConfigStore.instance().store(name="base_config", node=TrainConfig)
log = logging.getLogger(__name__)


class RejectedConfig(Exception):
    """The composed config failed validation: a value out of range (its key and why) or a missing extra."""


def parallel_launcher(hydra_cfg: Any) -> bool:
    """Whether this job may run beside others on one terminal (a multirun with a non-basic launcher)."""
    from hydra.types import RunMode

    target = str(OmegaConf.select(hydra_cfg, "launcher._target_", default="") or "")
    return hydra_cfg.mode == RunMode.MULTIRUN and not target.endswith("BasicLauncher")


def write_hydra_record(out_dir: str | Path, cfg: DictConfig, hydra_cfg: Any) -> None:
    """`.hydra/` (config.yaml, hydra.yaml, overrides.yaml) as Hydra writes it, written by the run itself
    (`hydra.output_subdir: null`) once the folder is known to be its own, so a refused launch leaves the
    record of the run that owns the folder as it was."""
    folder = Path(out_dir) / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    records = {
        "config.yaml": cfg,
        "hydra.yaml": OmegaConf.create({"hydra": hydra_cfg}),
        "overrides.yaml": hydra_cfg.overrides.task,
    }
    for name, record in records.items():
        write_atomic(folder / name, OmegaConf.to_yaml(record, resolve=False))


def run_from_hydra(cfg: DictConfig, hydra_cfg: Any) -> str:
    from moe_rl.loop.distributed import world_size_from_env
    from moe_rl.train import refuse_foreign_dir, train

    out_dir = hydra_cfg.runtime.output_dir
    try:
        train_cfg = validate(to_train_config(cfg))
    except Exception as err:  # Hydra already made the folder: say why it holds no run (never over a real run)
        if not read_status(out_dir) and not (Path(out_dir) / "metrics.parquet").exists():
            write_status(out_dir, INVALID, error=err)
        if isinstance(err, (ValueError, ImportError)):  # validate()'s refusals name the key or the extra
            raise RejectedConfig(err) from err
        raise
    train_cfg.out_dir = out_dir
    if parallel_launcher(hydra_cfg):
        train_cfg.progress = False  # bars of parallel runs garble one another: log lines instead
    cache = Path(train_cfg.cold_start.cache_dir)
    if not cache.is_absolute():  # shared by every job of a sweep, whatever the launcher's cwd
        train_cfg.cold_start.cache_dir = str(Path(hydra_cfg.runtime.cwd) / cache)
    if train_cfg.dry_run:
        log.info("dry run %s: %s", train_cfg.arm, train_cfg.out_dir)
        return "dry_run"
    world_size = world_size_from_env()
    refuse_foreign_dir(train_cfg, world_size)  # RunDirectoryError: the folder is left as it was
    if int(os.environ.get("RANK", "0")) == 0:
        write_hydra_record(out_dir, cfg, hydra_cfg)
    done = finished_status(train_cfg.out_dir, config_hash(train_cfg))
    if done is not None:
        log.info("skipping %s: already %s", train_cfg.out_dir, done)
        return done
    return train(train_cfg, checked=True)["status"]  # validated and its folder checked: once per launch


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> str:
    try:
        return run_from_hydra(cfg, HydraConfig.get())
    except (RejectedConfig, TaskInputError) as err:  # a config value, the user's data or reward: one line
        if os.environ.get("HYDRA_FULL_ERROR") == "1":  # the traceback on request, Hydra's switch
            raise
        sys.exit(f"error: {err}")  # status.json (and a run's train.log) keep the rest
    except KeyboardInterrupt:  # one line, not a traceback from inside transformers
        sys.exit(interrupted_line(HydraConfig.get().runtime.output_dir, cfg.checkpoint_every))


if __name__ == "__main__":
    os.environ["MOE_RL_COMMAND"] = shlex.join(sys.argv)  # meta.json's command, in every sweep worker
    refuse_old_preset_spelling(sys.argv[1:])  # `+experiment=NAME` is `+preset=NAME` now: one line, not Hydra's error
    if int(os.environ.get("RANK", "0")) > 0:  # torchrun's other ranks: rank 0 alone writes the run directory
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
    main()
