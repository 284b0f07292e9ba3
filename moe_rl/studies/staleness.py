"""Staleness as the papers mean it: each method's edge along VESPO's rollout staleness and along an asynchronous lag.

Declared in `experiments/conf/preset/staleness.yaml` before its runs (`python experiments/staleness.py`).

Axes, each a row of arms at four or five values, every run from the pool of 6 cold starts and making the same 192
updates on the same number of samples: `rollout.staleness` = S (the rollout grows S-fold, one pass over it in S
updates: its oldest sample is S - 1 updates stale) and `rollout.policy_lag` = k (each rollout sampled by the policy k
updates old). A row's edge is where the isotonic fit of accuracy change on log(1 + age) crosses -5 pp, the age of a
rollout's oldest sample in updates (S - 1, or k), read back in the axis' units; past the last value it is censored
(">"), below the first it is "<". Intervals and paired comparisons resample cold starts, then seeds within each, with
one set of draws for every row of an axis (`moe_rl.analysis.dose`); below 5 starts a row is descriptive. A block
(`staleness_long`) can run an axis again on other values and seeds: its rows read only its own seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from moe_rl.analysis.clustered import descriptive_reason, paired_by_start, replicate_values, start_draws
from moe_rl.analysis.dose import crossing
from moe_rl.studies import frontier as fr_

PRESET = "staleness.yaml"
FAMILY = "qwen3_moe"
RUN_KEYS = {"rollout.staleness": "S", "rollout.policy_lag": "lag"}  # the run key each axis logs (where set)


@dataclass(frozen=True)
class Axis:
    name: str  # the override: rollout.staleness or rollout.policy_lag
    values: tuple[int, ...]
    rows: tuple[str, ...]  # arm files
    seeds: tuple[int, ...] = ()  # the seeds its runs use (none: any)
    key: str = ""  # its name in the preset, where a block runs an axis again (else the override)

    @property
    def label(self) -> str:
        return self.key or self.name

    def age(self, value: float) -> float:
        """The oldest sample's age in updates at `value` of this axis."""
        return value - 1 if self.name == "rollout.staleness" else value

    def value(self, age: float) -> float:
        return age + 1 if self.name == "rollout.staleness" else age


@dataclass(frozen=True)
class Spec:
    axes: tuple[Axis, ...]
    updates: int
    eval_updates: int
    seeds: tuple[int, ...]
    threshold: float

    def axis(self, label: str) -> Axis:
        return next(a for a in self.axes if a.label == label)


def load_spec(presets: Path) -> Spec:
    spec = yaml.safe_load((Path(presets) / PRESET).read_text())["analysis"]["staleness"]
    seeds = tuple(int(s) for s in spec["seeds"])
    axes = tuple(
        Axis(
            str(a.get("override", key)),
            tuple(int(v) for v in a["values"]),
            tuple(str(r) for r in a["rows"]),
            tuple(int(s) for s in a.get("seeds", seeds)),
            key if "override" in a else "",
        )
        for key, a in spec["axes"].items()
    )
    return Spec(axes, int(spec["updates"]), int(spec["eval_updates"]), seeds, float(spec["threshold"]))


def overrides(spec: Spec, axis: Axis, value: int) -> list[str]:
    """The overrides of one point: none at an axis' base value (S = 1, k = 0: the same run on both axes); S > 1 also
    keeps the updates and the evaluation spacing in updates (steps = updates / S rollouts, every eval_updates / S)."""
    if value == (1 if axis.name == "rollout.staleness" else 0):
        return []
    out = [f"{axis.name}={value}"]
    if axis.name == "rollout.staleness":
        if spec.updates % value or spec.eval_updates % value:
            raise ValueError(
                f"staleness {value} must divide updates {spec.updates} and eval_updates {spec.eval_updates}"
            )
        out += [f"steps={spec.updates // value}", f"eval_every={spec.eval_updates // value}"]
    return out


Job = tuple[tuple[str, ...], list[str], tuple[int, ...]]


def jobs(spec: Spec, labels: tuple[str, ...] = ()) -> list[Job]:
    """(arms, overrides, seeds) per multirun, axis by axis and value by value (of the axes `labels` names, or all);
    the base point first, once for every arm of the axes that share its seeds."""
    axes = [a for a in spec.axes if not labels or a.label in labels]
    if missing := set(labels) - {a.label for a in spec.axes}:
        raise ValueError(f"no axis {', '.join(sorted(missing))} in the preset: {', '.join(a.label for a in spec.axes)}")
    base: dict[tuple[int, ...], dict[str, None]] = {}
    for axis in axes:
        base.setdefault(axis.seeds, {}).update(dict.fromkeys(axis.rows))
    out: list[Job] = [(tuple(arms), [], seeds) for seeds, arms in base.items()]
    for axis in axes:
        out += [(axis.rows, overrides(spec, axis, v), axis.seeds) for v in axis.values if overrides(spec, axis, v)]
    return out


def per_run(df: pd.DataFrame) -> pd.DataFrame:
    """The frontier's per-run table with each run's staleness `S` and lag `lag` (1 and 0 where a run logs neither)."""
    out = fr_.per_run(df).set_index("run", drop=False).rename_axis(None)
    info = df.drop_duplicates("run").set_index("run")
    for key, default in (("S", 1), ("lag", 0)):
        col = info[key] if key in info else pd.Series(default, index=info.index)
        out[key] = col.reindex(out.index).fillna(default).astype(int)
    return out.reset_index(drop=True)


