"""The divergence frontier's own computation: each method's accuracy change against its realised per-update KL.

The study is declared in `experiments/conf/study/divergence.yaml` (as it ran; `python experiments/study.py
divergence`), which names this computation in its `sections` (`divergence_report.frontier_section`).

Each run's dose is its early per-update KL (`kl/update_k3`, k3 between the policy before and after each update on
the update's tokens, mean over steps 1..20) and its outcome its accuracy change (late accuracy, the mean of the last
3 evaluations, minus step 0). Per row, an isotonic (non-increasing) fit of change on log KL over every run of the row
at the study's N, and the crossing: the KL where the fit first falls below -5 pp (`moe_rl.analysis.dose`), "> max"
where it never does within the KLs seen, "< min" where it is below from the first. Intervals resample cold starts,
then seeds within each (9999 draws, one set per model family, whose starts are its own); headroom, a row's crossing
over grpo+none's, is the ratio on the same replicate: paired on starts within a family, independent across families.
Runs at one KL enter the fit as their mean; with fewer than 5 starts a row is descriptive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import numpy as np
import pandas as pd

from moe_rl.analysis.clustered import bootstrap, descriptive_reason, paired_by_start, replicate_values, start_draws
from moe_rl.analysis.dose import crossing, law_exponent, law_fit
from moe_rl.studies.design import Study

REFERENCE = ("qwen3_moe", "grpo_none")
THRESHOLD = -0.05  # the crossing: fitted mean accuracy change = -5 pp
FIT_LEVELS = ("x1", "x2", "x4")  # the declared grid (x0.5: the amended grid's runs, kept out of the fits)
LAW_ARM = "grpo_N2"  # the lr^2 N block
PRESET_N = 8  # the divergence preset's optim.updates_per_rollout: an arm's N where it sets none


@dataclass(frozen=True)
class Spec:
    rows: tuple[tuple[str, str], ...]  # (model family, arm file), in run order
    lrs: tuple[float, ...]
    lrs_by_family: dict[str, tuple[float, ...]]
    N: int
    seeds: tuple[int, ...]
    law_N: int
    law_rows: tuple[str, ...]
    law_lrs: tuple[float, ...]
    threshold: float

    def row_lrs(self, family: str) -> tuple[float, ...]:
        return self.lrs_by_family.get(family, self.lrs)


def _override(overrides: tuple[str, ...], key: str, default: str) -> str:
    return next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key), default)


def arm_facts(study: Study, arm: str) -> tuple[str, str, int]:
    """(model family, arm file, N) of a declared arm."""
    overrides = study.arms[arm].overrides
    family = _override(overrides, "model", REFERENCE[0])
    return (
        family,
        _override(overrides, "arm", REFERENCE[1]),
        int(_override(overrides, "optim.updates_per_rollout", str(PRESET_N))),
    )


def spec_of(study: Study) -> Spec:
    """The frontier's rows, grid and lr^2 N block, from the declaration."""
    rows = tuple(arm_facts(study, a)[:2] for a in study.arms if a != LAW_ARM)
    refs = {str(a.ref) for a in study.arms.values()}
    lrs = {ref: tuple(study.levels[lv].lr[ref] for lv in FIT_LEVELS) for ref in refs}
    by_family = {arm_facts(study, a)[0]: lrs[str(study.arms[a].ref)] for a in study.arms if a != LAW_ARM}
    by_family.pop(REFERENCE[0], None)
    law_N = arm_facts(study, LAW_ARM)[2]
    seeds = tuple(study.seeds(len(study.members)))
    return Spec(rows, lrs["moe"], by_family, PRESET_N, seeds, law_N, (REFERENCE[1],), lrs["law"], THRESHOLD)


def runs_of(study: Study, table: pd.DataFrame) -> pd.DataFrame:
    """A declared study's per-run table (`study_rule.per_run`) with what the frontier reads: each run's family, arm
    file, row, lr, N and early KL (`kl_early`: on the routes it acts with, its own for these arms)."""
    out = table.copy()
    facts = {a: arm_facts(study, a) for a in study.arms}
    out["family"] = [facts[a][0] for a in out["arm"]]
    out["arm_file"] = [facts[a][1] for a in out["arm"]]
    out["N"] = [facts[a][2] for a in out["arm"]]
    out["lr"] = [study.levels[lv].lr[str(study.arms[a].ref)] for a, lv in zip(out["arm"], out["level"], strict=True)]
    out["row"] = [row_name(f, a) for f, a in zip(out["family"], out["arm_file"], strict=True)]
    out["kl_early"] = out["kl_acting"]
    return out


