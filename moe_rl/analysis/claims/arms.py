"""Arm comparisons: measured outcomes paired by seed, time to collapse, collapse counts, and their verdict."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from moe_rl.analysis.claims.cells import grid_definitions
from moe_rl.analysis.claims.rules import (
    ACCURACY,
    ALPHA,
    CONTINUOUS,
    INCONCLUSIVE,
    MARGINS,
    N_BOOT,
    NOT_REPRODUCED,
    REPRODUCED,
    Claim,
    accuracy_points,
    fmt_p,
    shares,
    would_change,
)
from moe_rl.analysis.clustered import pair_keys
from moe_rl.analysis.collapse_definitions import MAIN_DEFINITION
from moe_rl.analysis.stats import (
    compare_pairs,
    holm,
    kaplan_meier,
    logrank_test,
    looks_adjusted,
    mcnemar_exact,
    wilson_interval,
)


def pair_runs(outcomes: pd.DataFrame, worse: str, better: str, cells: list[str]) -> pd.DataFrame:
    """Runs of two arms joined on cell and seed (same cold start and prompts; and on the start where seeds repeat
    across starts, `clustered.pair_keys`): columns <col>_w, <col>_b."""
    w, b = outcomes[outcomes["arm"] == worse], outcomes[outcomes["arm"] == better]
    on = pair_keys((w, b), [*cells, "seed"])
    joined = w.set_index(on).join(b.set_index(on), lsuffix="_w", rsuffix="_b", how="inner").reset_index()
    if "start" in on:  # both runs of a pair began from it
        joined["start_w"] = joined["start_b"] = joined["start"]
    return joined


def pair_starts(pairs: pd.DataFrame) -> pd.Series | None:
    """Each pair's cold starts, "worse's | better's" (`pair_runs` frames of outcomes with a `start`); None without."""
    if "start_w" not in pairs or "start_b" not in pairs:
        return None
    return pairs["start_w"].astype(str) + " | " + pairs["start_b"].astype(str)


def continuous_compare(pairs: pd.DataFrame) -> dict[str, dict]:
    """better - worse on each measured outcome, paired, one-sided both ways (`stats.compare_pairs`: the cold
    start as the unit from 5 starts up, each pair labelled by both arms' starts; below, by seed pairs)."""
    starts = pair_starts(pairs)
    out = {}
    for col in CONTINUOUS:
        x, y = pairs[f"{col}_b"].to_numpy(float), pairs[f"{col}_w"].to_numpy(float)
        r = compare_pairs(x, y, starts, alternative="greater", n_resamples=N_BOOT)
        r["p_reverse"] = compare_pairs(x, y, starts, alternative="less", n_resamples=N_BOOT)["p_value"]
        out[col] = r
    return out


def survival_compare(pairs: pd.DataFrame, definition: str) -> dict[str, float]:
    """Time to collapse under `definition`, censored at a run's last step: log-rank stratified on the
    pairs (worse collapses sooner: p_more; the reverse: p_less), Kaplan-Meier survival to the end per
    arm, collapse counts and the exact McNemar test on the discordant pairs."""
    cw, cb = pairs[f"collapsed_{definition}_w"].to_numpy(bool), pairs[f"collapsed_{definition}_b"].to_numpy(bool)
    tw = np.where(cw, pairs[f"collapse_step_{definition}_w"], pairs["last_step_w"]).astype(float)
    tb = np.where(cb, pairs[f"collapse_step_{definition}_b"], pairs["last_step_b"]).astype(float)
    n = len(pairs)
    args = (np.r_[tw, tb], np.r_[cw, cb], np.r_[np.ones(n, bool), np.zeros(n, bool)], np.r_[np.arange(n), np.arange(n)])
    more, less = logrank_test(*args, alternative="greater"), logrank_test(*args, alternative="less")
    km = {arm: kaplan_meier(t, c) for arm, t, c in (("w", tw, cw), ("b", tb, cb))}
    disc_w, disc_b = int((cw & ~cb).sum()), int((~cw & cb).sum())
    return {
        "n": n,
        "kw": int(cw.sum()),
        "kb": int(cb.sum()),
        "p_more": more["p_value"],
        "p_less": less["p_value"],
        "observed": more["observed"],
        "expected": more["expected"],
        "km_w": float(km["w"]["survival"].iloc[-1]) if len(km["w"]) else 1.0,
        "km_b": float(km["b"]["survival"].iloc[-1]) if len(km["b"]) else 1.0,
        "disc_w": disc_w,
        "disc_b": disc_b,
        "mcnemar_more": mcnemar_exact(disc_w, disc_b, alternative="greater"),
        "mcnemar_less": mcnemar_exact(disc_w, disc_b, alternative="less"),
    }


