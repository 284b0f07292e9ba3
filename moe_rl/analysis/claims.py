"""The papers' claims, each with a verdict computed from the result folders (DESIGN §7).

`evaluate_claims(results_root)` reads the folders named below (a missing folder gives
`inconclusive` with reason "no data") and `format_claims_markdown` writes results/CLAIMS.md with
the verdict rules next to the table. Every verdict follows one pattern: **reproduced** when the
predicted direction is significant (alpha 0.05; Holm where a claim runs several tests), **not
reproduced** when the opposite direction is significant or the interval of the effect lies inside
a margin too small to matter (collapse probability 0.10, accuracy 0.05, drift 10% of its level),
**inconclusive** otherwise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from moe_rl.analysis.collapse import ALTERNATIVE_DEFINITION, HISTORY_KEYS, MAIN_DEFINITION
from moe_rl.analysis.load import load_results, run_key_columns
from moe_rl.analysis.phase import cell_label, run_outcomes
from moe_rl.analysis.stats import (
    bootstrap_mean_ci,
    cmh_exact,
    collapse_test,
    event_aligned,
    holm,
    lagged_xcorr,
    paired_compare,
    wilson_interval,
)

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
ALPHA = 0.05
COLLAPSE_MARGIN = 0.10  # collapse probability difference too small to matter
ACCURACY_MARGIN = 0.05
DRIFT_MARGIN = 0.10  # relative to the shallow model's drift
PAPER_BAND = (0.05, 0.20)  # "~10% of activated experts change per update" (GSPO paper)
SHIFT_KEY = "route/old_vs_new/shift/mean"  # gamma in (0, 1]: 1 = the router did not move (moe_rl.routing.router_shift)
SHIFT_KEYS = (SHIFT_KEY + "/offpolicy", SHIFT_KEY)  # the off-policy mean (updates 2..N) where logged
SHIFT_AMOUNT = "router shift 1 - gamma"
CLIP_KEYS = ("ratio/clipfrac_low", "ratio/clipfrac_high")
MAX_LAG = 5
N_BOOT = 4999


@dataclass
class Claim:
    """One row of CLAIMS.md."""

    id: int
    claim: str
    source: str
    rule: str
    experiment: str = ""
    cells: str = ""
    statistic: str = ""
    test: str = ""
    p_value: float = math.nan
    verdict: str = INCONCLUSIVE
    reason: str = "no data"
    notes: list[str] = field(default_factory=list)


def runs_folder(root: Path, experiment: str) -> Path:
    """Where an experiment's runs live: root/experiment/runs (shipped layout), else root/experiment
    (a Hydra sweep written straight into results_dir)."""
    shipped = root / experiment / "runs"
    return shipped if shipped.is_dir() else root / experiment


def _load(root: Path, experiment: str, keys: list[str] | None) -> pd.DataFrame | None:
    folder = runs_folder(root, experiment)
    if not folder.is_dir() or not any(folder.rglob("metrics.parquet")):
        return None
    try:
        return load_results(folder, keys=keys)
    except FileNotFoundError:
        return None


def _pct(x: float) -> str:
    return "—" if not np.isfinite(x) else f"{100 * x:.1f}%"


def _p(p: float) -> str:
    return "—" if not np.isfinite(p) else f"{p:.3g}"


# --- claim 1: ~10% of activated experts change per update ------------------------------------------

def claim_expert_drift(root: Path) -> Claim:
    c = Claim(1, "~10% of activated experts change per gradient update (Qwen3-30B-A3B)", "GSPO, arXiv 2507.18071",
              f"reproduced if the extrapolated 95% interval of expert_flip_frac overlaps {list(PAPER_BAND)}; "
              "not reproduced if it lies entirely outside; inconclusive if the interval spans more than 10x "
              "(or reaches 0) or the fit's held-out R² < 0.5", experiment="drift_scaling (fit.json)")
    path = root / "drift_scaling" / "fit.json"
    if not path.is_file():
        return c
    try:
        doc = json.loads(path.read_text())
        m = doc["metrics"]["route/old_vs_new/expert_flip_frac/offpolicy"]
        pred, (lo, hi), r2 = float(m["predicted"]), (float(v) for v in m["ci"]), float(m["r2_holdout"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        c.reason = f"fit.json unreadable: {type(err).__name__}: {err}"
        return c
    target = doc.get("target", {})
    c.cells = "extrapolated to " + ", ".join(f"{k}={v}" for k, v in target.items())
    c.statistic = f"expert_flip_frac/offpolicy = {_pct(pred)} [{_pct(lo)}, {_pct(hi)}] (measured max {_pct(m.get('measured_max', math.nan))})"
    c.test = f"log-linear fit, held-out R² = {r2:.2f}"
    r3 = "(R3 paper, arXiv 2510.11370: ~10% of routers, ~94% of tokens)"
    o = doc["metrics"].get("route/old_vs_new/flip_rate/offpolicy")
    if o:
        c.notes.append(f"flip_rate: {_pct(o['predicted'])} [{_pct(o['ci'][0])}, {_pct(o['ci'][1])}] {r3}")
    # a share of tokens cannot pass 100%: the per-layer rate under independent layers is the estimate,
    # and the power law in L alone is shown only to say where it stops making sense
    o, t = doc["metrics"].get("route/old_vs_new/token_flip_rate/offpolicy"), doc.get("token_flip_from_layer_rate")
    if t:
        raw = f"; the power law in L alone gives {_pct(o['predicted'])}, which no share can reach" if (
            o and o["predicted"] > 1) else ""
        c.notes.append(f"token_flip_rate: {_pct(t['predicted'])} [{_pct(t['ci'][0])}, {_pct(t['ci'][1])}] from the "
                       f"per-layer rate, assuming layers flip independently{raw} {r3}")
    elif o:
        c.notes.append(f"token_flip_rate: {_pct(o['predicted'])} [{_pct(o['ci'][0])}, {_pct(o['ci'][1])}] {r3}")
    if doc.get("assumptions"):
        c.notes.append(f"assumes: {doc['assumptions']}")
    if not (np.isfinite(lo) and np.isfinite(hi)) or lo <= 0 or hi / lo > 10 or not r2 >= 0.5:
        c.verdict, c.reason = INCONCLUSIVE, f"interval too wide ({hi / lo if lo > 0 else math.inf:.3g}x) or R² {r2:.2f} < 0.5"
    elif hi >= PAPER_BAND[0] and lo <= PAPER_BAND[1]:
        c.verdict, c.reason = REPRODUCED, f"interval overlaps {list(PAPER_BAND)}"
    else:
        c.verdict, c.reason = NOT_REPRODUCED, f"interval entirely {'below' if hi < PAPER_BAND[0] else 'above'} {list(PAPER_BAND)}"
    return c


# --- collapse comparisons over the phase map -------------------------------------------------------

def _strata(outcomes: pd.DataFrame, a: str, b: str, definition: str, cells: list[str]) -> list[tuple]:
    """[(cell values, k_a, n_a, k_b, n_b, collapsed_a array, collapsed_b array)] for cells holding both arms."""
    col = f"collapsed_{definition}"
    out = []
    for values, g in outcomes.groupby(cells, sort=True):
        xa, xb = g.loc[g["arm"] == a, col].to_numpy(bool), g.loc[g["arm"] == b, col].to_numpy(bool)
        if len(xa) and len(xb):
            out.append((values, int(xa.sum()), len(xa), int(xb.sum()), len(xb), xa, xb))
    return out


def pooled_rate_difference(strata: list[tuple], *, seed: int = 0, n_boot: int = N_BOOT) -> tuple[float, float, float]:
    """Mean over cells of P(collapse | a) - P(collapse | b), with a 95% bootstrap interval that
    resamples runs within each cell and arm (cells weigh the same)."""
    if not strata:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    point = float(np.mean([xa.mean() - xb.mean() for *_, xa, xb in strata]))
    boot = np.zeros(n_boot)
    for *_, xa, xb in strata:
        boot += rng.choice(xa, (n_boot, len(xa))).mean(1) - rng.choice(xb, (n_boot, len(xb))).mean(1)
    boot /= len(strata)
    return point, float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))


def _compare_collapse(outcomes: pd.DataFrame, a: str, b: str, definition: str, cells: list[str]) -> dict:
    """a collapses more than b? Exact CMH both ways, pooled difference with interval, per-cell tests with Holm."""
    strata = _strata(outcomes, a, b, definition, cells)
    tables = [s[1:5] for s in strata]
    more, less = cmh_exact(tables, alternative="greater"), cmh_exact(tables, alternative="less")
    # The effect interval uses the cells the CMH test learns from: those where some runs collapse and
    # some do not. A cell where both arms always (or never) collapse has a difference of exactly 0 at
    # the floor or ceiling; averaging it in would shrink the interval towards 0 with every cell added.
    informative = [st for st in strata if 0 < st[1] + st[3] < st[2] + st[4]]
    diff = pooled_rate_difference(informative)
    per_cell = [collapse_test(*t, alternative="greater") if 0 < t[0] + t[2] < t[1] + t[3] else math.nan for t in tables]
    ka, na = sum(t[0] for t in tables), sum(t[1] for t in tables)
    kb, nb = sum(t[2] for t in tables), sum(t[3] for t in tables)
    return {"strata": strata, "p_more": more["p_value"], "p_less": less["p_value"], "odds_ratio": more["odds_ratio"],
            "diff": diff, "n_informative": len(informative), "per_cell_p": per_cell,
            "per_cell_holm": holm(per_cell), "ka": ka, "na": na, "kb": kb, "nb": nb,
            "any": ka + kb > 0}


def _direction_verdict(p_pred: float, p_opp: float, ci: tuple[float, float], margin: float) -> tuple[str, str]:
    if np.isfinite(p_pred) and p_pred < ALPHA:
        return REPRODUCED, f"predicted direction significant (p = {_p(p_pred)})"
    if np.isfinite(p_opp) and p_opp < ALPHA:
        return NOT_REPRODUCED, f"opposite direction significant (p = {_p(p_opp)})"
    lo, hi = ci
    if np.isfinite(lo) and np.isfinite(hi) and -margin < lo and hi < margin:
        return NOT_REPRODUCED, f"effect interval [{lo:.3g}, {hi:.3g}] inside ±{margin:g}"
    return INCONCLUSIVE, (f"neither direction significant (p = {_p(p_pred)}, reverse {_p(p_opp)}) and the effect "
                          f"interval [{lo:.3g}, {hi:.3g}] is not inside ±{margin:g}")


def _phase_outcomes(root: Path, experiment: str) -> pd.DataFrame | None:
    df = _load(root, experiment, list(HISTORY_KEYS))
    return None if df is None else run_outcomes(df)


def _cells_text(strata: list[tuple], cells: list[str]) -> str:
    names = [cell_label(cells, vals if isinstance(vals, tuple) else (vals,)) for vals, *_ in strata]
    return f"{len(names)} cell(s): " + "; ".join(names) if names else "no cells"


def claim_offpolicy_grpo(root: Path, outcomes: pd.DataFrame | None = None) -> Claim:
    c = Claim(2, "Off-policy (N >= 2), GRPO without replay is less stable than GRPO with R2",
              "GSPO 2507.18071; R3 2510.11370",
              "per off-policy (lr, N) cell, k of n collapsed for grpo+none vs grpo+r2; pooled over cells with the exact "
              "Cochran-Mantel-Haenszel test (one-sided, grpo+none more). reproduced if p < 0.05; not reproduced if the "
              f"reverse one-sided p < 0.05 or the pooled difference interval lies within ±{COLLAPSE_MARGIN} (mean over "
              "the cells where outcomes vary, i.e. not every run of both arms stable or collapsed: the cells the CMH "
              "test uses); "
              "inconclusive otherwise, or when neither arm collapses in any cell (the grid never reached instability)",
              experiment="phase")
    outcomes = _phase_outcomes(root, "phase") if outcomes is None else outcomes
    if outcomes is None:
        return c
    return _collapse_claim(c, outcomes, "grpo+none", "grpo+r2")


def _offpolicy(outcomes: pd.DataFrame) -> pd.DataFrame:
    return outcomes[outcomes["N"] >= 2] if "N" in outcomes else outcomes.iloc[0:0]


def _collapse_claim(c: Claim, outcomes: pd.DataFrame, a: str, b: str, cells: list[str] | None = None) -> Claim:
    cells = cells or [x for x in ("lr", "N") if x in outcomes]
    off = _offpolicy(outcomes)
    missing = [arm for arm in (a, b) if arm not in set(off["arm"])]
    if missing:
        c.reason = f"no off-policy runs of {missing}"
        return c
    verdicts = {}
    for definition in (MAIN_DEFINITION, ALTERNATIVE_DEFINITION):
        r = _compare_collapse(off, a, b, definition, cells)
        d, lo, hi = r["diff"]
        if not r["any"]:
            verdicts[definition] = (INCONCLUSIVE, "no collapse in either arm in any off-policy cell")
        else:
            verdicts[definition] = _direction_verdict(r["p_more"], r["p_less"], (lo, hi), COLLAPSE_MARGIN)
        if definition == MAIN_DEFINITION:
            c.cells = _cells_text(r["strata"], cells)
            wa, wb = wilson_interval(r["ka"], r["na"]), wilson_interval(r["kb"], r["nb"])
            c.statistic = (f"{a}: {r['ka']} of {r['na']} [{wa[0]:.2f}, {wa[1]:.2f}]; {b}: {r['kb']} of {r['nb']} "
                           f"[{wb[0]:.2f}, {wb[1]:.2f}]; mean difference over the {r['n_informative']} cell(s) "
                           f"where outcomes vary {d:+.2f} [{lo:+.2f}, {hi:+.2f}]")
            c.test = f"exact CMH one-sided, MH odds ratio {r['odds_ratio']:.3g}"
            c.p_value = r["p_more"]
            sig = [i for i, p in enumerate(r["per_cell_holm"]) if p < ALPHA]
            c.notes.append(f"per-cell Boschloo (one-sided), Holm over {int(np.isfinite(r['per_cell_p']).sum())} testable "
                           f"cells: {len(sig)} significant")
    c.verdict, c.reason = verdicts[MAIN_DEFINITION]
    alt = verdicts[ALTERNATIVE_DEFINITION]
    same = "same verdict" if alt[0] == c.verdict else "**verdict depends on the definition**"
    c.notes.append(f"{ALTERNATIVE_DEFINITION} collapse definition: {alt[0]} ({alt[1]}); {same}")
    c.reason = f"{MAIN_DEFINITION} definition: {c.reason}"
    return c


def claim_gspo_stable(root: Path, outcomes: pd.DataFrame | None = None) -> Claim:
    c = Claim(3, "GSPO is stable without routing replay", "GSPO, arXiv 2507.18071",
              "in the off-policy cells where grpo+none collapses at least once: reproduced if gspo+none collapses less "
              "than grpo+none (exact CMH one-sided p < 0.05) and not more than grpo+r2 (one-sided p >= 0.05); not "
              "reproduced if it collapses more than grpo+r2 (p < 0.05) or its difference to grpo+none lies within "
              f"±{COLLAPSE_MARGIN} (over the cells where outcomes vary); inconclusive otherwise, or when grpo+none never "
              "collapses", experiment="phase")
    outcomes = _phase_outcomes(root, "phase") if outcomes is None else outcomes
    if outcomes is None:
        return c
    off = _offpolicy(outcomes)
    arms = {"gspo+none", "grpo+none", "grpo+r2"}
    if not arms <= set(off["arm"]):
        c.reason = f"no off-policy runs of {sorted(arms - set(off['arm']))}"
        return c
    cells = [x for x in ("lr", "N") if x in off]
    verdicts = {}
    for definition in (MAIN_DEFINITION, ALTERNATIVE_DEFINITION):
        col = f"collapsed_{definition}"
        unstable = off.groupby(cells).filter(lambda g, col=col: g.loc[g["arm"] == "grpo+none", col].any())
        if unstable.empty:
            verdicts[definition] = (INCONCLUSIVE, "grpo+none never collapses off-policy: no unstable cell to test")
            continue
        vs_none = _compare_collapse(unstable, "gspo+none", "grpo+none", definition, cells)
        vs_r2 = _compare_collapse(unstable, "gspo+none", "grpo+r2", definition, cells)
        _, lo, hi = vs_none["diff"]
        if vs_none["p_less"] < ALPHA and not vs_r2["p_more"] < ALPHA:
            v = (REPRODUCED, (f"fewer collapses than grpo+none (p = {_p(vs_none['p_less'])}), not more than grpo+r2 "
                             f"(p = {_p(vs_r2['p_more'])})"))
        elif vs_r2["p_more"] < ALPHA:
            v = (NOT_REPRODUCED, f"more collapses than grpo+r2 (p = {_p(vs_r2['p_more'])})")
        elif -COLLAPSE_MARGIN < lo and hi < COLLAPSE_MARGIN:
            v = (NOT_REPRODUCED, f"as unstable as grpo+none: difference [{lo:+.2f}, {hi:+.2f}] within ±{COLLAPSE_MARGIN}")
        else:
            v = (INCONCLUSIVE, f"vs grpo+none p = {_p(vs_none['p_less'])}, vs grpo+r2 p = {_p(vs_r2['p_more'])}")
        verdicts[definition] = v
        if definition == MAIN_DEFINITION:
            c.cells = "unstable " + _cells_text(vs_none["strata"], cells)
            w = wilson_interval(vs_none["ka"], vs_none["na"])
            c.statistic = (f"gspo+none {vs_none['ka']} of {vs_none['na']} [{w[0]:.2f}, {w[1]:.2f}] vs grpo+none "
                           f"{vs_none['kb']} of {vs_none['nb']}, grpo+r2 {vs_r2['kb']} of {vs_r2['nb']}")
            c.test = "exact CMH one-sided (gspo+none < grpo+none; gspo+none > grpo+r2)"
            c.p_value = vs_none["p_less"]
    c.verdict, c.reason = verdicts[MAIN_DEFINITION]
    c.reason = f"{MAIN_DEFINITION} definition: {c.reason}"
    alt = verdicts[ALTERNATIVE_DEFINITION]
    same = "same verdict" if alt[0] == c.verdict else "**verdict depends on the definition**"
    c.notes.append(f"{ALTERNATIVE_DEFINITION} collapse definition: {alt[0]} ({alt[1]}); {same}")
    return c


# --- claim 4: drift grows with depth ----------------------------------------------------------------

def _run_means(df: pd.DataFrame, key: str) -> pd.Series:
    return df.loc[df["key"] == key].groupby("run")["value"].mean()


def claim_depth(root: Path) -> Claim:
    key = "route/old_vs_new/flip_rate/offpolicy"
    c = Claim(4, "Routing drift grows with depth", "R3, arXiv 2510.11370",
              "off-policy flip rate of the deepest vs the shallowest model (num_moe_layers, e.g. 8 vs 2), runs paired "
              "on every other run key (seed included); paired bootstrap 95% interval of the mean difference and a "
              "one-sided sign-flip test. reproduced if p < 0.05; not reproduced if the reverse p < 0.05 or the interval "
              f"lies within ±{DRIFT_MARGIN:.0%} of the shallow model's drift; inconclusive otherwise",
              experiment="drift_scaling")
    df = _load(root, "drift_scaling", None)
    if df is None:
        return c
    if "num_moe_layers" not in df or df["num_moe_layers"].nunique() < 2 or key not in set(df["key"]):
        c.reason = f"no runs differing in num_moe_layers that log {key}"
        return c
    depths = sorted(df["num_moe_layers"].unique())
    deep, shallow = (8 if 8 in depths else depths[-1]), (2 if 2 in depths else depths[0])
    info = df.drop_duplicates("run").set_index("run")
    frame = info[info["num_moe_layers"].isin([deep, shallow])].copy()
    frame["drift"] = _run_means(df, key)
    frame["tokens"] = _run_means(df, "route/old_vs_new/token_flip_rate/offpolicy")  # NaN where not logged
    on = [k for k in run_key_columns(df) if k not in ("run", "num_moe_layers", "num_layers")]
    frame = frame.reset_index()[[*on, "num_moe_layers", "drift", "tokens"]]

    def paired(column: str) -> pd.DataFrame | None:
        """Runs paired on every other key: columns deep, shallow; None when a depth has no value."""
        table = frame.pivot_table(index=on, columns="num_moe_layers", values=column, dropna=True)
        return table[[deep, shallow]].dropna() if deep in table and shallow in table else None

    pairs = paired("drift")
    if pairs is None:
        c.reason = "no paired runs"
        return c
    if len(pairs) < 2:
        c.reason = f"{len(pairs)} paired run(s): need >= 2"
        return c
    r = paired_compare(pairs[deep], pairs[shallow], alternative="greater", n_resamples=N_BOOT)
    r_rev = paired_compare(pairs[deep], pairs[shallow], alternative="less", n_resamples=N_BOOT)
    level = float(pairs[shallow].mean())
    c.cells = f"num_moe_layers {deep} vs {shallow}, {len(pairs)} pairs"
    c.statistic = (f"flip rate {_pct(pairs[deep].mean())} vs {_pct(level)}: difference {100 * r['mean_diff']:+.2f} pp "
                   f"[{100 * r['lo']:+.2f}, {100 * r['hi']:+.2f}], P(deeper > shallower) = {r['prob_improvement']:.2f}")
    c.test, c.p_value = "paired sign-flip, one-sided", r["p_value"]
    c.verdict, c.reason = _direction_verdict(r["p_value"], r_rev["p_value"], (r["lo"] / level, r["hi"] / level)
                                             if level > 0 else (math.nan, math.nan), DRIFT_MARGIN)
    if c.verdict == INCONCLUSIVE and 0.5 ** r["n"] >= ALPHA:
        c.reason += (f"; with {r['n']} pairs no sign-flip test can reach p < {ALPHA} (smallest one-sided p "
                     f"{0.5 ** r['n']:.3g}): more seeds per depth would settle it")
    # support: the share of tokens with a changed layer, on the same pairs (more layers, more chances)
    tp = paired("tokens")
    if tp is not None and len(tp) >= 2:
        t = paired_compare(tp[deep], tp[shallow], alternative="greater", n_resamples=N_BOOT)
        c.notes.append(f"support: tokens with a changed layer {_pct(tp[deep].mean())} ({deep} layers) vs "
                       f"{_pct(tp[shallow].mean())} ({shallow}): {100 * t['mean_diff']:+.1f} pp "
                       f"[{100 * t['lo']:+.1f}, {100 * t['hi']:+.1f}], {t['n']} pairs, one-sided p = {_p(t['p_value'])}")
    # support: within the deepest runs, deeper half of the layers vs the shallower half
    layer_keys = {k: int(k.rsplit("_", 1)[1]) for k in df["key"].unique()
                  if k.startswith("route/old_vs_new/flip_rate/layer_")}
    deep_runs = info.index[info["num_moe_layers"] == deep]
    if layer_keys and len(deep_runs) >= 2:
        sub = df[df["run"].isin(deep_runs) & df["key"].isin(layer_keys)]
        per = sub.assign(layer=sub["key"].map(layer_keys)).groupby(["run", "layer"])["value"].mean().unstack()
        half = per.shape[1] // 2
        if half:
            s = paired_compare(per.iloc[:, -half:].mean(1), per.iloc[:, :half].mean(1), n_resamples=N_BOOT)
            c.notes.append(f"support: in the {deep}-layer runs the deeper {half} layers flip {100 * s['mean_diff']:+.2f} pp "
                           f"[{100 * s['lo']:+.2f}, {100 * s['hi']:+.2f}] vs the shallower {half} (all-update per-layer "
                           f"flip rate, {s['n']} runs, p = {_p(s['p_value'])})")
    return c


# --- claim 5: with a gap and large N, R3 beats R2 --------------------------------------------------

R3_PAPER_GAP = "~10% of routers and 94% of tokens route differently between inference and training (Qwen3-30B-A3B)"
ENGINE_GAP_KEYS = ("rollout/logp_gap", "rollout/token_mult_prob_error", "rollout/logp_gap_over_ln2",
                   "route/rollout_vs_old/flip_rate", "route/rollout_vs_old/token_flip_rate")


def _r3_vs_r2(outcomes: pd.DataFrame) -> dict | None:
    """grpo+r3 vs grpo+r2 on collapse and final accuracy over the low-precision, large-N runs of
    `outcomes`: verdict, reason and the claim's text fields; None without runs of both arms."""
    sub = outcomes
    if "rollout_dtype" in sub:
        sub = sub[sub["rollout_dtype"] != "float32"]
    if "N" in sub and len(sub):
        big = sub["N"] >= 4
        sub = sub[big] if big.any() else sub[sub["N"] == sub["N"].max()]
    if not {"grpo+r2", "grpo+r3"} <= set(sub["arm"]):
        return None
    cells = [x for x in ("lr", "N") if x in sub]
    coll = _compare_collapse(sub, "grpo+r2", "grpo+r3", MAIN_DEFINITION, cells)  # r2 collapses more = R3 better
    on = [*cells, "seed"]
    a = sub[sub["arm"] == "grpo+r3"].set_index(on)["final_accuracy"]
    b = sub[sub["arm"] == "grpo+r2"].set_index(on)["final_accuracy"]
    joined = pd.concat([a.rename("r3"), b.rename("r2")], axis=1).dropna()
    acc = paired_compare(joined["r3"], joined["r2"], alternative="greater", n_resamples=N_BOOT)
    acc_rev = paired_compare(joined["r3"], joined["r2"], alternative="less", n_resamples=N_BOOT)
    favour_r3 = holm([coll["p_more"], acc["p_value"]])
    favour_r2 = holm([coll["p_less"], acc_rev["p_value"]])
    _, clo, chi = coll["diff"]
    out = {
        "cells": _cells_text(coll["strata"], cells),
        "statistic": (f"collapsed r2 {coll['ka']} of {coll['na']} vs r3 {coll['kb']} of {coll['nb']}; final accuracy "
                      f"r3 - r2 = {100 * acc['mean_diff']:+.1f} pp [{100 * acc['lo']:+.1f}, {100 * acc['hi']:+.1f}] "
                      f"({acc['n']} pairs, P(r3 > r2) = {acc['prob_improvement']:.2f})"),
        "test": f"exact CMH p = {_p(coll['p_more'])}, sign-flip p = {_p(acc['p_value'])} (one-sided, Holm below)",
        "p_value": float(np.nanmin(favour_r3)) if np.isfinite(favour_r3).any() else math.nan,
    }
    if np.nanmin(favour_r3, initial=np.inf) < ALPHA and not np.nanmin(favour_r2, initial=np.inf) < ALPHA:
        out["verdict"], out["reason"] = REPRODUCED, f"R3 better at Holm p = {_p(out['p_value'])}"
    elif np.nanmin(favour_r2, initial=np.inf) < ALPHA:
        out["verdict"], out["reason"] = NOT_REPRODUCED, f"R2 better at Holm p = {_p(np.nanmin(favour_r2))}"
    elif (-COLLAPSE_MARGIN < clo and chi < COLLAPSE_MARGIN and -ACCURACY_MARGIN < acc["lo"]
          and acc["hi"] < ACCURACY_MARGIN):
        out["verdict"], out["reason"] = NOT_REPRODUCED, "both differences within their margins"
    else:
        out["verdict"], out["reason"] = INCONCLUSIVE, "no significant difference and intervals wider than the margins"
    return out