def declared(runs: pd.DataFrame, spec: Spec) -> pd.DataFrame:
    """The runs at the declared points: each row's lrs at the study's N, the law's rows at its lrs and N (runs at
    other lrs, e.g. of a grid amended after a look, stay in the folder and out of the analysis)."""

    def at(lrs: tuple[float, ...], lr: float) -> bool:
        return any(math.isclose(lr, v, rel_tol=1e-9) for v in lrs)

    keep = []
    for family, arm, lr, n in zip(runs["family"], runs["arm_file"], runs["lr"].astype(float), runs["N"], strict=True):
        main = n == spec.N and (family, arm) in spec.rows and at(spec.row_lrs(family), lr)
        law = n == spec.law_N and family == REFERENCE[0] and arm in spec.law_rows and at(spec.law_lrs, lr)
        keep.append(main or law)
    return runs[np.array(keep, dtype=bool)]


def row_name(family: str, arm: str) -> str:
    return arm if family == REFERENCE[0] else f"{family}:{arm}"


def crossing_draws(own: pd.DataFrame, draws: list, threshold: float) -> np.ndarray:
    """A row's crossing on every drawn replicate (`clustered.replicate_values`)."""
    return replicate_values(own, lambda r: crossing(r["kl_early"], r["change"], threshold), draws)


def _interval(values: np.ndarray) -> tuple[float, float, float]:
    """(low, high, share undefined): the 95% percentile interval of draws (censored +inf and 0 included) and the
    share of draws that are NaN (a ratio of two crossings censored alike)."""
    defined = values[~np.isnan(values)]
    if not len(defined):
        return math.nan, math.nan, 1.0
    lo, hi = np.quantile(defined, [0.025, 0.975], method="inverted_cdf")
    return float(lo), float(hi), float(1 - len(defined) / len(values))


def frontier_table(runs: pd.DataFrame, spec: Spec, draws: dict[str, list] | None = None) -> pd.DataFrame:
    """One row per declared row at the study's N: runs, starts and seeds, the crossing KL with its interval (starts,
    then seeds, resampled: one set of draws per model family, whose starts are its own) and the headroom over
    grpo+none (the ratio of crossings on the same replicate: paired on starts within a family, independent
    across families), with the share of replicates where it is undefined; the median early KL and the mean change
    at each lr. Below `MIN_UNITS` starts a row is descriptive: no interval."""
    runs = declared(runs, spec)
    at_n = runs[runs["N"].astype(float) == spec.N]
    if draws is None:
        draws = {f: start_draws(g[["start", "seed"]]) for f, g in at_n.groupby("family")}
    ref_runs = at_n[at_n["row"] == REFERENCE[1]]
    ref_draws = crossing_draws(ref_runs, draws.get(REFERENCE[0], []), spec.threshold)
    ref = crossing(ref_runs["kl_early"], ref_runs["change"], spec.threshold) if len(ref_runs) else math.nan
    records = []
    for family, arm in spec.rows:
        name = row_name(family, arm)
        own = at_n[at_n["row"] == name]
        n_starts = own["start"].nunique()
        reason = descriptive_reason(n_starts)
        per_start = own.groupby("start")["seed"].nunique()
        seeds = int(per_start.max()) if len(per_start) else 0  # seeds per start (the most any start has)
        rec: dict[str, object] = {"row": name, "runs": len(own), "starts": n_starts, "seeds": seeds}
        rec["descriptive"] = reason or ""
        rec["nonfinite_kl"] = int((~np.isfinite(own["kl_early"].to_numpy(float))).sum())
        rec["collapsed"] = float(own["collapsed"].mean()) if len(own) else math.nan
        cross = crossing(own["kl_early"], own["change"], spec.threshold) if len(own) else math.nan
        rec["crossing"], rec["crossing_lo"], rec["crossing_hi"] = cross, math.nan, math.nan
        with np.errstate(divide="ignore", invalid="ignore"):
            rec["headroom"] = float(np.float64(cross) / np.float64(ref)) if name != REFERENCE[1] else math.nan
        rec["headroom_lo"], rec["headroom_hi"], rec["headroom_undefined"] = math.nan, math.nan, math.nan
        if reason is None:
            own_draws = crossing_draws(own, draws.get(family, []), spec.threshold)
            rec["crossing_lo"], rec["crossing_hi"], _ = _interval(own_draws)
            if name != REFERENCE[1] and descriptive_reason(ref_runs["start"].nunique()) is None:
                with np.errstate(divide="ignore", invalid="ignore"):
                    ratio = own_draws / ref_draws
                rec["headroom_lo"], rec["headroom_hi"], rec["headroom_undefined"] = _interval(ratio)
        for lr, g in own.groupby("lr"):
            rec[f"kl@{lr:g}"] = float(g["kl_early"].median())
            rec[f"change@{lr:g}"] = float(g["change"].mean())
        records.append(rec)
    return pd.DataFrame(records)


