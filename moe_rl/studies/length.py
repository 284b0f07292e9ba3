"""Does length change the answer? The length study: GRPO with and without replay, GSPO and their kin at responses of
4 to 32 digits, each length at the lr that gives grpo+none the same early per-update KL
(`experiments/conf/preset/length.yaml`, declared before its runs; `python experiments/length.py`).

A length L is a task whose response length the run holds fixed (reasoning-gym's `basic_arithmetic`, two L-digit
addends: the answer's L or L + 1 digits each hang on a carry, so per-token difficulty does not fall with L), with a
pool of 6 cold starts of its own; a level is a target early per-update KL of grpo+none, reached at each length by its
own lr (`experiments/calibrate_kl.py`, cached in results/calibration/kl.json). Every arm runs at its length's level lr,
so arms pair on (pool member, seed) within a length; across lengths the pool member is the unit a trend over log L is
fitted on (each member's slope, then the slopes' mean with an interval over members, `trend`). A member is its pool
index and the environment its start was warmed in (`member_of`): the same index warmed on another CPU model or
library version is another SFT trajectory, so runs pair within a member. But the two start from the same initial
weights and the same data order, so they are not independent: the unit of replication (`unit`), which every count of
starts, interval and p reads, is the pool index, and twins warmed on two machines are one unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from moe_rl.analysis.clustered import (
    MIN_UNITS,
    clustered_compare,
    descriptive_reason,
    hierarchical_bootstrap,
    paired_by_start,
)
from moe_rl.analysis.configs import run_meta
from moe_rl.analysis.dose import kl_per_run
from moe_rl.metrics import names
from moe_rl.studies import frontier as fr_

PRESET = "length.yaml"
POOL = 6  # cold starts per length and warm-up environment: a run's pool member is its seed mod 6 (`member_of`)


@dataclass(frozen=True)
class Level:
    name: str
    kl: float  # the target early per-update KL of grpo+none
    lr: dict[int, float]  # per length


@dataclass(frozen=True)
class Block:
    levels: tuple[str, ...]
    lengths: tuple[int, ...]
    arms: tuple[str, ...]  # arm files (experiments/conf/arm/)
    seeds: tuple[int, ...]


@dataclass(frozen=True)
class Spec:
    lengths: tuple[int, ...]
    overrides: tuple[str, ...]  # the task overrides that pin a length, `{L}` and `{new}` (max_new_tokens) filled in
    new_tokens: int  # max_new_tokens = L + this (the sum's extra digit, eos and one spare)
    levels: dict[str, Level]
    blocks: tuple[Block, ...]  # in run order
    claims_level: str  # the level claims 2, 3, 12 and 13 are decided at

    def task_overrides(self, length: int) -> list[str]:
        return [o.format(L=length, new=length + self.new_tokens) for o in self.overrides]


def load_spec(presets: Path) -> Spec:
    spec = yaml.safe_load((Path(presets) / PRESET).read_text())["analysis"]["length"]
    lengths = tuple(int(x) for x in spec["lengths"])
    levels = {
        n: Level(n, float(v["kl"]), {int(k): float(x) for k, x in v["lr"].items()}) for n, v in spec["levels"].items()
    }
    for level in levels.values():
        if set(level.lr) != set(lengths):
            raise ValueError(f"length preset: level {level.name} gives lrs for {sorted(level.lr)}, not {list(lengths)}")
    blocks = []
    for block in spec["blocks"]:
        ls = tuple(int(x) for x in block.get("lengths", lengths))
        if any(lv not in levels for lv in block["levels"]) or not set(ls) <= set(lengths):
            raise ValueError(f"length preset: unknown level in {block['levels']} or length in {list(ls)}")
        blocks.append(Block(tuple(block["levels"]), ls, tuple(block["arms"]), tuple(int(x) for x in block["seeds"])))
    if spec["claims_level"] not in levels:
        raise ValueError(f"length preset: claims_level {spec['claims_level']!r} is not a level")
    return Spec(
        lengths,
        tuple(spec["overrides"]),
        int(spec["new_tokens"]),
        levels,
        tuple(blocks),
        str(spec["claims_level"]),
    )


def jobs(spec: Spec) -> list[tuple[str, int, tuple[str, ...], float, tuple[int, ...]]]:
    """(level, length, arms, lr, seeds) per multirun, in run order: per block, per level, per length."""
    return [
        (level, length, b.arms, spec.levels[level].lr[length], b.seeds)
        for b in spec.blocks
        for level in b.levels
        for length in b.lengths
    ]


# the run means `per_run` reads beyond the frontier's (NaN where a run does not log them)
METRICS = {
    "flip": names.ROUTE_FLIP_RATE,  # old pass vs the updated policy
    "flip_rollout": names.route_key(names.ROLLOUT_VS_OLD, names.FLIP_RATE),  # rollout vs old pass
    "token_var": names.RATIO_TOKEN_VAR,
    "seq_var": names.RATIO_SEQ_VAR,
    "routing_var": names.RATIO_SPLIT_ROUTING_VAR,
    "weights_var": names.RATIO_SPLIT_WEIGHTS_VAR,
    "routing_share": names.RATIO_SPLIT_ROUTING_SHARE,
    "clip_low": names.RATIO_CLIPFRAC_LOW,
    "clip_high": names.RATIO_CLIPFRAC_HIGH,
    "response_len": names.ROLLOUT_RESPONSE_LEN,
    "rollout_s": names.TIME_ROLLOUT_S,
    "old_logp_s": names.TIME_OLD_LOGP_S,
    "update_s": names.TIME_UPDATE_S,
}
KEYS = (*fr_.KEYS, names.KL_UPDATE_K3, *METRICS.values())


def per_run(df: pd.DataFrame, spec: Spec) -> pd.DataFrame:
    """The frontier's per-run table with each run's length (run key `L`), level (the one whose lr at that length it
    ran at), pool member (`member_of`), realised early and mean per-update KL, each metric's run mean, the step's
    wall seconds (rollout + old pass + updates) and whether its cold start ended in the band (`in_band`)."""
    out = fr_.per_run(df).set_index("run", drop=False).rename_axis(None)
    info = df.drop_duplicates("run").set_index("run")
    out["L"] = info["L"].reindex(out.index) if "L" in info else np.nan
    for col in ("num_moe_layers", "top_k"):
        out[col] = info[col].reindex(out.index) if col in info else np.nan
    dirs = info["run_dir"].reindex(out.index) if "run_dir" in info else pd.Series(None, index=out.index)
    metas = [run_meta(d) for d in dirs]
    out["member"] = [member_of(int(seed), meta) for seed, meta in zip(out["seed"], metas, strict=True)]
    out["unit"] = [str(int(seed) % POOL) for seed in out["seed"]]
    out["level"] = [_level_of(spec, length, lr) for length, lr in zip(out["L"], out["lr"], strict=True)]
    out = out.join(kl_per_run(df))
    for col, key in METRICS.items():
        out[col] = df[df["key"] == key].groupby("run")["value"].mean().reindex(out.index)
    out["step_s"] = out[["rollout_s", "old_logp_s", "update_s"]].sum(axis=1, min_count=1)
    out["in_band"] = [bool((meta.get("cold_start") or {}).get("in_band", True)) for meta in metas]
    return out.reset_index(drop=True)


def member_of(seed: int, meta: dict[str, Any]) -> str:
    """A run's pool member: its seed mod 6 and the environment its start was warmed in (CPU vendor and model, torch
    and transformers versions, from its meta.json). Pinned numerics are bitwise per CPU model and the cold-start key
    holds the versions, so member k warmed elsewhere is another start (another SFT trajectory), its own unit."""
    cpu, versions = meta.get("cpu") or {}, meta.get("versions") or {}
    env = " ".join(
        str(x) for x in (cpu.get("vendor"), cpu.get("model"), versions.get("torch"), versions.get("transformers")) if x
    )
    return f"{seed % POOL} ({env})" if env else str(seed % POOL)


def analysed(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs every contrast, trend and claim reads: those at a level whose pool member's warm-up ended in the band
    (a start the warm-up left outside it, at greedy accuracy 0 after cold_start.max_steps, is one RL cannot move
    either way; its runs are reported, not compared)."""
    return runs[runs["level"].notna() & runs["in_band"]].reset_index(drop=True)