def _engine_gap(root: Path) -> str:
    """Mean engine/trainer gap over all steps and runs of engine_mismatch (per-run means, then the mean)."""
    df = _load(root, "engine_mismatch", list(ENGINE_GAP_KEYS))
    if df is None or df.empty:
        return ""
    means = df.groupby(["run", "key"])["value"].mean().groupby("key").mean()
    parts = [f"{k.split('/', 1)[1]} {means[k]:.3g}" for k in ENGINE_GAP_KEYS if k in means]
    return ("measured engine (vLLM, bfloat16) vs trainer (float32) gap, mean over steps and runs: " + "; ".join(parts)
            + f". The R3 paper reports {R3_PAPER_GAP}: a different scale (a 30B model, long sequences), shown "
            "side by side, not compared")


def claim_r3_vs_r2(root: Path) -> Claim:
    c = Claim(5, "With a train/inference gap and large N, R3 beats R2", "arXiv 2512.01374",
              "runs with rollouts from a real inference engine (vLLM in bfloat16, float32 training) and the largest N "
              "(N >= 4 where present): grpo+r3 vs grpo+r2 on collapse "
              "(exact CMH over cells, one-sided) and final accuracy (paired by seed and cell: bootstrap interval, "
              "sign-flip test), Holm over the two. reproduced if either favours R3 at Holm p < 0.05 and neither favours "
              "R2; not reproduced if either favours R2 at Holm p < 0.05, or both intervals lie within their margins "
              f"(collapse ±{COLLAPSE_MARGIN}, accuracy ±{ACCURACY_MARGIN}); inconclusive otherwise. The same test on "
              "`phase_mismatch` (the gap emulated by casting the rollout model to bfloat16) is reported as a note",
              experiment="engine_mismatch")
    engine = _phase_outcomes(root, "engine_mismatch")
    emulated = _phase_outcomes(root, "phase_mismatch")
    result = _r3_vs_r2(engine) if engine is not None else None
    if emulated is not None and (e := _r3_vs_r2(emulated)) is not None:
        c.notes.append(f"emulated gap (`phase_mismatch`, bfloat16 cast of the rollout model): {e['verdict']} "
                       f"({e['reason']}); {e['statistic']}; {e['test']}")
    c.notes.append(_engine_gap(root))
    if result is None:
        c.reason = "no data" if engine is None else "no grpo+r2 and grpo+r3 runs with a low-precision engine rollout"
        return c
    c.cells, c.statistic, c.test, c.p_value = result["cells"], result["statistic"], result["test"], result["p_value"]
    c.verdict, c.reason = result["verdict"], result["reason"]
    return c


