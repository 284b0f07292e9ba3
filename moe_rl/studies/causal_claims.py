"""Claims 14 and 15, and claim 7 re-decided, on the causal study's runs (`moe_rl.studies.causal`).

Each is one declared contrast `arm - against` in accuracy change at a level (the preset's `analysis.causal.claims`),
paired on (pool member, seed), intervals over pool members then seeds. Over the three, one-sided cluster sign-flip
p values in the claimed direction are Holm-adjusted. reproduced: adjusted p < 0.05 and the 95% interval above 0;
not reproduced: the interval below 0, or inside +-5 pp (the effect too small to matter); inconclusive otherwise;
untestable here where moe does not degrade at the level (its mean change above -5 pp: nothing to stabilise), and
not decided below 5 starts. Claim 7's first look (the dense control at a fixed lr) is kept in its notes.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

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
    would_change,
)
from moe_rl.analysis.stats import holm
from moe_rl.studies import causal

FOLDER = "causal"
TEXT = {
    14: (
        "Route drift causes the MoE model's degradation at fixed divergence",
        "the premise of R2 and R3 (arXiv 2510.11370), GSPO (arXiv 2507.18071) and RSPO",
        "anchored routing (every token takes the frozen cold start's routes; gate weights live)",
    ),
    15: (
        "A load-aware expert step stabilises the MoE model and is inert for a dense one",
        "this harness (the 1/sqrt(p) reading of AdamW on sparsely used experts)",
        "the load-aware expert step (each expert's move x min(1, n_e / mean n_e)); on a dense model, one expert per "
        "layer with every token, the scale is 1 and the step AdamW's exactly, so the interaction is the MoE effect",
    ),
    7: (
        "At this scale the instability is specific to MoE",
        "dense control of the phase map (this harness), re-decided at matched divergence and muP-matched lr",
        "the dense model of the MoE's total width (MLP 512) at the muP lr of its MLP (x 128 / 512), each model at the "
        "lr where its reference (grpo+none) realises the level's early per-update KL",
    ),
}


@lru_cache(maxsize=2)
def _runs(root: str, presets: str) -> tuple[causal.Spec, pd.DataFrame] | None:
    folder = Path(root) / FOLDER / "runs"
    if not folder.is_dir():
        return None
    from moe_rl import analysis

    spec = causal.load_spec(Path(presets))
    return spec, causal.per_run(analysis.load_results(folder, keys=causal.KEYS), spec)


def one_sided(p_two: float, mean_diff: float) -> float:
    """The one-sided p of a positive effect from a symmetric two-sided sign-flip p: half of it where the observed
    mean is above 0, else 1 - half."""
    if not math.isfinite(p_two):
        return math.nan
    return p_two / 2 if mean_diff > 0 else 1 - p_two / 2


@lru_cache(maxsize=2)
def decisions(root: str, presets: str) -> dict[int, dict[str, object]] | None:
    """`decide` on the runs under `root`/causal/runs; None without the study's runs."""
    found = _runs(root, presets)
    return None if found is None else decide(*found)


def decide(spec: causal.Spec, runs: pd.DataFrame) -> dict[int, dict[str, object]]:
    """Per declared claim: its contrast (`causal.contrast`) on `runs` (`causal.per_run`), moe's mean change at the
    level, the one-sided p and its Holm adjustment over the claims decided, the verdict and its reason."""
    out: dict[int, dict[str, object]] = {}
    for cid, (arm, against, level) in spec.claims.items():
        at = runs[runs["level"] == level]
        rec: dict[str, object] = {"arm": arm, "against": against, "level": level}
        moe = at.loc[at["rung"] == "moe", "change"]
        rec["moe_change"] = float(moe.mean()) if len(moe) else math.nan
        if not {arm, against} <= set(at["rung"]):
            missing = sorted({arm, against} - set(at["rung"]))
            rec.update(verdict=INCONCLUSIVE, reason=f"no runs yet of {', '.join(missing)} at {level}")
            out[cid] = rec
            continue
        rec.update(causal.contrast(runs, arm, against, level))
        rec["p_one"] = one_sided(float(rec["p_value"]), float(rec["mean_diff"]))  # type: ignore[arg-type]
        out[cid] = rec
    ids = [i for i, r in out.items() if "p_one" in r and not r["descriptive"]]
    for i, p in zip(ids, holm([float(out[i]["p_one"]) for i in ids]), strict=True):  # type: ignore[arg-type]
        out[i]["p_holm"] = float(p)
    for rec in out.values():
        if "verdict" not in rec:
            rec["verdict"], rec["reason"] = _verdict(rec)
    return out