def _level_of(spec: Spec, length: object, lr: float) -> str | None:
    if length is None or pd.isna(length) or int(length) not in spec.lengths:  # type: ignore[call-overload]
        return None
    found = [n for n, lv in spec.levels.items() if np.isclose(lv.lr[int(length)], lr, rtol=1e-6)]  # type: ignore[call-overload]
    return found[0] if found else None


def arm_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (level, length, arm): runs, starts, the mean accuracy change with its start-clustered interval, the share
    collapsed, the realised early KL and each metric's mean over runs."""
    records = []
    for (level, length, arm), g in runs.groupby(["level", "L", "arm_file"], sort=True):
        starts = g["unit"].nunique()
        rec: dict[str, Any] = {"level": level, "L": int(length), "arm": arm, "runs": len(g), "starts": starts}
        reason = descriptive_reason(starts)
        est, lo, hi = hierarchical_bootstrap(g["change"], g["unit"])
        rec.update(change=est, change_lo=np.nan if reason else lo, change_hi=np.nan if reason else hi)
        rec["collapsed"] = float(g["collapsed"].mean())
        rec["kl_early"] = float(g["kl_early"].mean())
        for col in (*METRICS, "step_s"):
            rec[col] = float(g[col].mean())
        rec["descriptive"] = reason or ""
        records.append(rec)
    return pd.DataFrame(records)