# --- claim 6: router shift leads clip bursts and collapse ------------------------------------------

def pooled_xcorr(df: pd.DataFrame, x_key: str, y_keys: tuple[str, ...], *, max_lag: int = MAX_LAG,
                 diff: bool = True) -> pd.DataFrame:
    """Per run `lagged_xcorr(x, sum of y_keys)` over steps (first differences when `diff`, so slow
    trends do not masquerade as a lead); one row per (run, lag) with r and n."""
    rows = []
    for run, g in df[df["key"].isin([x_key, *y_keys])].groupby("run"):
        wide = g.pivot_table(index="step", columns="key", values="value").sort_index()
        if x_key not in wide or not all(k in wide for k in y_keys) or len(wide) < 2 * max_lag + 5:
            continue
        x, y = wide[x_key].to_numpy(), wide[list(y_keys)].sum(axis=1, min_count=len(y_keys)).to_numpy()
        if diff:
            x, y = np.diff(x), np.diff(y)
        rows.append(lagged_xcorr(x, y, max_lag).assign(run=run))
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=["lag", "r", "n", "run"])


def lead_contrast(per_run: pd.DataFrame, *, seed: int = 0, n_boot: int = N_BOOT) -> dict:
    """Pooled r per lag (mean over runs), its peak lag, and the lead contrast C = max r over lags > 0
    minus max r over lags <= 0 of the pooled curve, with a 95% percentile bootstrap interval that
    resamples runs (C > 0: x leads y more than it lags or moves with it)."""
    table = per_run.pivot_table(index="run", columns="lag", values="r").dropna()
    lags = np.asarray(table.columns)
    if table.empty or not (lags > 0).any() or not (lags <= 0).any():
        return {"n_runs": len(table)}
    values = table.to_numpy()
    pooled = values.mean(0)

    def contrast(curve: np.ndarray) -> np.ndarray:
        return curve[..., lags > 0].max(-1) - curve[..., lags <= 0].max(-1)

    rng = np.random.default_rng(seed)
    boot = contrast(values[rng.integers(0, len(values), (n_boot, len(values)))].mean(1))
    return {"n_runs": len(table), "mean_r": pd.Series(pooled, index=lags), "peak_lag": int(lags[pooled.argmax()]),
            "contrast": float(contrast(pooled)), "lo": float(np.quantile(boot, 0.025)),
            "hi": float(np.quantile(boot, 0.975))}


