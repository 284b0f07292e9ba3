"""Glue between Hydra's composed config and the plain training function."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from moe_rl.config import TrainConfig, config_hash, validate

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


if not OmegaConf.has_resolver("short_name"):
    OmegaConf.register_new_resolver("short_name", short_name)

from moe_rl.runio import FINISHED


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
        raise ValueError(f"{out_dir} holds a finished run of another config; choose another directory or delete it")
    return status


def run_from_hydra(cfg: DictConfig, hydra_cfg: Any) -> str:
    from moe_rl.train import train

    train_cfg = validate(to_train_config(cfg))
    train_cfg.out_dir = hydra_cfg.runtime.output_dir
    cache = Path(train_cfg.cold_start.cache_dir)
    if not cache.is_absolute():  # shared by every job of a sweep, whatever the launcher's cwd
        train_cfg.cold_start.cache_dir = str(Path(hydra_cfg.runtime.cwd) / cache)
    if train_cfg.dry_run:
        log.info("dry run %s: %s", train_cfg.arm, train_cfg.out_dir)
        return "dry_run"
    done = finished_status(train_cfg.out_dir, train_cfg)
    if done is not None:
        log.info("skipping %s: already %s", train_cfg.out_dir, done)
        return done
    return train(train_cfg)["status"]