def contrast(runs: pd.DataFrame, a: str, b: str, level: str, length: int, value: str = "change") -> dict[str, Any]:
    """Arm a - arm b at one level and length, paired on (pool member, seed) and clustered on the unit, with the
    realised early-KL ratio a / b."""
    at = runs[(runs["level"] == level) & (runs["L"] == length)]
    out = clustered_compare(
        at, arm_col="arm_file", a=a, b=b, value=value, start_col="member", cluster_col="unit", min_units=MIN_UNITS
    )
    ka = at[at["arm_file"] == a].set_index(["member", "seed"])["kl_early"]
    kb = at[at["arm_file"] == b].set_index(["member", "seed"])["kl_early"]
    both = ka.to_frame("a").join(kb.to_frame("b"), how="inner")
    out["kl_ratio"] = float(both["a"].mean() / both["b"].mean()) if len(both) else math.nan
    return {"a": a, "b": b, "level": level, "L": length, **out}


def member_values(runs: pd.DataFrame, level: str, value: str, a: str, b: str | None = None) -> pd.DataFrame:
    """Per (pool member, length) at `level`: arm a's mean of `value` over seeds, or with `b` the mean over seeds of
    the paired difference a - b (pairs on (member, seed) within the length)."""
    at = runs[runs["level"] == level]
    side = at[at["arm_file"] == a].set_index(["L", "member", "seed"])[value]
    if b is not None:
        other = at[at["arm_file"] == b].set_index(["L", "member", "seed"])[value]
        side = (side - other).dropna()
    return side.groupby(level=["L", "member"]).mean().rename("y").reset_index()


def slopes(values: pd.DataFrame, log_y: bool = False) -> pd.Series:
    """Each pool member's least-squares slope of y (or log y) against log L, over the lengths it has (2 or more)."""
    out = {}
    for member, g in values.groupby("member"):
        y = np.log(g["y"].to_numpy(float)) if log_y else g["y"].to_numpy(float)
        x = np.log(g["L"].to_numpy(float))
        keep = np.isfinite(y)
        if keep.sum() >= 2 and len(set(x[keep])) >= 2:
            out[member] = float(np.polyfit(x[keep], y[keep], 1)[0])
    return pd.Series(out, dtype=float, name="slope")


def trend(
    runs: pd.DataFrame, level: str, value: str, a: str, b: str | None = None, *, log_y: bool = False
) -> dict[str, Any]:
    """The trend of `value` (arm a, or the paired difference a - b) over log L at `level`: each pool member's slope
    (`slopes`), averaged within its unit, then the mean over units with a bootstrap interval and a sign-flip p over
    units (`paired_by_start`), and the lengths it spans; descriptive below 5 units (`n_starts`; `n_members` counts members)."""
    values = member_values(runs, level, value, a, b)
    s = slopes(values, log_y=log_y)
    units = runs.drop_duplicates("member").set_index("member")["unit"]
    out = paired_by_start(s.to_numpy(), units.reindex(s.index).to_numpy())  # twins' slopes averaged in their unit
    out["n_members"] = out.pop("n_pairs")
    lengths = sorted(int(x) for x in values["L"].unique())
    return {"value": value, "a": a, "b": b or "", "level": level, "lengths": lengths, "log_y": log_y, **out}


def only_blocks(spec: Spec, numbers: list[int]) -> Spec:
    """The spec with only the blocks numbered `numbers` (1-based, kept in the preset's order): a sweep run in parts."""
    bad = [n for n in numbers if not 1 <= n <= len(spec.blocks)]
    if bad:
        raise ValueError(f"--blocks {bad}: the preset has blocks 1..{len(spec.blocks)}")
    return replace(spec, blocks=tuple(b for i, b in enumerate(spec.blocks, 1) if i in numbers))