def claim_shift_leads(root: Path, experiments: tuple[str, ...] = ("phase", "phase_mismatch", "drift_scaling")) -> Claim:
    c = Claim(6, "Router shift leads clip bursts and collapse", "RSPO, arXiv 2510.23027",
              f"per run, Pearson correlation of the step-to-step change in the router shift 1 - `{SHIFT_KEY}` "
              "(its off-policy mean where logged; gamma = 1 when the router did not move) at t with the change in "
              f"clip fraction (low + high) at t + lag, lag -{MAX_LAG}..{MAX_LAG}, averaged over runs. reproduced if the "
              "pooled peak sits at a positive lag and the lead contrast (highest pooled r at a positive lag minus the "
              "highest at lag <= 0) has a 95% bootstrap interval over runs above 0; not reproduced if that interval "
              "lies below +0.05; "
              "inconclusive otherwise or with fewer than 3 runs. The shift before collapse events is reported as support",
              experiment="runs that log the shift metric")
    frames = []
    for exp in experiments:
        df = _load(root, exp, [*SHIFT_KEYS, *CLIP_KEYS, *HISTORY_KEYS])
        present = [k for k in SHIFT_KEYS if df is not None and k in set(df["key"])]
        if present:  # one series per run: the amount of shift 1 - gamma, so more shift is larger
            amount = df[df["key"] == present[0]].assign(key=SHIFT_AMOUNT, value=lambda f: 1.0 - f["value"])
            frames.append(pd.concat([df[~df["key"].isin(SHIFT_KEYS)], amount], ignore_index=True))
    if not frames:
        return c
    df = pd.concat(frames, ignore_index=True)
    c.experiment = ", ".join(sorted(df["experiment"].astype(str).unique())) if "experiment" in df else c.experiment
    per_run = pooled_xcorr(df, SHIFT_AMOUNT, CLIP_KEYS)
    res = lead_contrast(per_run) if len(per_run) else {"n_runs": 0}
    if res["n_runs"] < 3:
        c.reason = f"{res['n_runs']} run(s) with both series: need >= 3"
        return c
    c.cells = f"{res['n_runs']} runs, first differences, lags ±{MAX_LAG}"
    r_peak = float(res["mean_r"].loc[res["peak_lag"]])
    c.statistic = (f"peak r = {r_peak:.2f} at lag {res['peak_lag']:+d}; lead contrast {res['contrast']:+.3f} "
                   f"[{res['lo']:+.3f}, {res['hi']:+.3f}]")
    c.test = "bootstrap over runs"
    if res["peak_lag"] > 0 and res["lo"] > 0:
        c.verdict, c.reason = REPRODUCED, "shift changes precede clip-fraction changes"
    elif res["hi"] < 0.05:
        c.verdict, c.reason = NOT_REPRODUCED, (f"no lead of shift over the clip fraction (pooled peak at lag "
                                               f"{res['peak_lag']:+d})")
    else:
        c.verdict, c.reason = INCONCLUSIVE, f"peak at lag {res['peak_lag']:+d}, contrast interval includes small leads"
    c.notes.append("pooled r by lag: " + ", ".join(f"{int(k):+d}: {v:.2f}" for k, v in res["mean_r"].items()))
    c.notes.append(shift_before_collapse(df))
    return c


