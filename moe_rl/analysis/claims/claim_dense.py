"""Claim 7, the dense control: at this scale the instability is specific to MoE."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from moe_rl.analysis.claims.arms import compare_arms, comparison_text, counts_note, pair_runs
from moe_rl.analysis.claims.cells import cell_list, load_experiment
from moe_rl.analysis.claims.declared import Declared, looks_note
from moe_rl.analysis.claims.rules import (
    ACCURACY_MARGIN,
    ALPHA,
    INCONCLUSIVE,
    N_BOOT,
    NOT_REPRODUCED,
    REPRODUCED,
    UNTESTABLE_HERE,
    Claim,
    accuracy_points,
    fmt_p,
    set_robustness,
    would_change,
)
from moe_rl.analysis.collapse_definitions import COLLAPSE_DEFINITIONS, HISTORY_KEYS, MAIN_DEFINITION, definition_grid
from moe_rl.analysis.phase import cell_label, run_outcomes
from moe_rl.analysis.stats import paired_compare
from moe_rl.metrics.names import REWARD_MEAN

DENSE_CONTROL = "dense_control"
MOE_FAMILY, DENSE_FAMILY = "qwen3_moe", "qwen3_dense"  # the default model and its dense control (moe_rl.models)
MOE_CELLS = ["lr", "N", "algo_arm"]  # a control pair shares the cell and the algorithm arm, and the seed
START_STEPS = COLLAPSE_DEFINITIONS[MAIN_DEFINITION]["baseline_window"]  # a run's start reward: its first steps


def _by_family(outcomes: pd.DataFrame, df: pd.DataFrame) -> pd.DataFrame:
    """`outcomes` with the model family as the compared `arm` and the algorithm arm moved to `algo_arm`, so
    that `compare_arms` pairs the two models by (lr, N, algo_arm, seed); and the two continuous outcomes
    measured from each run's own start, since each model starts from its own cold start: `late_accuracy`
    minus `start_accuracy` (step 0), `reward_auc` minus the mean reward of the first START_STEPS steps."""
    rewards = df.loc[df["key"] == REWARD_MEAN, ["run", "step", "value"]].sort_values("step")
    start_reward = rewards.groupby("run")["value"].apply(lambda v: v.iloc[:START_STEPS].mean())
    frame = outcomes.rename(columns={"arm": "algo_arm"}).assign(arm=outcomes["family"].to_numpy())
    frame["late_accuracy_raw"], frame["reward_auc_raw"] = frame["late_accuracy"], frame["reward_auc"]
    frame["late_accuracy"] = frame["late_accuracy"] - frame["start_accuracy"]
    frame["reward_auc"] = frame["reward_auc"] - frame["run"].map(start_reward).to_numpy(float)
    return frame


def moe_degrading(frame: pd.DataFrame) -> pd.DataFrame:
    """Runs of both models (a `_by_family` frame) in the (lr, N, algorithm arm) cells where the MoE model's
    `late_accuracy` ends below its cold start's on average."""
    moe = frame[frame["arm"] == MOE_FAMILY]
    keep = moe.groupby(MOE_CELLS).filter(lambda g: g["late_accuracy"].mean() < 0)[MOE_CELLS].drop_duplicates()
    return frame.merge(keep, on=MOE_CELLS)


def own_start_drop(runs: pd.DataFrame) -> dict[str, float]:
    """Late accuracy minus the run's own cold-start accuracy (a `_by_family` frame's `late_accuracy`): mean
    with a bootstrap interval over runs and a one-sided sign-flip p that it is below 0 (`p_value`); `below`
    counts the runs that end below their start."""
    change = runs["late_accuracy"].to_numpy(float)
    r = paired_compare(change, np.zeros_like(change), alternative="less", n_resamples=N_BOOT)
    return {**r, "below": int((change < 0).sum()), "runs": len(runs)}


def _moe_specific_rule(versus: str, dense_drop_p: float) -> str:
    """Specific to MoE if the dense model beats the MoE model (`versus`, the primary-outcome verdict) and does
    not itself end below its cold start; not specific if it does, or if the MoE model is not worse."""
    if (np.isfinite(dense_drop_p) and dense_drop_p < ALPHA) or versus == NOT_REPRODUCED:
        return NOT_REPRODUCED
    return REPRODUCED if versus == REPRODUCED else INCONCLUSIVE


def _drop_text(name: str, d: dict[str, float]) -> str:
    return (
        f"{name} final - its cold start {100 * d['mean_diff']:+.1f} pp [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}], "
        f"{d['below']} of {d['runs']} runs below it (one-sided p = {fmt_p(d['p_value'])})"
    )


def per_cell_notes(sel: pd.DataFrame) -> list[str]:
    """Descriptive, per (lr, N) cell over both algorithm arms: each model's mean start -> final accuracy and
    runs below the start, and the claim's rule on that cell alone (no correction over cells)."""
    notes = []
    for values, g in sel.groupby(["lr", "N"], sort=True):
        if pair_runs(g, MOE_FAMILY, DENSE_FAMILY, MOE_CELLS).empty:
            continue
        cmp, dense = compare_arms(g, MOE_FAMILY, DENSE_FAMILY, MOE_CELLS), own_start_drop(g[g["arm"] == DENSE_FAMILY])
        parts = [
            f"{family} {100 * h['start_accuracy'].mean():.1f}% -> {100 * h['late_accuracy_raw'].mean():.1f}% "
            f"({int((h['late_accuracy'] < 0).sum())} of {len(h)} below the start)"
            for family, h in ((f, g[g["arm"] == f]) for f in (MOE_FAMILY, DENSE_FAMILY))
        ]
        acc = cmp.cont["late_accuracy"]
        notes.append(
            f"cell {cell_label(['lr', 'N'], values)} alone: " + "; ".join(parts) + f"; dense - MoE accuracy change "
            f"{100 * acc['mean_diff']:+.1f} pp [{100 * acc['lo']:+.1f}, {100 * acc['hi']:+.1f}] ({acc['n']} pairs); "
            f"the rule on this cell alone: {_moe_specific_rule(cmp.verdict, dense['p_value'])}"
        )
    return notes