def on_axis(runs: pd.DataFrame, axis: Axis) -> pd.DataFrame:
    """The runs on one axis (of its seeds): the other axis at its base value, this one's value as `value` and its age
    in updates."""
    other = RUN_KEYS["rollout.policy_lag" if axis.name == "rollout.staleness" else "rollout.staleness"]
    base = 0 if other == "lag" else 1
    mine = runs["seed"].isin(axis.seeds) if axis.seeds else True
    sel = runs[(runs[other] == base) & (runs["family"] == FAMILY) & runs["arm_file"].isin(axis.rows) & mine].copy()
    sel["value"] = sel[RUN_KEYS[axis.name]]
    sel = sel[sel["value"].isin(axis.values)]
    sel["age"] = [axis.age(v) for v in sel["value"]]
    return sel


def edge(points: pd.DataFrame, axis: Axis, threshold: float) -> float:
    """A row's edge in the axis' units: the crossing of the fit on log(1 + age), inf past the grid, -inf below it."""
    found = crossing(1 + points["age"].to_numpy(float), points["change"].to_numpy(float), threshold)
    if math.isnan(found) or math.isinf(found):
        return found
    return -math.inf if found == 0 else axis.value(found - 1)


def edge_draws(on: pd.DataFrame, axis: Axis, threshold: float, draws: list) -> dict[str, np.ndarray]:
    """Per row, its edge on every drawn replicate (the same draws for every row: paired on starts and seeds)."""
    return {
        arm: replicate_values(on[on["arm_file"] == arm], lambda r: edge(r, axis, threshold), draws) for arm in axis.rows
    }


def axis_table(runs: pd.DataFrame, spec: Spec, axis: Axis, draws: list | None = None) -> tuple[pd.DataFrame, dict]:
    """Per row of the axis: runs, starts, the edge with its interval (none until every value has runs; descriptive
    while a value has fewer than 5 starts), mean change at each value; and the draws."""
    on = on_axis(runs, axis)
    draws = draws if draws is not None else start_draws(on[["start", "seed"]]) if len(on) else []
    drawn = edge_draws(on, axis, spec.threshold, draws)
    records = []
    for arm in axis.rows:
        own = on[on["arm_file"] == arm]
        rec: dict[str, object] = {"axis": axis.label, "row": arm, "runs": len(own), "starts": own["start"].nunique()}
        # an edge needs every value of the axis run by at least 5 starts (else the grid's end is not the data's)
        starts_per_value = own.groupby("value")["start"].nunique().reindex(list(axis.values), fill_value=0)
        reason = descriptive_reason(int(starts_per_value.min()))
        missing = [v for v, n in starts_per_value.items() if n == 0]
        if missing:
            reason = f"incomplete: no runs yet at {', '.join(map(str, missing))}"
        rec["descriptive"] = reason or ""
        rec["edge"] = edge(own, axis, spec.threshold) if len(own) and not missing else math.nan
        lo = hi = math.nan
        finite = drawn[arm][~np.isnan(drawn[arm])]
        if reason is None and len(finite):
            lo, hi = (float(v) for v in np.quantile(finite, [0.025, 0.975], method="inverted_cdf"))
        rec["edge_lo"], rec["edge_hi"] = lo, hi
        for value, g in own.groupby("value"):
            rec[f"change@{value}"] = float(g["change"].mean())
            rec[f"collapsed@{value}"] = float(g["collapsed"].mean())
        rec.update(span_loss(own, axis))
        records.append(rec)
    return pd.DataFrame(records), drawn


LOSS_KEYS = {"loss": "mean_diff", "loss_lo": "lo", "loss_hi": "hi", "loss_starts": "n_starts"}


def span_loss(own: pd.DataFrame, axis: Axis) -> dict[str, float]:
    """One row's accuracy change at the axis' last value minus at its first, paired on start and seed: `loss` (the
    mean of the starts' means), `loss_lo`, `loss_hi` (hierarchical interval, NaN below 5 starts) and `loss_starts`.
    A summary beside the edge, not part of any claim's rule: it reads how much of its gain a row gives up over the
    grid where no row crosses -5 pp."""
    ends = own[own["value"].isin([axis.values[0], axis.values[-1]])]
    wide = ends.pivot_table(index=["start", "seed"], columns="value", values="change", aggfunc="mean")
    out = {"loss": math.nan, "loss_lo": math.nan, "loss_hi": math.nan, "loss_starts": 0.0}
    if axis.values[0] not in wide or axis.values[-1] not in wide:
        return out
    d = (wide[axis.values[-1]] - wide[axis.values[0]]).dropna()
    if not len(d):
        return out
    r = paired_by_start(d.to_numpy(), d.index.get_level_values("start").to_numpy())
    return {key: float(r[name]) for key, name in LOSS_KEYS.items()}  # type: ignore[arg-type]


def axis_tables(runs: pd.DataFrame, spec: Spec) -> dict[str, tuple[pd.DataFrame, dict]]:
    """Every axis' `axis_table`, keyed by its label (two blocks of one override stay apart)."""
    return {axis.label: axis_table(runs, spec, axis) for axis in spec.axes}