def arm_verdict(
    cont: dict[str, dict], surv: dict[str, float], *, looks: int = 1, margins: Mapping[str, float] = MARGINS
) -> tuple[str, str, float]:
    """(verdict, reason, p) for "better beats worse" from the three primary outcomes, Holm over them and
    Bonferroni over `looks`: reproduced if one favours the better arm at p < 0.05 and none the worse;
    not reproduced if one favours the worse arm, or both measured differences lie inside their `margins`."""
    names = [*CONTINUOUS.values(), "time to collapse"]
    pred = [looks_adjusted(p, looks) for p in holm([*(cont[k]["p_value"] for k in CONTINUOUS), surv["p_more"]])]
    opp = [looks_adjusted(p, looks) for p in holm([*(cont[k]["p_reverse"] for k in CONTINUOUS), surv["p_less"]])]
    best_pred, best_opp = (
        int(np.nanargmin(pred)) if np.isfinite(pred).any() else 0,
        int(np.nanargmin(opp)) if np.isfinite(opp).any() else 0,
    )
    p_pred, p_opp = pred[best_pred], opp[best_opp]
    corrected = f"Holm{f', x {looks} looks' if looks > 1 else ''}"
    if p_pred < ALPHA and not p_opp < ALPHA:
        return REPRODUCED, f"{names[best_pred]} favours the predicted arm ({corrected} p = {fmt_p(p_pred)})", p_pred
    if p_opp < ALPHA:
        return NOT_REPRODUCED, f"{names[best_opp]} favours the other arm ({corrected} p = {fmt_p(p_opp)})", p_pred
    acc, auc = cont[ACCURACY], cont["reward_auc"]
    m_acc, m_auc = margins[ACCURACY], margins["reward_auc"]
    if -m_acc < acc["lo"] and acc["hi"] < m_acc and -m_auc < auc["lo"] and auc["hi"] < m_auc:
        return (
            NOT_REPRODUCED,
            (
                f"no difference: accuracy [{acc['lo']:+.3f}, {acc['hi']:+.3f}] inside ±{m_acc}, "
                f"reward AUC [{auc['lo']:+.3f}, {auc['hi']:+.3f}] inside ±{m_auc}"
            ),
            p_pred,
        )
    return (
        INCONCLUSIVE,
        (
            f"no outcome significant either way ({corrected} p = {fmt_p(p_pred)}, reverse {fmt_p(p_opp)}) and "
            "the measured differences are not inside their margins"
        ),
        p_pred,
    )


def count_verdict(surv: dict[str, float]) -> str:
    """The collapse counts alone (secondary): exact McNemar one-sided either way."""
    if surv["mcnemar_more"] < ALPHA:
        return REPRODUCED
    return NOT_REPRODUCED if surv["mcnemar_less"] < ALPHA else INCONCLUSIVE


@dataclass
class Comparison:
    """One arm comparison of a collapse claim, on one set of runs."""

    worse: str
    better: str
    pairs: pd.DataFrame
    cont: dict
    surv: dict  # under the main definition
    verdict: str
    reason: str
    p: float
    grid: dict[str, tuple[str, str]]  # definition -> (primary verdict, counts-only verdict)


def compare_arms(
    runs: pd.DataFrame,
    worse: str,
    better: str,
    cells: list[str],
    *,
    looks: int = 1,
    margins: Mapping[str, float] = MARGINS,
) -> Comparison:
    """`better` beats `worse` on measured outcomes? Verdict under the main definition and under every
    grid definition present in `runs` (only time to collapse and the counts depend on it)."""
    pairs = pair_runs(runs, worse, better, cells)
    cont = continuous_compare(pairs)
    grid = {}
    for d in grid_definitions(runs) or [MAIN_DEFINITION]:
        s = survival_compare(pairs, d)
        grid[d] = (arm_verdict(cont, s, looks=looks, margins=margins)[0], count_verdict(s))
    surv = survival_compare(pairs, MAIN_DEFINITION)
    verdict, reason, p = arm_verdict(cont, surv, looks=looks, margins=margins)
    return Comparison(worse, better, pairs, cont, surv, verdict, reason, p, grid)


