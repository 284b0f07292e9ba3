"""The 1/sqrt(p_e) prediction, from `optim/expert_step/active` and `move_active` (`moe_rl.loop.expert_step`).

Under AdamW an expert that receives gradient on a share p_e of updates keeps a second moment near p_e g^2, so on
the updates it is used it moves about 1/sqrt(p_e) as far as an expert used in every update: the slope of log move
per active update on log p_e is -1/2. Per run and expert: p_e, the mean over instrumented steps of the share of
their updates in which the expert received any token, and its move, the mean RMS of its update over the updates in
which it was active (each step's mean weighted by its active updates). Per run, the least-squares slope over its
experts (0 < p_e; at least 3 distinct values of p_e, else the run has no slope); across runs the mean slope, each
cold start weighing the same, with the hierarchical bootstrap over starts (`clustered`). Below 5 starts the slope is
descriptive. Where nearly every expert is active in every update the p_e axis has no spread, and the prediction
cannot be tested: the table says how many experts fall below p_e = 0.9.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

from moe_rl.analysis.clustered import descriptive_reason, hierarchical_bootstrap
from moe_rl.metrics.names import OPTIM_EXPERT_ACTIVE, OPTIM_EXPERT_MOVE_ACTIVE

PREDICTED = -0.5
KEY = re.compile(r"^(?P<kind>active|move_active)/layer_(?P<layer>\d+)/expert_(?P<expert>\d+)$")
PREFIX = OPTIM_EXPERT_ACTIVE.rsplit("/", 2)[0] + "/"  # optim/expert_step/


def per_expert(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run, layer and expert that logged the instrument: p (share of updates active) and move (mean
    move RMS per active update; NaN if never active), from a long-format frame (columns run, step, key, value)."""
    rows = df[df["key"].str.startswith((OPTIM_EXPERT_ACTIVE, OPTIM_EXPERT_MOVE_ACTIVE))]
    if rows.empty:
        return pd.DataFrame(columns=["run", "layer", "expert", "p", "move"])
    parts = rows["key"].str.removeprefix(PREFIX).str.extract(KEY)
    wide = rows.assign(**parts).pivot_table(
        index=["run", "layer", "expert", "step"], columns="kind", values="value", aggfunc="first"
    )
    wide = wide.reindex(columns=["active", "move_active"])
    weighted = (wide["move_active"] * wide["active"]).groupby(level=[0, 1, 2]).sum(min_count=1)
    active = wide["active"].groupby(level=[0, 1, 2])
    out = pd.DataFrame({"p": active.mean(), "move": weighted / active.sum().where(active.sum() > 0)})
    out = out.reset_index()
    out[["layer", "expert"]] = out[["layer", "expert"]].astype(int)
    return out


def run_slope(experts: pd.DataFrame) -> float:
    """The least-squares slope of log move on log p over one run's experts (0 < p, move > 0); NaN with fewer than
    3 distinct values of p."""
    keep = (experts["p"] > 0) & (experts["move"] > 0)
    p, move = experts.loc[keep, "p"].to_numpy(float), experts.loc[keep, "move"].to_numpy(float)
    if len(np.unique(p)) < 3:
        return math.nan
    return float(np.polyfit(np.log(p), np.log(move), 1)[0])


def slope_test(experts: pd.DataFrame, starts: pd.Series) -> dict[str, object]:
    """Across runs (`starts`: run -> its cold start): runs with a slope, starts, the mean slope with its interval
    (or why it is descriptive), the predicted -1/2, and how many experts were active in fewer than 90% of updates."""
    slopes = experts.groupby("run").apply(run_slope, include_groups=False).dropna()
    units = starts.reindex(slopes.index)
    out: dict[str, object] = {"runs": len(slopes), "starts": int(units.nunique()), "predicted": PREDICTED}
    out["experts"] = len(experts)
    out["below_0.9"] = int((experts["p"] < 0.9).sum())
    out["descriptive"] = descriptive_reason(int(units.nunique())) or ""
    est, lo, hi = hierarchical_bootstrap(slopes.to_numpy(), units.to_numpy()) if len(slopes) else (math.nan,) * 3
    out["slope"] = est
    out["lo"], out["hi"] = (math.nan, math.nan) if out["descriptive"] else (lo, hi)
    return out


def _slope_text(t: dict[str, object]) -> str:
    ci = f" [{t['lo']:+.2f}, {t['hi']:+.2f}]" if not t["descriptive"] else f" ({t['descriptive']})"
    return f"{t['slope']:+.2f}{ci} over {t['runs']} runs from {t['starts']} starts"


def section(df: pd.DataFrame, starts: pd.Series, scaled: pd.Series | None = None) -> str:
    """The report's paragraph on the prediction (empty where no run logged the instrument). The test reads the
    plain-AdamW runs only: `scaled` (run -> bool) marks the runs whose expert step is scaled by its load (the
    load-aware step divides a low-load expert's step down by construction, which is not AdamW's doing); their slope
    is printed beside, apart."""
    experts = per_expert(df)
    if experts.empty:
        return ""
    scaled = pd.Series(False, index=starts.index) if scaled is None else scaled.reindex(starts.index).fillna(False)
    plain = experts[experts["run"].map(~scaled).fillna(True).astype(bool)]
    t = slope_test(plain, starts)
    text = (
        "## Does an expert used in fewer updates move further when used? (the 1/sqrt(p) prediction)\n\n"
        f"Slope of log move per active update on log p_e, plain-AdamW runs: {_slope_text(t)} (AdamW's second "
        f"moment alone predicts {PREDICTED:+.1f}); {t['below_0.9']} of {t['experts']} experts were active in fewer "
        "than 90% of the instrumented updates (with none, p_e has no spread to test on)."
    )
    if scaled.any():
        s = slope_test(experts[experts["run"].map(scaled).fillna(False).astype(bool)], starts)
        text += f" Load-aware runs, apart (their step is scaled by load by construction): {_slope_text(s)}."
    return text + "\n\n"