def _coefficient(frame: pd.DataFrame, y: str, i: int) -> float:
    return law_fit(frame, y)[i]


def law_table(runs: pd.DataFrame, spec: Spec, draws: list | None = None) -> pd.DataFrame:
    """The lr^2 N test on the law's rows (runs at both Ns): the exponent b / c of `log KL = row + b log lr +
    c log N` and of `change = row + b log lr + c log N`, each with its interval over starts; and the paired change
    between points of equal lr^2 N and of equal lr x N (the same start and seed at both)."""
    sel = declared(runs, spec)
    sel = sel[sel["arm_file"].isin(spec.law_rows) & (sel["family"] == REFERENCE[0])].copy()
    sel["log_kl"] = np.log(sel["kl_early"].where(sel["kl_early"] > 0))
    if sel.empty or sel["N"].nunique() < 2:
        return pd.DataFrame()
    draws = draws if draws is not None else start_draws(sel[["start", "seed"]])
    out = []
    for y, label in (("log_kl", "early per-update KL"), ("change", "accuracy change")):
        rec: dict[str, object] = {"outcome": label, "runs": len(sel)}
        rec["b_over_c"], rec["lo"], rec["hi"], _ = bootstrap(sel, partial(law_exponent, y=y), draws)
        for i, coef in enumerate(("b", "c")):  # each with its own interval: the ratio is unstable near c = 0
            rec[coef], rec[f"{coef}_lo"], rec[f"{coef}_hi"], _ = bootstrap(sel, partial(_coefficient, y=y, i=i), draws)
        out.append(rec)
    return pd.DataFrame(out)


def matched_pairs(runs: pd.DataFrame, spec: Spec) -> pd.DataFrame:
    """Pairs of (lr, N) points of the law's rows at equal lr^2 N or equal lr x N across the two Ns: the paired
    change and early-KL ratio (same start and seed), from `paired_by_start`."""
    sel = declared(runs, spec)
    sel = sel[sel["arm_file"].isin(spec.law_rows) & (sel["family"] == REFERENCE[0])]
    lo_n, hi_n = sorted((spec.law_N, spec.N))
    out = []
    points = sorted({(float(lr), int(n)) for lr, n in zip(sel["lr"], sel["N"], strict=True)})
    for lr_a, n_a in [p for p in points if p[1] == lo_n]:
        for lr_b, n_b in [p for p in points if p[1] == hi_n]:
            for law, power in (("lr^2 N", 2), ("lr N", 1)):
                if not np.isclose(lr_a**power * n_a, lr_b**power * n_b, rtol=1e-6, atol=0):
                    continue
                a = sel[np.isclose(sel["lr"], lr_a, atol=0) & (sel["N"] == n_a)].set_index(
                    ["arm_file", "start", "seed"]
                )
                b = sel[np.isclose(sel["lr"], lr_b, atol=0) & (sel["N"] == n_b)].set_index(
                    ["arm_file", "start", "seed"]
                )
                both = a.join(b, lsuffix="_a", rsuffix="_b", how="inner")
                starts = both.index.get_level_values("start")
                d = paired_by_start(both["change_a"] - both["change_b"], starts)
                r = paired_by_start(np.log(both["kl_early_a"] / both["kl_early_b"]), starts)
                out.append(
                    {
                        "equal": law,
                        "a": f"lr {lr_a:g}, N {n_a}",
                        "b": f"lr {lr_b:g}, N {n_b}",
                        "pairs": d["n_pairs"],
                        "starts": d["n_starts"],
                        "change_diff": d["mean_diff"],
                        "change_lo": d["lo"],
                        "change_hi": d["hi"],
                        "kl_ratio": float(np.exp(float(r["mean_diff"]))),  # type: ignore[arg-type]
                        "kl_ratio_lo": float(np.exp(float(r["lo"]))),  # type: ignore[arg-type]
                        "kl_ratio_hi": float(np.exp(float(r["hi"]))),  # type: ignore[arg-type]
                        "descriptive": d["descriptive"] or "",
                    }
                )
    return pd.DataFrame(out)
