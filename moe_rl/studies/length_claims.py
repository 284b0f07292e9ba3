"""Claims 12 and 13, and claims 2 and 3 per response length, on the length study's runs (`moe_rl.studies.length`).

All are decided at the preset's `claims_level` and read accuracy change (the mean of the last 3 evaluations minus
step 0) or a run mean of a metric. Per length, a contrast pairs on (pool member, seed) and is tested one-sided over
starts (cluster sign flip), Holm over the lengths; a trend over length is each pool member's least-squares
slope against log L, averaged within its start (twins warmed on two machines are one: `length.unit`), their mean
with a bootstrap interval and a sign-flip p over starts. Below 5 starts nothing
is decided. A verdict at one length is not extended to another.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import pandas as pd

from moe_rl.analysis.claims.rules import (
    ACCURACY_MARGIN,
    ALPHA,
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    UNTESTABLE_HERE,
    Claim,
    fmt_p,
    fmt_pp,
    would_change,
)
from moe_rl.analysis.clustered import cluster_means
from moe_rl.analysis.stats import holm
from moe_rl.studies import length as ln

FOLDER = "length"
GRPO, R2, GSPO = "grpo_none", "grpo_r2", "gspo_none"
SLOPE_MARGIN = 0.02  # per unit log L: ~4 points (accuracy, or share of variance) over L = 4 -> 32, too small to matter


def one_sided(p_two: float, mean_diff: float) -> float:
    """The one-sided p of a positive effect from a symmetric two-sided sign-flip p: half of it where the observed
    mean is above 0, else 1 - half."""
    if not math.isfinite(p_two):
        return math.nan
    return p_two / 2 if mean_diff > 0 else 1 - p_two / 2


@lru_cache(maxsize=2)
def _runs(root: str, presets: str) -> tuple[ln.Spec, pd.DataFrame] | None:
    folder = Path(root) / FOLDER / "runs"
    if not folder.is_dir():
        return None
    from moe_rl import analysis

    spec = ln.load_spec(Path(presets))
    return spec, ln.analysed(ln.per_run(analysis.load_results(folder, keys=ln.KEYS), spec))


def _interval(r: dict, scale: float = 100.0, digits: int = 1) -> str:
    if r.get("descriptive"):
        return f"({r['descriptive']})"
    return f"[{scale * r['lo']:+.{digits}f}, {scale * r['hi']:+.{digits}f}]"


def per_length(spec: ln.Spec, runs: pd.DataFrame, a: str, b: str) -> dict[int, dict[str, Any]]:
    """a - b at every length with runs on both sides, at the claims level: the contrast, grpo+none's mean change there,
    the one-sided p (a above b) and its Holm adjustment over the lengths decided."""
    level = spec.claims_level
    out: dict[int, dict[str, Any]] = {}
    for length in spec.lengths:
        at = runs[(runs["level"] == level) & (runs["L"] == length)]
        if not {a, b} <= set(at["arm_file"]):
            continue
        rec = ln.contrast(runs, a, b, level, length)
        grpo = at[at["arm_file"] == GRPO]  # the mean of start means, as the length table prints it
        rec["grpo_change"] = float(cluster_means(grpo["change"], grpo["unit"]).mean()) if len(grpo) else math.nan
        both = at[at["arm_file"].isin((a, b))]
        rec["floor"] = bool("late_accuracy" in both and (both["late_accuracy"] == 0).all())
        rec["p_one"] = one_sided(float(rec["p_value"]), float(rec["mean_diff"]))
        out[length] = rec
    ids = [k for k, r in out.items() if not r["descriptive"]]
    for k, p in zip(ids, holm([float(out[k]["p_one"]) for k in ids]), strict=True):
        out[k]["p_holm"] = float(p)
    return out


def _above(r: dict) -> str:
    """a - b above 0 by the claims' rule: reproduced, not reproduced (below 0 or inside the margin), inconclusive."""
    if r["descriptive"]:
        return INCONCLUSIVE
    if r["p_holm"] < ALPHA and r["lo"] > 0:
        return REPRODUCED
    if r["hi"] < 0 or (-ACCURACY_MARGIN < r["lo"] and r["hi"] < ACCURACY_MARGIN):
        return NOT_REPRODUCED
    return INCONCLUSIVE


def _degrades(r: dict) -> bool:
    return bool(r["grpo_change"] <= -ACCURACY_MARGIN)


def claim2_at(r: dict) -> tuple[str, str]:
    """Claim 2 at one length: grpo_r2 - grpo_none above 0."""
    if r["descriptive"]:
        return INCONCLUSIVE, f"not decided: {r['descriptive']}"
    if not _degrades(r):
        return UNTESTABLE_HERE, f"grpo+none does not degrade (mean change {fmt_pp(r['grpo_change'])} pp)"
    if r.get("floor"):  # a cell where no arm can differ is untestable, not a refutation
        return UNTESTABLE_HERE, "every run of both arms ended at accuracy 0, a floor on which no arm can differ"
    return _above(r), f"one-sided p {fmt_p(r['p_one'])}, Holm {fmt_p(r['p_holm'])}; {_interval(r)} pp"


