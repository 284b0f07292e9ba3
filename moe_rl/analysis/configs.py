"""Which runs may be pooled: runs that share every config key except the seed.

The run keys in `metrics.parquet` (arm, lr, N, task, ...) do not say everything a run was: two
runs of one arm may differ in their reward function, step count, data file or temperature. A
report that pooled them would average unlike things. `config_label` reads each run's resolved
`config.yaml` and names, per run, the values of the config keys that differ between runs and that
no run key already shows; `group_checks` flags groups whose runs repeat a seed or differ in length.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from moe_rl.analysis.load import run_key_columns, runs
from moe_rl.run.identity import NOT_IDENTITY, identity_spec

# config keys a run key column already shows (moe_rl.loop.keys.run_keys)
SHOWN_BY_RUN_KEYS = {
    "experiment": "experiment",
    "algo.name": "algo",
    "replay.mode": "replay",
    "model.family": "family",
    "task.name": "task",
    "seed": "seed",
    "optim.updates_per_rollout": "N",
    "optim.lr": "lr",
    "rollout.dtype": "rollout_dtype",
    "model.num_layers": "num_layers",
    "model.num_experts": "num_experts",
    "model.top_k": "top_k",
}
# config keys that do not change what a run computes (excluded from its identity), and the seed; also
# `numerics` (pinned kernels sample what native ones do, to the last bit) and `collapse` (the in-loop
# label only: reports recompute collapse under their own definitions from the metrics)
NOT_COMPARED = (*NOT_IDENTITY, "seed", "cold_start.cache_dir", "device", "numerics", "collapse")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; lists become tuples so values can be compared and hashed."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = tuple(value) if isinstance(value, list) else value
    return out


def run_configs(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run (index `run`), one column per flattened config key of its `config.yaml`
    (NaN where a run has no config file or lacks the key). Keys added to the project after a run was
    made, and synthetic task kwargs, are left out while at their defaults (`identity_spec`), so old
    and new runs of one config compare equal."""
    rows = {}
    for run, run_dir in runs(df).set_index("run")["run_dir"].items():
        path = Path(str(run_dir)) / "config.yaml"
        rows[run] = flatten(identity_spec(yaml.safe_load(path.read_text()) or {})) if path.is_file() else {}
    return pd.DataFrame.from_dict(rows, orient="index")


def differing_keys(configs: pd.DataFrame, pool: Sequence[str] = (), run_keys: Sequence[str] = ()) -> list[str]:
    """Config keys whose value differs between runs, leaving out those a run key shows (`run_keys`:
    the frame's run-key columns), those that do not change what a run computes, and those in `pool`
    (config keys or run keys)."""
    pooled = set(pool) | {k for k, v in SHOWN_BY_RUN_KEYS.items() if v in pool}
    shown = set(SHOWN_BY_RUN_KEYS) | set(run_keys)

    def compared(key: str) -> bool:
        return not any(key == n or key.startswith(f"{n}.") for n in NOT_COMPARED) and key not in shown | pooled

    return [k for k in configs.columns if compared(k) and configs[k].astype(str).nunique(dropna=False) > 1]


def config_label(df: pd.DataFrame, pool: Sequence[str] = ()) -> pd.Series:
    """Per run, `key=value` of every differing config key (`differing_keys`), joined by spaces; the
    same (empty) label for every run when their configs agree."""
    configs = run_configs(df)
    keys = differing_keys(configs, pool, run_key_columns(df))
    return pd.Series(
        {run: " ".join(f"{k}={_value(row[k])}" for k in keys) for run, row in configs.iterrows()},
        name="config",
        dtype=object,
    )


def with_config(df: pd.DataFrame, pool: Sequence[str] = ()) -> pd.DataFrame:
    """`df` with a `config` run-key column (`config_label`) when configs differ beyond the run keys, so
    that grouping keeps runs of different configs apart; `df` unchanged otherwise."""
    label = config_label(df, pool)
    if label.nunique() <= 1:
        return df
    out = df.copy()
    out.insert(list(df.columns).index("step"), "config", df["run"].map(label))
    return out


def group_checks(df: pd.DataFrame, groups: Sequence[str]) -> list[str]:
    """One line per group whose runs repeat a seed (not independent samples) or ran different numbers
    of steps (their means cover different stretches of training)."""
    table = runs(df)
    last = df.groupby("run")["step"].max()
    lines = []
    for values, g in table.groupby(list(groups), dropna=False, sort=True):
        values = values if isinstance(values, tuple) else (values,)
        name = ", ".join(f"{c}={v}" for c, v in zip(groups, values))
        repeated = g["seed"].value_counts()
        repeated = repeated[repeated > 1]
        for seed, n in repeated.items():
            listed = ", ".join(f"`{r}`" for r in g.loc[g["seed"] == seed, "run"])
            lines.append(f"- {name}: seed {seed} appears in {n} runs ({listed}): they are not independent samples")
        steps = last.reindex(g["run"])
        if steps.nunique() > 1:
            lines.append(
                f"- {name}: runs ran {steps.min()} to {steps.max()} steps; their means cover different "
                "stretches of training"
            )
    return lines