def shift_before_collapse(df: pd.DataFrame, *, before: int = 10, baseline: int = 30) -> str:
    """Support text: mean router shift (1 - gamma) in the `before` steps up to each collapse (main
    definition) minus its mean in the `baseline` steps before those, with a bootstrap interval over events."""
    from moe_rl.analysis.collapse import collapse_events

    ev = collapse_events(df[df["key"].isin(HISTORY_KEYS)], {MAIN_DEFINITION: _main_kwargs()})
    ev = ev[ev["collapsed"]]
    if ev.empty:
        return "no collapse events under the main definition: shift before collapse not measured"
    values = df.loc[df["key"] == SHIFT_AMOUNT, ["run", "step", "value"]]
    aligned = event_aligned(values, ev[["run", "step"]], before=before + baseline, after=0)
    near = aligned[aligned["offset"] >= -before].groupby("event")["value"].mean()
    far = aligned[aligned["offset"] < -before].groupby("event")["value"].mean()
    d = (near - far).dropna()
    if d.empty:
        return "collapse events too early to compare the shift before them with a baseline"
    mean, lo, hi = bootstrap_mean_ci(d.to_numpy(), n_resamples=N_BOOT)
    return (f"router shift (1 - gamma) in the {before} steps before {len(d)} collapse event(s) minus the {baseline} "
            "steps before those: "
            f"{mean:+.4f} [{lo:+.4f}, {hi:+.4f}]")