def claim3_at(vs_grpo: dict, r2_vs: dict | None) -> tuple[str, str]:
    """Claim 3 at one length: gspo_none - grpo_none above 0, and grpo_r2 - gspo_none not above 0."""
    first, why = claim2_at(vs_grpo)
    if first in (UNTESTABLE_HERE,) or vs_grpo["descriptive"]:
        return first, why
    if r2_vs is None or r2_vs["descriptive"]:
        return INCONCLUSIVE, f"gspo - grpo: {first} ({why}); grpo+r2 - gspo+none not decided"
    r2_beats = r2_vs["lo"] > 0
    if r2_beats or first == NOT_REPRODUCED:
        verdict = NOT_REPRODUCED
    elif first == REPRODUCED:
        verdict = REPRODUCED
    else:
        verdict = INCONCLUSIVE
    return verdict, f"gspo - grpo: {first} ({why}); grpo+r2 - gspo+none {_interval(r2_vs)} pp"


def trend_text(t: dict, unit: str = "pp per unit log L", scale: float = 100.0) -> str:
    if not t["n_starts"]:
        return "no trend yet (one length)"
    ci = _interval(t, scale) if t["descriptive"] else f"{_interval(t, scale)}, two-sided p {fmt_p(t['p_value'])}"
    return f"{scale * t['mean_diff']:+.2f} {unit} {ci} over lengths {t['lengths']}, {t['n_starts']} starts ({t['n_members']} members)"


def decide_12(spec: ln.Spec, runs: pd.DataFrame) -> dict[str, Any]:
    level = spec.claims_level
    grpo = ln.trend(runs, level, "change", GRPO)
    diff = ln.trend(runs, level, "change", GSPO, GRPO)
    rec: dict[str, Any] = {"grpo": grpo, "diff": diff}
    rec["secondary"] = {
        f"{arm} log {v}": ln.trend(runs, level, v, arm, log_y=True)
        for arm in (GRPO, GSPO)
        for v in ("token_var", "seq_var")
    }
    if len(diff["lengths"]) < 2 or diff["descriptive"] or grpo["descriptive"]:
        why = "fewer than 2 lengths" if len(diff["lengths"]) < 2 else diff["descriptive"] or grpo["descriptive"]
        rec["verdict"], rec["reason"] = INCONCLUSIVE, f"not decided: {why}"
        return rec
    p_one = one_sided(float(diff["p_value"]), float(diff["mean_diff"]))
    rec["p_one"] = p_one
    test = f"grpo+none's slope {trend_text(grpo)}; gspo+none - grpo+none {trend_text(diff)}, one-sided p {fmt_p(p_one)}"
    grows = grpo["hi"] < 0
    if grows and p_one < ALPHA and diff["lo"] > 0:
        rec["verdict"] = REPRODUCED
    elif grpo["lo"] > -SLOPE_MARGIN or diff["hi"] < 0 or -SLOPE_MARGIN < diff["lo"] and diff["hi"] < SLOPE_MARGIN:
        rec["verdict"] = NOT_REPRODUCED
    else:
        rec["verdict"] = INCONCLUSIVE
    rec["reason"] = test
    return rec


def decide_13(spec: ln.Spec, runs: pd.DataFrame) -> dict[str, Any]:
    t = ln.trend(runs, spec.claims_level, "routing_share", GRPO)
    rec: dict[str, Any] = {"trend": t}
    if len(t["lengths"]) < 2 or t["descriptive"]:
        why = "fewer than 2 lengths" if len(t["lengths"]) < 2 else t["descriptive"]
        rec["verdict"], rec["reason"] = INCONCLUSIVE, f"not decided: {why}"
        return rec
    p_one = one_sided(float(t["p_value"]), float(t["mean_diff"]))
    rec["p_one"] = p_one
    if p_one < ALPHA and t["lo"] > 0:
        rec["verdict"] = REPRODUCED
    elif t["hi"] < SLOPE_MARGIN:
        rec["verdict"] = NOT_REPRODUCED
    else:
        rec["verdict"] = INCONCLUSIVE
    rec["reason"] = f"slope {trend_text(t, 'share per unit log L', 1.0)}, one-sided p {fmt_p(p_one)}"
    return rec


@lru_cache(maxsize=2)
def decisions(root: str, presets: str) -> dict[str, Any] | None:
    """Every decision of the study on the runs under `root`/length/runs; None without them."""
    found = _runs(root, presets)
    return None if found is None else decide(*found)


