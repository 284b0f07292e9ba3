"""Run identity: which config keys say what a run computes, and its hash (torch-free, so the analysis
can read a run's identity from its `config.yaml` without importing torch or transformers).

`moe_rl.config.config_hash(cfg)` is `identity_hash(cfg.to_dict())`; `identity_spec` is also what
`moe_rl.analysis.configs` compares between shipped runs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Keys that do not change what a run computes: excluded from its identity (`identity_hash`).
NOT_IDENTITY = (
    "out_dir",
    "results_dir",
    "experiment",
    "rung",
    "dry_run",
    "progress",
    "threads",
    "checkpoint_every",
    "keep_checkpoint",
    "logger",
    "log_every",
    "dist",
    "analysis",
    "signal",
)

# Keys added after runs were shipped: left out of the identity while at their default, so the
# shipped runs keep theirs. Synthetic task kwargs at their defaults are left out for the same reason.
ADDED_DEFAULTS: dict[str, dict[str, Any]] = {
    "model": {"dtype": "float32", "head_dim": None, "router_frozen": False, "router_dtype": "float32"},
    "rollout": {
        "engine": "hf",
        "engine_sync_every": 1,
        "is_correction": "none",
        "is_level": "token",
        "is_cap": 2.0,
        "is_low": 0.5,
        "is_high": 5.0,
        "staleness": 1,
        "policy_lag": 0,
    },
    "algo": {
        "tau_pos": None,
        "tau_neg": None,
        "router_shift": False,
        "router_shift_floor": 0.5,
        "kl_tau": None,
        "k_pos": None,
        "lambda_pos": None,
        "k_neg": None,
        "lambda_neg": None,
        "offpolicy_mask_delta": None,
        "aux_loss_coef": 0.0,
        "router_z_loss_coef": 0.0,
    },
    "optim": {
        "router_lr_scale": 1.0,
        "expert_lr_scale": 1.0,
        "mlp_lr_scale": 1.0,
        "name": "adamw",
        "eps": 1e-8,
        "expert_step": "plain",
    },
    "replay": {"threshold": 0.5, "split_every": 1},
    "task": {
        "path": None,
        "prompt_field": "prompt",
        "answer_field": "answer",
        "system_prompt": None,
        "split": "train",
        "chat_template": "auto",
        "reward": "exact",
        "gym": {"name": None, "kwargs": {}},
    },
    "cold_start": {
        "mode": "auto",
        "patience": None,
        "target": None,
        "target_metric": "greedy",
        "pool": 1,
        "n_train": None,
        "compile": False,
        "beta2": 0.999,
        "warmup_steps": 0,
    },
    "collapse": {"definition": "absolute", "baseline_window": 10, "accuracy_drop_frac": 0.5, "accuracy_patience": 2},
    "pass_at_k": {"k": [], "n": 8, "temperature": 1.0},
    # the shipped runs ran every route instrument on every step and row; a run that does too shares their
    # identity, a run at the leaner defaults (`moe_rl.config.MetricsConfig`) logs less and has its own
    # (kl/update_k3 reads the weights and moves no other number: a run at its defaults, rows and schedule, shares
    # the shipped identity)
    "metrics": {"route_every": 1, "split_rows": None, "update_kl_rows": 8, "update_kl_window": 20},
}
ADDED_TOP = {"numerics": "native", "compile": False}  # top-level keys added later, left out while at their default
# sections added later: left out entirely while every key is at its value in ADDED_DEFAULTS
ADDED_SECTIONS = ("pass_at_k", "metrics")


def identity_spec(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """`cfg_dict` without keys at the defaults in `ADDED_DEFAULTS` and task kwargs at their defaults."""
    from moe_rl.tasks.synthetic import explicit_task_kwargs  # torch-free (moe_rl.tasks loads the rest lazily)

    spec = {
        k: (dict(v) if isinstance(v, dict) else v)
        for k, v in cfg_dict.items()
        if k not in ADDED_TOP or v != ADDED_TOP[k]
    }
    for section, defaults in ADDED_DEFAULTS.items():
        if isinstance(spec.get(section), dict):
            spec[section] = {k: v for k, v in spec[section].items() if k not in defaults or v != defaults[k]}
            if section in ADDED_SECTIONS and not spec[section]:
                del spec[section]
    if isinstance(spec.get("task"), dict) and "kwargs" in spec["task"]:
        spec["task"]["kwargs"] = explicit_task_kwargs(spec["task"].get("name", ""), spec["task"]["kwargs"])
    return spec


def spec_hash(spec: dict[str, Any]) -> str:
    """16 hex digits of the SHA-256 of `spec` as sorted JSON (values JSON cannot hold as their str)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def identity_hash(cfg_dict: dict[str, Any]) -> str:
    """Identity of what a run computes, from its config as a dict (`TrainConfig.to_dict()`): the
    `identity_spec` of every key but `NOT_IDENTITY` and the cold-start cache folder, hashed."""
    spec = identity_spec({k: v for k, v in cfg_dict.items() if k not in NOT_IDENTITY})
    spec["cold_start"] = {k: v for k, v in spec["cold_start"].items() if k != "cache_dir"}
    return spec_hash(spec)
