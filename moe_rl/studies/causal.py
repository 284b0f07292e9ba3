"""Is route drift a cause? The causal study: anchored routing and the load-aware expert step against the plain MoE
model, width- and lr-matched dense controls, at two per-update KL levels (`experiments/conf/preset/causal.yaml`,
declared before its runs; `python experiments/causal.py`).

An arm is a rung file (experiments/conf/rung/) with its reference model (`moe` or `dense`) and an lr multiplier;
a level is a target early per-update KL of grpo+none and the lr that reaches it on each reference model. Every arm
runs at its reference's level lr x its multiplier, from the pool of 6 cold starts of its own model x 2 seeds, so
arms pair on (start, seed) wherever they share a model; comparisons across models pair on the pool member (the
start's seed) and seed. Intervals resample starts, then seeds (`moe_rl.analysis.clustered`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from moe_rl.analysis.clustered import (
    MIN_UNITS,
    cluster_permutation_pvalue,
    clustered_compare,
    descriptive_reason,
    hierarchical_bootstrap,
)
from moe_rl.analysis.dose import kl_per_run
from moe_rl.metrics import names
from moe_rl.studies import frontier as fr_

PRESET = "causal.yaml"
ARM = "grpo_none"  # the preset's arm (rungs change the model, routing and optimizer, not the loss)
POOL = 6  # cold starts per model: a run's pool member is its seed mod 6


@dataclass(frozen=True)
class Arm:
    rung: str  # experiments/conf/rung/<rung>.yaml
    ref: str  # the reference model whose level lr it runs at: moe or dense
    lr_scale: float = 1.0


@dataclass(frozen=True)
class Level:
    name: str
    kl: float  # the target early per-update KL of grpo+none
    lr: dict[str, float]  # per reference model


@dataclass(frozen=True)
class Spec:
    seeds: tuple[int, ...]
    levels: dict[str, Level]
    blocks: tuple[tuple[tuple[str, ...], tuple[Arm, ...]], ...]  # (levels, arms) in run order
    claims: dict[int, tuple[str, str, str]]  # id -> (arm, against, level)

    def arm(self, rung: str) -> Arm:
        return next(a for _, arms in self.blocks for a in arms if a.rung == rung)

    def lr(self, rung: str, level: str) -> float:
        arm = self.arm(rung)
        return self.levels[level].lr[arm.ref] * arm.lr_scale


def load_spec(presets: Path) -> Spec:
    spec = yaml.safe_load((Path(presets) / PRESET).read_text())["analysis"]["causal"]
    levels = {n: Level(n, float(v["kl"]), {k: float(x) for k, x in v["lr"].items()}) for n, v in spec["levels"].items()}
    blocks = []
    for block in spec["blocks"]:
        arms = tuple(Arm(r, str(a["ref"]), float(a.get("lr_scale", 1.0))) for r, a in block["arms"].items())
        unknown = [a.ref for a in arms if a.ref not in ("moe", "dense")]
        if unknown or any(lv not in levels for lv in block["levels"]):
            raise ValueError(f"causal preset: unknown reference {unknown} or level in {block['levels']}")
        blocks.append((tuple(block["levels"]), arms))
    claims = {int(i): (str(a), str(b), str(lv)) for i, (a, b, lv) in spec["claims"].items()}
    return Spec(tuple(int(s) for s in spec["seeds"]), levels, tuple(blocks), claims)


def jobs(spec: Spec) -> list[tuple[str, tuple[str, ...], float]]:
    """(level, rungs, lr) per multirun, in run order: per block, per level, the block's arms grouped by their lr
    (arms at one lr share a multirun; the groups keep the block's order)."""
    out: list[tuple[str, tuple[str, ...], float]] = []
    for levels, arms in spec.blocks:
        for level in levels:
            groups: dict[float, list[str]] = {}
            for arm in arms:
                groups.setdefault(spec.lr(arm.rung, level), []).append(arm.rung)
            out += [(level, tuple(rungs), lr) for lr, rungs in groups.items()]
    return out


# the metric keys `per_run` reads beyond the frontier's: the realised KL and the mediators
MEDIATORS = {
    "flip": names.ROUTE_FLIP_RATE,
    "router_drift": names.OPTIM_ROUTER_DRIFT,
    "low_over_high": names.OPTIM_EXPERT_STEP_LOW_OVER_HIGH,
    "load_entropy": names.ROUTE_LOAD_ENTROPY,
}
KEYS = (*fr_.KEYS, names.KL_UPDATE_K3, *MEDIATORS.values(), "rung")


def per_run(df: pd.DataFrame, spec: Spec) -> pd.DataFrame:
    """The frontier's per-run table with each run's rung, level (the one whose lr x the arm's multiplier it ran at),
    pool member (seed mod 6), realised early and mean per-update KL, and each mediator's run mean (NaN where not
    logged)."""
    out = fr_.per_run(df, default_arm=ARM).set_index("run", drop=False).rename_axis(None)
    info = df.drop_duplicates("run").set_index("run")
    out["rung"] = info["rung"].reindex(out.index) if "rung" in info else np.nan
    out["member"] = out["seed"].astype(int) % POOL
    out["level"] = [_level_of(spec, r, lr) for r, lr in zip(out["rung"], out["lr"], strict=True)]
    out = out.join(kl_per_run(df))
    for col, key in MEDIATORS.items():
        out[col] = df[df["key"] == key].groupby("run")["value"].mean().reindex(out.index)
    return out.reset_index(drop=True)


def _level_of(spec: Spec, rung: object, lr: float) -> str | None:
    if not isinstance(rung, str) or not any(a.rung == rung for _, arms in spec.blocks for a in arms):
        return None
    found = [n for n in spec.levels if np.isclose(spec.lr(rung, n), lr, rtol=1e-6)]
    return found[0] if found else None


def arm_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (level, rung): runs, starts, mean accuracy change and its start-clustered interval, the share collapsed,
    the realised early KL (mean) and each mediator's mean."""
    records = []
    for (level, rung), g in runs.groupby(["level", "rung"], sort=False):
        starts = g["start"].nunique()
        rec: dict[str, object] = {"level": level, "rung": rung, "runs": len(g), "starts": starts}
        reason = descriptive_reason(starts)
        est, lo, hi = hierarchical_bootstrap(g["change"], g["start"])
        rec.update(change=est, change_lo=np.nan if reason else lo, change_hi=np.nan if reason else hi)
        rec["collapsed"] = float(g["collapsed"].mean())
        rec["kl_early"] = float(g["kl_early"].mean())
        for col in MEDIATORS:
            rec[col] = float(g[col].mean())
        rec["descriptive"] = reason or ""
        records.append(rec)
    return pd.DataFrame(records)


def contrast(runs: pd.DataFrame, a: str, b: str, level: str, value: str = "change") -> dict[str, object]:
    """Arm a - arm b at `level`, paired on (pool member, seed): the clustered comparison over pool members (one
    cold start per member within a model; across models, member m of each pool pairs), with the realised early-KL
    ratio a / b (mean over pairs) beside it."""
    at = runs[runs["level"] == level]
    out = clustered_compare(at, arm_col="rung", a=a, b=b, value=value, start_col="member", min_units=MIN_UNITS)
    ka = at[at["rung"] == a].set_index(["member", "seed"])["kl_early"]
    kb = at[at["rung"] == b].set_index(["member", "seed"])["kl_early"]
    both = ka.to_frame("a").join(kb.to_frame("b"), how="inner")
    out["kl_ratio"] = float(both["a"].mean() / both["b"].mean()) if len(both) else np.nan
    out["between_p"] = between_models_p(at[at["rung"] == a], at[at["rung"] == b], value)
    return {"a": a, "b": b, "level": level, **out}


def between_models_p(a: pd.DataFrame, b: pd.DataFrame, value: str = "change") -> float:
    """Where two arms began from disjoint cold starts (two models, each its own pool), the pairing on pool member is
    a convention: the two-sided p of a cluster permutation test, each start's mean `value` a unit, starts permuted
    between the arms (`clustered.cluster_permutation_pvalue`); NaN where the arms share starts (they pair on them)
    or one has fewer than MIN_UNITS starts."""
    if "start" not in a or "start" not in b:
        return float("nan")
    if set(a["start"]) & set(b["start"]) or min(a["start"].nunique(), b["start"].nunique()) < MIN_UNITS:
        return float("nan")
    return cluster_permutation_pvalue(a[value], a["start"], b[value], b["start"])