def comparison_text(
    cmp: Comparison, *, accuracy: str = "final accuracy", auc_name: str = "reward AUC", qualifier: str = ""
) -> str:
    """One line of a comparison's outcomes; `accuracy`, `auc_name` and `qualifier` (after the arm names)
    word outcomes measured otherwise, e.g. from each arm's own start."""
    acc, auc, s = cmp.cont[ACCURACY], cmp.cont["reward_auc"], cmp.surv
    return (
        f"{cmp.better} - {cmp.worse}{qualifier}: {accuracy} {100 * acc['mean_diff']:+.1f} pp "
        f"[{100 * acc['lo']:+.1f}, {100 * acc['hi']:+.1f}], {auc_name} {auc['mean_diff']:+.3f} "
        f"[{auc['lo']:+.3f}, {auc['hi']:+.3f}] ({acc['n']} pairs); Kaplan-Meier survival to the end {cmp.worse} "
        f"{s['km_w']:.2f} vs {cmp.better} {s['km_b']:.2f}; collapsed {cmp.worse} {s['kw']} of {s['n']}, "
        f"{cmp.better} {s['kb']} of {s['n']}"
    )


def counts_note(cmp: Comparison) -> str:
    """The secondary line of a comparison: collapse counts with Wilson intervals, McNemar and the log-rank test."""
    s = cmp.surv
    ww, wb = wilson_interval(s["kw"], s["n"]), wilson_interval(s["kb"], s["n"])
    return (
        f"secondary, collapse counts ({MAIN_DEFINITION}): {cmp.worse} {s['kw']} of {s['n']} [{ww[0]:.2f}, "
        f"{ww[1]:.2f}] vs {cmp.better} {s['kb']} of {s['n']} [{wb[0]:.2f}, {wb[1]:.2f}]; discordant pairs: {s['disc_w']} where only {cmp.worse} collapsed, {s['disc_b']} "
        f"where only {cmp.better} did; exact McNemar one-sided p = {fmt_p(s['mcnemar_more'])} (reverse "
        f"{fmt_p(s['mcnemar_less'])}); time to collapse, log-rank stratified on pairs p = {fmt_p(s['p_more'])} "
        f"(reverse {fmt_p(s['p_less'])})"
    )


def comparison_plain(
    c: Claim,
    cmp: Comparison,
    looks: int,
    without: str,
    second: Comparison | None = None,
    descriptive: bool = False,
) -> str:
    """The paragraph for a person of a claim decided by `cmp` (and a `second` comparison of the claimed arm
    against a rival): pairs, accuracy and collapse counts, the verdict over the grid of collapse definitions,
    the looks at the data (`without`: the verdict without the runs added after a look). `descriptive` (fewer than 5
    independent cold starts behind the pairs): the differences without their seed-level intervals."""
    acc, s = cmp.cont[ACCURACY], cmp.surv
    ci = "" if descriptive else f" (95% interval of the difference {100 * acc['lo']:+.1f} to {100 * acc['hi']:+.1f})"
    text = (
        f"We compared {cmp.better} with {cmp.worse} on {acc['n']} seed-matched pairs of runs in the cells of the "
        f"phase map where runs lose accuracy. {cmp.better} ended {accuracy_points(acc['mean_diff'])} {cmp.worse}"
        f"{ci}; {s['kw']} of {s['n']} {cmp.worse} runs and {s['kb']} of {s['n']} {cmp.better} runs collapsed under the "
        "main definition."
    )
    if second is not None:
        a2 = second.cont[ACCURACY]
        auc, auc2 = cmp.cont["reward_auc"], second.cont["reward_auc"]
        ci2 = "" if descriptive else f" ({-100 * a2['hi']:+.1f} to {-100 * a2['lo']:+.1f})"
        text += (
            f" Against {second.better}, {second.worse} ended {accuracy_points(-a2['mean_diff'])} it"
            f"{ci2}. Its reward AUC (mean reward over the run) was "
            f"{auc['mean_diff']:+.3f} against {cmp.worse} and {-auc2['mean_diff']:+.3f} against {second.better}."
        )
    shares_text = shares(list(c.robustness.values()))
    text += f" Verdict: **{c.verdict}**; across {len(c.robustness)} reasonable collapse definitions: {shares_text}."
    if looks > 1:
        text += (
            f" Runs were added after {looks - 1} look(s) at the results; counting the looks is part of the "
            f"verdict, and without the added runs it reads {without}."
        )
    return text + f" What would change it: {would_change(c.verdict)}."