def claim_moe_specific(root: Path, declared: Declared | None = None) -> Claim:
    c = Claim(
        7,
        "At this scale the instability is specific to MoE",
        "dense control of the phase map (this harness)",
        f"{DENSE_FAMILY} (the dense control: same attention and active width, no routing) vs {MOE_FAMILY}, paired by "
        "(lr, N, algorithm arm, seed), in the cells where the MoE model's mean final accuracy ends below its cold "
        "start's. The three primary outcomes of claim 2, measured from each run's own start since each model has "
        "its own cold start (accuracy change: final minus step-0 accuracy; reward AUC minus the mean reward of the "
        f"first {START_STEPS} steps: sign-flip test and bootstrap interval; time to collapse under the relative "
        "definition: log-rank stratified on the pairs; Holm over the three), and whether the dense runs end below "
        "their own cold start (accuracy change, one-sided sign-flip test). reproduced if "
        "the dense model beats the MoE model at p < 0.05 with no outcome favouring MoE, and does not end below its "
        "cold start at p < 0.05; not reproduced if the dense model ends below its cold start (the degradation needs "
        "no routing) or the MoE model is not worse (an outcome favours it, or the accuracy and reward AUC intervals "
        f"lie inside ±{ACCURACY_MARGIN}); inconclusive otherwise; {UNTESTABLE_HERE} without runs of both models or "
        "without a cell where the MoE model degrades. **fragile** when the grid of collapse definitions disagrees",
        experiment=DENSE_CONTROL,
    )
    df = load_experiment(root, DENSE_CONTROL, list(HISTORY_KEYS))
    if df is None:
        c.verdict, c.reason = UNTESTABLE_HERE, f"no runs of {DENSE_CONTROL}"
        return c
    outcomes = run_outcomes(df, {**COLLAPSE_DEFINITIONS, **definition_grid()})
    missing = sorted({MOE_FAMILY, DENSE_FAMILY} - set(outcomes["family"]))
    if missing:
        c.verdict, c.reason = UNTESTABLE_HERE, f"no runs of {missing} in {DENSE_CONTROL}"
        return c
    frame = _by_family(outcomes, df)
    looks = looks_note(c, declared, pd.Series("", index=frame.index), "")
    sel = moe_degrading(frame)
    pairs = pair_runs(sel, MOE_FAMILY, DENSE_FAMILY, MOE_CELLS)
    if pairs.empty:
        c.verdict, c.reason = UNTESTABLE_HERE, f"{MOE_FAMILY} ends below its cold start in no cell with paired runs"
        return c
    cmp = compare_arms(sel, MOE_FAMILY, DENSE_FAMILY, MOE_CELLS, looks=looks)
    dense = own_start_drop(sel[sel["arm"] == DENSE_FAMILY])
    moe = own_start_drop(sel[sel["arm"] == MOE_FAMILY])
    c.cells = f"{sel[MOE_CELLS].drop_duplicates().shape[0]} cell(s) where {MOE_FAMILY} degrades: " + cell_list(
        sel, MOE_CELLS
    )
    outcomes_text = comparison_text(
        cmp,
        accuracy="accuracy change",
        auc_name="reward AUC above the start reward",
        qualifier=", each from its own start",
    )
    c.statistic = f"{outcomes_text}; {_drop_text(DENSE_FAMILY, dense)}; {_drop_text(MOE_FAMILY, moe)}"
    c.test = "paired sign-flip (accuracy, reward AUC), log-rank on pairs (time to collapse); Holm; one-sided sign-flip (dense below its cold start)"
    c.p_value = cmp.p
    c.verdict = _moe_specific_rule(cmp.verdict, dense["p_value"])
    c.reason = f"dense vs MoE: {cmp.verdict} ({cmp.reason}); the dense control ends below its cold start: " + (
        f"yes (p = {fmt_p(dense['p_value'])})"
        if dense["p_value"] < ALPHA
        else f"not significantly (p = {fmt_p(dense['p_value'])})"
    )
    c.notes.append(counts_note(cmp))
    c.notes += per_cell_notes(sel)
    grid = {
        d: (_moe_specific_rule(v, dense["p_value"]), _moe_specific_rule(k, dense["p_value"]))
        for d, (v, k) in cmp.grid.items()
    }
    set_robustness(c, {d: v for d, (v, _) in grid.items()}, {d: k for d, (_, k) in grid.items()})
    c.plain = (
        f"We trained the dense control ({DENSE_FAMILY}: the same attention and as many parameters per token, no "
        f"routing) next to {MOE_FAMILY} from its own cold start, with the same seeds, in the cells where the MoE "
        f"model loses accuracy. Over {cmp.cont['late_accuracy']['n']} seed-matched pairs, each measured from its "
        f"own cold start, the dense model ended {accuracy_points(cmp.cont['late_accuracy']['mean_diff'])} the MoE model; "
        "the dense runs ended "
        f"{100 * dense['mean_diff']:+.1f} points from their own cold start ({dense['below']} of {dense['runs']} below "
        f"it), the MoE runs {100 * moe['mean_diff']:+.1f}. Verdict: **{c.verdict}**. What would change it: "
        f"{would_change(c.verdict)}."
    )
    return c
