"""Glue between Hydra's composed config and the plain training function."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from moe_rl.config import TrainConfig, config_hash, validate
from moe_rl.metrics.status import FINISHED, INVALID
from moe_rl.run.atomic import write_atomic
from moe_rl.run.folder import RunDirectoryError, read_status, write_status
from moe_rl.run.progress import eta_seconds, format_duration

log = logging.getLogger(__name__)


def short_name(name: str, limit: int = 96) -> str:
    """A run directory name (and run id): Hydra's override string, or its head plus a hash when too long.

    `/` in a value (e.g. `model.checkpoint=/a/ckpt`) is written `%2F` (and `%` as `%25`), so the name
    is one folder, never a nested path, and stays unique: two checkpoints ending in the same folder
    name do not share a run id.
    """
    if not name:
        return "default"
    safe = name.replace("%", "%25").replace("/", "%2F")
    if len(safe) <= limit:
        return safe
    return f"{safe[: limit - 17]}~{hashlib.sha1(name.encode()).hexdigest()[:16]}"


def or_default(value: str | None, default: str) -> str:
    """`value` unless it is unset: `hydra.run.dir: ${or_default:${out_dir},...}` honours out_dir."""
    return default if value in (None, "") else str(value)


if not OmegaConf.has_resolver("short_name"):
    OmegaConf.register_new_resolver("short_name", short_name)
if not OmegaConf.has_resolver("or_default"):
    OmegaConf.register_new_resolver("or_default", or_default)


def old_preset_spelling(args: list[str]) -> str | None:
    """The one line that refuses the old spelling of a preset, or None when `args` do not use it.

    Presets (`experiments/conf/preset/NAME.yaml`) are the config group `preset`: `+preset=smoke` loads
    one, and `experiment=NAME` is the run's name alone, so a preset and a name go together
    (`+preset=smoke experiment=mine`). The group was once called `experiment` too: `+experiment=smoke`.
    """
    for arg in args:
        key, sep, name = arg.partition("=")
        if sep and key == "+experiment":
            return f"`{arg}` is now `+preset={name}` (experiment=NAME names the run)"
    return None


def refuse_old_preset_spelling(args: list[str]) -> None:
    """Exit (status 1) with `old_preset_spelling`'s line when `args` use the old spelling."""
    line = old_preset_spelling(args)
    if line is not None:
        raise SystemExit(f"error: {line}")


def interrupted_line(out_dir: str | Path, checkpoint_every: int) -> str:
    """The one line a Ctrl-C ends with: where the run stopped and what rerunning the command does."""
    done = int(read_status(out_dir).get("steps_done", 0))
    saved = done // checkpoint_every * checkpoint_every if checkpoint_every else 0
    if saved:
        return f"interrupted after step {done}: rerun the same command to resume from step {saved} ({out_dir})"
    return (
        f"interrupted after step {done}, before its first checkpoint (checkpoint_every={checkpoint_every}): "
        f"rerunning the same command starts the run over ({out_dir})"
    )


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The typed config object (Hydra has already checked the types against the dataclasses)."""
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, TrainConfig):
        raise TypeError(f"expected a TrainConfig-structured config, got {type(obj).__name__}")
    return obj


def finished_status(out_dir: str | Path, cfg: TrainConfig) -> str | None:
    """The status of a run directory whose outputs are complete, else None.

    A finished directory of another config is an error, not a run to skip or overwrite.
    """
    path = Path(out_dir) / "status.json"
    try:
        doc = json.loads(path.read_text())
        status = doc["status"]
    except (OSError, ValueError, KeyError):
        return None
    if status not in FINISHED or not (Path(out_dir) / "metrics.parquet").is_file():
        return None
    if doc.get("config_hash") != config_hash(cfg):
        raise RunDirectoryError(
            f"{out_dir} holds a finished run of another config; choose another directory or delete it"
        )
    return status


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
    done = finished_status(train_cfg.out_dir, train_cfg)
    if done is not None:
        log.info("skipping %s: already %s", train_cfg.out_dir, done)
        return done
    return train(train_cfg, checked=True)["status"]  # validated and its folder checked: once per launch


class SweepProgress(Callback):
    """Hydra callback: after each job of a multirun, log "k of n runs done" and the sweep's ETA.

    Jobs may run in other processes (joblib, submitit), so the count lives in the sweep folder:
    `.sweep_progress/start.json` (n and the start time) and one marker file per finished job.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        folder = Path(config.hydra.sweep.dir) / ".sweep_progress"
        folder.mkdir(parents=True, exist_ok=True)
        for marker in folder.glob("job-*"):
            marker.unlink()
        (folder / "start.json").write_text(json.dumps({"n": sweep_size(config), "start": time.time()}))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.types import RunMode

        if config.hydra.mode != RunMode.MULTIRUN:
            return
        folder = Path(config.hydra.sweep.dir) / ".sweep_progress"
        try:
            start = json.loads((folder / "start.json").read_text())
        except (OSError, ValueError):
            return  # a single run, or the sweep folder was moved
        (folder / f"job-{config.hydra.job.num}").touch()
        done = len(list(folder.glob("job-*")))
        n = start["n"]
        eta = eta_seconds(done, n, time.time() - start["start"]) if n else float("nan")
        log.info("%d of %s runs done (sweep ETA %s)", done, n or "?", format_duration(eta))


def sweep_size(config: DictConfig) -> int | None:
    """Number of jobs the basic sweeper makes of `hydra.sweeper.params` plus the command line."""
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
        overrides = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
        return sum(len(batch) for batch in BasicSweeper.split_arguments(overrides, None))
    except Exception:  # noqa: BLE001 - another sweeper (e.g. optuna): the count stays unknown
        return None