def _value(value: Any) -> str:
    return "null" if value is None or (isinstance(value, float) and pd.isna(value)) else str(value)


def run_starts(df: pd.DataFrame) -> pd.Series:
    """Per run, the cold start it began from, the unit of replication (`moe_rl.analysis.clustered`): the unit its
    meta.json records (`cold_start.unit`, the warm-up's recipe without library versions and numerics, which twins of
    one member warmed on two machines share), else its key (`cold_start.key`, the cached warm-up's config hash, or
    the checkpoint's fingerprint); where a run has none, its cold-start seed (`cold_seed`, else `cold_start.seed`
    in its config)."""
    out = {}
    for _, row in runs(df).iterrows():
        run_dir = Path(str(row["run_dir"]))
        meta = cold_start_meta(run_dir)
        key = meta.get("unit") or meta.get("key")
        if key is None:
            seed = row.get("cold_seed")
            if seed is None or pd.isna(seed):
                path = run_dir / "config.yaml"
                config = (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
                seed = (config.get("cold_start") or {}).get("seed", 0)
            key = f"cold_seed={int(seed)}"
        out[row["run"]] = str(key)
    return pd.Series(out, name="start", dtype=object)


def run_meta(run_dir: object) -> dict[str, Any]:
    """A run's meta.json ({} without a folder or the file)."""
    meta = Path(str(run_dir)) / "meta.json" if run_dir else None
    return json.loads(meta.read_text()) if meta is not None and meta.is_file() else {}


def cold_start_meta(run_dir: Path) -> dict[str, Any]:
    """The `cold_start` block of a run's meta.json (its key, SFT steps, covariates, ...); {} without one."""
    return run_meta(run_dir).get("cold_start") or {}


COVARIATES = ("greedy_accuracy", "sampled_reward", "sampled_entropy", "sft_steps")
COVARIATE_DIGITS = {"greedy_accuracy": 3, "sampled_reward": 3, "sampled_entropy": 2}


def start_covariates(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (family, start) of a per-run table (columns family, start, run_dir, and cold_seed where the runs
    log it): the start's covariates as its runs' meta.json records them (greedy held-out accuracy, sampled reward
    and entropy at temperature 1, SFT steps; NaN where none were recorded), its per-prompt pass-rate histogram
    (`pass_counts`: how many held-out prompts had 0, 1, ..., n of their n samples right, space-separated; "—" where
    not recorded) and how many runs began from it."""
    rows = []
    for (family, start), g in runs.groupby(["family", "start"], sort=True):
        meta = cold_start_meta(Path(str(g["run_dir"].iloc[0])))
        # runs from before the covariates were recorded keep the warm-up's own steps and greedy accuracy
        covariates = meta.get("covariates") or {"sft_steps": meta.get("steps"), "greedy_accuracy": meta.get("accuracy")}
        seed = g["cold_seed"].iloc[0] if "cold_seed" in g else None
        rec = {"family": family, "start": start, "cold_seed": "—" if seed is None or pd.isna(seed) else int(seed)}
        rec.update({k: float("nan") if covariates.get(k) is None else covariates[k] for k in COVARIATES})
        counts = covariates.get("pass_counts")
        rec["pass_counts"] = " ".join(str(int(c)) for c in counts) if counts else "—"
        rows.append({**rec, "runs": len(g)})
    return pd.DataFrame(rows, columns=["family", "start", "cold_seed", *COVARIATES, "pass_counts", "runs"])


def format_starts(starts: pd.DataFrame) -> str:
    if starts.empty:
        return "No start covariates recorded.\n"
    lines = [
        "| family | start | cold seed | SFT steps | greedy accuracy | sampled reward | entropy (nats) "
        "| prompts by samples right (0, 1, ..., n of n) | runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r in starts.iterrows():
        cells = [
            "—" if pd.isna(r["sft_steps"]) else str(int(r["sft_steps"])),
            *("—" if pd.isna(r[k]) else f"{r[k]:.{d}f}" for k, d in COVARIATE_DIGITS.items()),
            str(r.get("pass_counts", "—")).replace(" ", "/"),
        ]
        lines.append(f"| {r['family']} | {r['start']} | {r['cold_seed']} | {' | '.join(cells)} | {r['runs']} |")
    return "\n".join(lines) + "\n"
