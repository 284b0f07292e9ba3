"""Collapse pooled over the cells of a phase map: exact CMH, the pooled rate difference, per-cell tests."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from moe_rl.analysis.claims.rules import N_BOOT
from moe_rl.analysis.collapse_definitions import ALTERNATIVE_DEFINITION, MAIN_DEFINITION
from moe_rl.analysis.phase import cell_label
from moe_rl.analysis.stats import cmh_exact, cohen_kappa, collapse_test, holm


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


def compare_collapse(outcomes: pd.DataFrame, a: str, b: str, definition: str, cells: list[str]) -> dict:
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
    return {
        "strata": strata,
        "p_more": more["p_value"],
        "p_less": less["p_value"],
        "odds_ratio": more["odds_ratio"],
        "diff": diff,
        "n_informative": len(informative),
        "per_cell_p": per_cell,
        "per_cell_holm": holm(per_cell),
        "ka": ka,
        "na": na,
        "kb": kb,
        "nb": nb,
        "any": ka + kb > 0,
    }


def kappa_by_cell(outcomes: pd.DataFrame, cells: list[str]) -> str:
    """Agreement of the two collapse definitions per cell (all arms): share of runs alike and Cohen's kappa."""
    parts = []
    for values, g in outcomes.groupby(cells, sort=True):
        a, b = g[f"collapsed_{MAIN_DEFINITION}"].to_numpy(bool), g[f"collapsed_{ALTERNATIVE_DEFINITION}"].to_numpy(bool)
        if a.any() or b.any():
            k = cohen_kappa(a, b)
            parts.append(
                f"{cell_label(cells, values if isinstance(values, tuple) else (values,))}: "
                f"{int((a == b).sum())} of {len(a)} runs alike, kappa {'—' if np.isnan(k) else f'{k:+.2f}'}"
            )
    return "; ".join(parts) or "no cell where either definition fires"