def decide(spec: ln.Spec, runs: pd.DataFrame) -> dict[str, Any]:
    level = spec.claims_level
    c2 = per_length(spec, runs, R2, GRPO)
    c3 = per_length(spec, runs, GSPO, GRPO)
    r2_vs = per_length(spec, runs, R2, GSPO)
    return {
        "2": {k: (*claim2_at(r), r) for k, r in c2.items()},
        "3": {k: (*claim3_at(r, r2_vs.get(k)), r) for k, r in c3.items()},
        "2_trend": ln.trend(runs, level, "change", R2, GRPO),
        "3_trend": ln.trend(runs, level, "change", GSPO, GRPO),
        "12": decide_12(spec, runs),
        "13": decide_13(spec, runs),
    }


TEXT = {
    12: (
        "GRPO's instability grows with response length while GSPO's does not",
        "GSPO, arXiv 2507.18071 §3 (token-level weights accumulate noise over a response)",
    ),
    13: (
        "Routing's share of the ratio variance grows with response length",
        "R3, arXiv 2510.11370 (a response of L tokens through d MoE layers changes some route with probability "
        "1 - (1 - p)^(L d))",
    ),
}
RULES = {
    12: "each pool member's slope of accuracy change against log L at `past`, gspo+none's minus grpo+none's (paired on "
    "member); reproduced when grpo+none's slope interval is below 0 and the difference's one-sided p < 0.05 with its "
    f"interval above 0; not reproduced when grpo+none's slope interval lies above -{SLOPE_MARGIN} per unit log L or the "
    f"difference's interval lies below 0 or inside ±{SLOPE_MARGIN}; inconclusive otherwise; secondary: the slopes of "
    "log token and log sequence ratio variance",
    13: "grpo+none's pool members' slopes of `ratio/split/routing_share` (run mean) against log L at `past`; reproduced "
    f"when one-sided p < 0.05 and the interval above 0; not reproduced when the interval lies below {SLOPE_MARGIN} per "
    "unit log L; inconclusive otherwise",
}
CELLS = "basic_arithmetic at L = 4, 16, 32; N = 8, 200 steps; each length's lr at grpo+none's early per-update KL 0.009"


def _claim(cid: int, root: Path, presets: Path) -> Claim:
    title, source = TEXT[cid]
    c = Claim(cid, title, source, RULES[cid], experiment=FOLDER, cells=CELLS)
    found = decisions(str(root), str(presets))
    if found is None:
        c.notes.append("no runs of the length study yet: `python experiments/length.py` runs them")
        return c
    r: dict = found[str(cid)]
    c.verdict, c.reason = str(r["verdict"]), str(r["reason"])
    c.p_value = float(r.get("p_one", math.nan))
    if cid == 12:
        c.statistic = f"gspo+none - grpo+none slope of accuracy change: {trend_text(r['diff'])}"
        c.notes += [f"secondary, {k}: {trend_text(t, 'per unit log L', 1.0)}" for k, t in r["secondary"].items()]
    else:
        c.statistic = f"grpo+none routing share: {trend_text(r['trend'], 'per unit log L', 1.0)}"
    c.test = c.reason
    c.plain = f"{title}: {c.statistic}. Verdict: **{c.verdict}**. What would change it: {would_change(c.verdict)}."
    return c


def claim_length_instability(root: Path, presets: Path) -> Claim:
    return _claim(12, root, presets)


def claim_routing_share(root: Path, presets: Path) -> Claim:
    return _claim(13, root, presets)


def claims_section(root: Path, presets: Path) -> list[str]:
    """CLAIMS.md's section: claims 2 and 3 decided per length, with their trends over length."""
    found = decisions(str(root), str(presets))
    if found is None:
        return []
    lines = ["## Claims 2 and 3 by response length: the length study (earlier looks, L = 16 and 32 on a floor)", ""]
    lines.append(
        "From the length study (`results/length/`): "
        + (__doc__ or "").split("\n\n")[1].replace("\n", " ")
        + " "
        + CELLS
    )
    lines += ["", "| claim | L | contrast, pp [95%] | pairs (starts) | grpo+none's change | verdict | test |"]
    lines.append("|---|---:|---|---|---:|---|---|")
    for cid, what in (("2", "grpo+r2 - grpo+none"), ("3", "gspo+none - grpo+none")):
        for length, (verdict, why, r) in found[cid].items():
            lines.append(
                f"| {cid} | {length} | {what} {fmt_pp(r['mean_diff'])} {_interval(r)} | {r['n_seeds']} ({r['n_starts']}) "
                f"| {fmt_pp(r['grpo_change'])} | **{verdict}** | {why} |"
            )
    lines += [
        "",
        f"- claim 2's trend, grpo+r2 - grpo+none against log L: {trend_text(found['2_trend'])}",
        f"- claim 3's trend, gspo+none - grpo+none against log L: {trend_text(found['3_trend'])}",
        "",
    ]
    return lines
