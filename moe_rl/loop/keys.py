"""The columns that identify a run in every row of its metrics.parquet (analysis groups on them)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from moe_rl.loop.cold_start import pool_member, run_member
from moe_rl.routing.layers import find_moe_layers

if TYPE_CHECKING:
    from moe_rl.config import TrainConfig


def run_keys(cfg: TrainConfig, model: nn.Module) -> dict[str, Any]:
    """Columns that identify a run in every metrics row (analysis groups on them).

    Depth and expert count are read off the model, which a local checkpoint may set; a dense model
    has 0 MoE layers, experts and k. A run of an ablation ladder (`rung` set) adds its rung and cold-start seed,
    a run from a cold-start pool (`cold_start.pool` > 1) its member's cold-start seed and the member; a run with
    `rollout.staleness` or `rollout.policy_lag` set adds `S` or `lag`, and a run whose task pins its response length
    (`TaskConfig.fixed_length`) adds it as `L`.
    """
    layers = find_moe_layers(model, required=False)
    cold, pooled = cfg.cold_start, cfg.cold_start.pool > 1
    # a ladder's runs pair on the cold start's seed too (each rung trains its own per seed), a pool's runs group on it
    ladder = {"rung": cfg.rung} if cfg.rung is not None else {}
    start = {"cold_seed": run_member(cfg).seed} if cfg.rung is not None or pooled else {}
    member = {"cold_member": pool_member(cold, cfg.seed)} if pooled else {}
    # the staleness axes besides N (moe_rl.loop.staleness), where a run sets them
    stale = {"S": cfg.rollout.staleness} if cfg.rollout.staleness != 1 else {}
    stale |= {"lag": cfg.rollout.policy_lag} if cfg.rollout.policy_lag else {}
    length = cfg.task.fixed_length()
    return {
        "run": Path(cfg.out_dir).name,
        "experiment": cfg.experiment,
        "arm": cfg.arm,
        "algo": cfg.algo.name,
        "replay": cfg.replay.mode,
        "family": cfg.model.family,
        "task": cfg.task.name,
        "seed": cfg.seed,
        "N": cfg.optim.updates_per_rollout,
        "lr": cfg.optim.lr,
        "rollout_dtype": cfg.rollout.dtype,
        "num_layers": model.config.num_hidden_layers,
        "num_moe_layers": len(layers),
        "num_experts": layers[0].num_experts if layers else 0,
        "top_k": layers[0].top_k if layers else 0,
        **ladder,
        **start,
        **member,
        **stale,
        **({"L": length} if length is not None else {}),
    }