def _main_kwargs() -> dict:
    from moe_rl.analysis.collapse import COLLAPSE_DEFINITIONS

    return COLLAPSE_DEFINITIONS[MAIN_DEFINITION]


# --- all claims ------------------------------------------------------------------------------------

CLAIMS: tuple[Callable[[Path], Claim], ...] = (
    claim_expert_drift, claim_offpolicy_grpo, claim_gspo_stable, claim_depth, claim_r3_vs_r2, claim_shift_leads,
)


def evaluate_claims(root: str | Path) -> list[Claim]:
    """Every claim's verdict from the result folders under `root` (e.g. `results`)."""
    root = Path(root)
    outcomes = _phase_outcomes(root, "phase")
    out = []
    for fn in CLAIMS:
        try:
            out.append(fn(root, outcomes) if fn in (claim_offpolicy_grpo, claim_gspo_stable) else fn(root))
        except Exception as err:  # a malformed folder must not hide the other claims
            out.append(Claim(len(out) + 1, fn.__name__, "", "", verdict=INCONCLUSIVE,
                             reason=f"analysis failed: {type(err).__name__}: {err}"))
    return out


def format_claims_markdown(claims: list[Claim], root: str | Path = "results") -> str:
    """results/CLAIMS.md: the table, then per claim the rule, the reason and the notes."""
    lines = [
        "# Claims and verdicts",
        "",
        (f"Generated by `python -m moe_rl.report --claims` from the result folders under `{root}`; "
        "nothing here is typed by hand. Verdict pattern: **reproduced** when the predicted direction is significant "
        f"(alpha {ALPHA}, Holm where a claim runs several tests); **not reproduced** when the opposite direction is "
        "significant or the effect's interval lies within a margin too small to matter (collapse probability "
        f"{COLLAPSE_MARGIN}, accuracy {ACCURACY_MARGIN}, drift {DRIFT_MARGIN:.0%}); **inconclusive** otherwise, and "
        f"whenever the data are missing. Collapse uses the `{MAIN_DEFINITION}` definition (see "
        f"results/collapse_definitions.md); each collapse verdict is recomputed under `{ALTERNATIVE_DEFINITION}`."),
        "",
        "| # | claim | experiment and cells | statistic [95% interval] | test | p | verdict | why |",
        "|---:|:---|:---|:---|:---|---:|:---|:---|",
    ]
    esc = lambda s: str(s).replace("|", "\\|")
    for c in claims:
        lines.append(f"| {c.id} | {esc(c.claim)} ({esc(c.source)}) | {esc(c.experiment)}: {esc(c.cells) or '—'} | "
                     f"{esc(c.statistic) or '—'} | {esc(c.test) or '—'} | {_p(c.p_value)} | **{c.verdict}** | {esc(c.reason)} |")
    lines += ["", "## Rules and reasons", ""]
    for c in claims:
        lines += [f"### {c.id}. {c.claim}", "", f"- rule: {c.rule}", f"- verdict: **{c.verdict}** ({c.reason})"]
        lines += [f"- {n}" for n in c.notes if n]
        lines.append("")
    return "\n".join(lines)