def _verdict(r: dict) -> tuple[str, str]:
    if r["descriptive"]:
        return INCONCLUSIVE, f"not decided yet: {r['descriptive']}"
    if not r["moe_change"] <= -ACCURACY_MARGIN:
        return UNTESTABLE_HERE, (
            f"moe does not degrade at {r['level']} (mean change {100 * r['moe_change']:+.1f} pp, above "
            f"-{100 * ACCURACY_MARGIN:.0f}): nothing to stabilise"
        )
    lo, hi, p = r["lo"], r["hi"], r["p_holm"]
    test = f"one-sided p {fmt_p(r['p_one'])}, Holm {fmt_p(p)}; interval [{100 * lo:+.1f}, {100 * hi:+.1f}] pp"
    if p < ALPHA and lo > 0:
        return REPRODUCED, test
    if hi < 0 or (-ACCURACY_MARGIN < lo and hi < ACCURACY_MARGIN):
        return NOT_REPRODUCED, test
    return INCONCLUSIVE, test


def statistic(r: dict) -> str:
    """One contrast in words: the difference with its interval, the pairs and starts, the realised KL ratio."""
    if "mean_diff" not in r:
        return "—"
    ci = f" [{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}]" if not r["descriptive"] else f" ({r['descriptive']})"
    return (
        f"{r['arm']} - {r['against']} at {r['level']}: {100 * r['mean_diff']:+.1f} pp{ci} over {r['n_seeds']} pairs "
        f"from {r['n_starts']} starts; realised early per-update KL ratio {r['kl_ratio']:.2f}; moe's mean change "
        f"{100 * r['moe_change']:+.1f} pp"
    )


def _claim(cid: int, root: Path, presets: Path) -> Claim:
    title, source, what = TEXT[cid]
    c = Claim(
        cid,
        title,
        source,
        "declared contrast in accuracy change (the mean of the last 3 evaluations minus step 0), paired on (pool "
        "member, seed): " + (__doc__ or "").split("\n\n")[1].replace("\n", " "),
        experiment=FOLDER,
        cells="grpo+none, N = 8, 200 steps, 6 cold starts x 2 seeds per arm, two per-update KL levels",
    )
    found = decisions(str(root), str(presets))
    if found is None or cid not in found:
        c.reason = "no data"
        c.notes.append("no runs of the causal study yet: `python experiments/causal.py` runs them")
        return c
    r = found[cid]
    c.statistic = statistic(r)
    c.test = str(r["reason"])
    c.p_value = float(r.get("p_holm", math.nan))  # type: ignore[arg-type]
    c.verdict, c.reason = str(r["verdict"]), str(r["reason"])
    c.plain = (
        f"The arm: {what}. Against {r['against']} at the `{r['level']}` level, paired on pool member and seed (on one "
        f"model the same cold start; across models independent starts side by side): "
        f"{c.statistic}. Verdict: **{c.verdict}**. What would change it: {would_change(c.verdict)}."
    )
    return c


def claim_route_drift(root: Path, presets: Path) -> Claim:
    return _claim(14, root, presets)


def claim_load_aware(root: Path, presets: Path) -> Claim:
    return _claim(15, root, presets)


def claim_moe_specific(root: Path, presets: Path) -> Claim:
    """Claim 7 at matched divergence, with its first look (the dense control at a fixed lr) in the notes."""
    from moe_rl.analysis.claims import evaluate_claims
    from moe_rl.studies.mechanism_claims import MOE_SPECIFIC

    c = _claim(7, root, presets)
    old = evaluate_claims(root, {7: MOE_SPECIFIC}, presets)[0]
    c.notes.append(f"first look, the dense control at a fixed lr (`dense_control`): {old.verdict} ({old.reason})")
    c.notes += old.notes
    return c


def contrasts(runs: pd.DataFrame, pairs: tuple[tuple[str, str], ...]) -> pd.DataFrame:
    """Every (arm, against) pair at every level where both ran: `causal.contrast`, for the report's table."""
    rows = []
    for level in runs["level"].dropna().unique():
        have = set(runs.loc[runs["level"] == level, "rung"])
        rows += [causal.contrast(runs, a, b, str(level)) for a, b in pairs if {a, b} <= have]
    return pd.DataFrame(rows)
