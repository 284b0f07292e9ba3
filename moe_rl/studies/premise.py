"""Claim 16, this harness's premise: the benefit of taking route drift away grows with routing's share of the
divergence. It is what links a verdict on a small model to the papers' models, where routing carries the divergence
(docs/findings.md, the routing-dominance ladder).

Declared here before any verdict of the routing-dominant studies was read (their runs had started). Each part is a
difference of differences across rungs: a contrast on the routing-dominant rung (64 experts, top-2, 4 layers,
~45% routing share) minus the same contrast on the default model (~12%), each from its own declared study, on its
own new pool members. A member's warm-ups on two geometries share no weights, so pairing across rungs buys nothing;
the two pools are independent samples. Per side, the start differences of the contrast's own study at the look it
was read (its admitted, complete members of that look's block); the part reads `est = mean_wide - mean_default`
with `se = sqrt(se_wide^2 + se_default^2)`, one-sided in the claimed direction (greater), once both sides have
their final reading (a stop or the last look): **reproduced** where the Holm-adjusted p (over the parts) is at most
`ALPHA`, **not reproduced** where the upper one-sided bound `est + z_(1-ALPHA) se` lies below `MARGIN`, else
inconclusive; before then inconclusive, naming the side it waits for. A fixed-sample reading at the end: the
studies' own sequential rules decide their sides' claims.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from moe_rl.studies import study_rule
from moe_rl.studies.design import declaration, load_study

ALPHA = 0.025  # one-sided, Holm over the parts
MDE = 0.05  # the growth the parts are read for
MARGIN = 0.05  # a not-reproduced verdict excludes a growth this large
CLAIM = "The benefit of taking route drift away grows with routing's share of the divergence (this harness's premise)"


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    wide: tuple[str, str]  # (study, contrast) on the routing-dominant rung
    default: tuple[str, str]  # (study, contrast) on the default model


PARTS = (
    Part(
        "r2",
        "R2's benefit over GRPO without replay",
        ("routing_dominant", "r2_minus_none"),
        ("offpolicy_edge", "r2_minus_none"),
    ),
    Part(
        "anchored",
        "anchored routing's benefit over live routing",
        ("routing_dominant_mechanism", "anchored_minus_moe"),
        ("causal_matched", "anchored_minus_moe"),
    ),
)


@dataclass(frozen=True)
class Side:
    study: str
    contrast: str
    n: int = 0
    mean: float = math.nan
    se: float = math.nan
    final: bool = False
    read_on: str = ""
    missing: str = ""  # why it has no reading ("": it has)


def side(root: Path, presets: Path, study_name: str, contrast: str) -> Side:
    """One side's start differences at the look its study read."""
    try:
        study = load_study(declaration(study_name, presets))
        result = study_rule.analyse(study, Path(root) / study_name / "runs")
    except FileNotFoundError:
        return Side(study_name, contrast, missing=f"`{study_name}` has no finished runs here yet")
    row = result.verdicts.set_index("contrast").loc[contrast]
    c = next(x for x in study.contrasts if x.name == contrast)
    runs = result.runs[result.runs["admitted"].astype(bool)]
    block = set(study.members[: study.design.looks[int(row["look"]) - 1]]) & study_rule.complete_members(
        study, result.runs
    )
    runs = runs[(runs["seed"].astype(int) % study.member_pool).isin(block)]
    pairs = study_rule.pair_values(runs, c.weights, study.outcome_of(c), study.member_pool)
    values = pairs.groupby("start")["value"].mean().to_numpy(float)
    if len(values) < 2:
        return Side(study_name, contrast, missing=f"`{study_name}` has fewer than 2 starts of {contrast}")
    return Side(
        study_name,
        contrast,
        len(values),
        float(values.mean()),
        float(values.std(ddof=1) / math.sqrt(len(values))),
        bool(row.get("final")) or bool(row.get("stopped")),
        str(row.get("read_on", "")),
    )


def read(root: Path, presets: Path) -> pd.DataFrame:
    """One row per part: both sides, the difference of differences, its z, p, Holm and verdict."""
    rows = []
    for part in PARTS:
        wide, default = side(root, presets, *part.wide), side(root, presets, *part.default)
        row = {"part": part.name, "what": part.what, "wide": wide, "default": default}
        if wide.missing or default.missing:
            rows.append(
                {**row, "verdict": study_rule.INCONCLUSIVE, "reason": f"waits: {wide.missing or default.missing}"}
            )
            continue
        est, se = wide.mean - default.mean, math.hypot(wide.se, default.se)
        z = est / se if se > 0 else math.nan
        rows.append(
            {
                **row,
                "estimate": est,
                "se": se,
                "z": z,
                "p": float(stats.norm.sf(z)) if np.isfinite(z) else math.nan,
                "upper": est + float(stats.norm.isf(ALPHA)) * se,
                "final": wide.final and default.final,
            }
        )
    table = pd.DataFrame(rows)
    tested = table[table["p"].notna()] if "p" in table else table.iloc[:0]
    holm = study_rule.holm(dict(zip(tested["part"], tested["p"], strict=True)), ALPHA) if len(tested) else {}
    for i, r in table.iterrows():
        if isinstance(r.get("verdict"), str):  # a side has no reading yet
            continue
        waits = [s.study for s in (r["wide"], r["default"]) if not s.final]
        if waits:
            verdict, reason = study_rule.INCONCLUSIVE, f"waits for the final reading of {', '.join(waits)}"
        elif holm.get(r["part"]):
            verdict, reason = study_rule.REPRODUCED, f"one-sided p {r['p']:.4f} passes Holm over {len(holm)} parts"
        elif r["upper"] < MARGIN:
            verdict, reason = (
                study_rule.NOT_REPRODUCED,
                f"a growth of {MARGIN:g} excluded: upper bound {r['upper']:+.3f}",
            )
        else:
            verdict, reason = study_rule.INCONCLUSIVE, f"upper bound {r['upper']:+.3f} does not exclude {MARGIN:g}"
        table.loc[i, "verdict"], table.loc[i, "reason"] = verdict, reason
    return table


def claims_section(root: Path, presets: Path) -> list[str]:
    """CLAIMS.md's section of claim 16."""
    table = read(root, presets)
    lines = [
        f"## Claim 16: {CLAIM}",
        "",
        "Each part: a contrast on the routing-dominant rung minus the same contrast on the default model, each from "
        "its own declared study and pool (`moe_rl.studies.premise`: a fixed-sample reading once both sides are final, "
        f"one-sided at {ALPHA:g} with Holm over the parts, margin {100 * MARGIN:g} pp).",
        "",
        "| part | routing-dominant rung | default model | difference of differences | verdict | reason |",
        "|---|---|---|---|---|---|",
    ]

    def shown(s: Side) -> str:
        if s.missing:
            return f"`{s.study}`: —"
        where = f"; {s.read_on}" if s.read_on else ""
        return f"`{s.study}` {100 * s.mean:+.1f} pp (SE {100 * s.se:.1f}, {s.n} starts{where})"

    for _, r in table.iterrows():
        diff = (
            f"{100 * r['estimate']:+.1f} pp (SE {100 * r['se']:.1f}, p {r['p']:.3f})"
            if "estimate" in r and r["estimate"] == r["estimate"]
            else "—"
        )
        lines.append(
            f"| {r['what']} | {shown(r['wide'])} | {shown(r['default'])} | {diff} | **{r['verdict']}** | {r['reason']} |"
        )
    return [*lines, ""]


def with_premise(section: Callable[[Path, Path], list[str]]) -> Callable[[Path, Path], list[str]]:
    """A study's CLAIMS.md section followed by claim 16's."""

    def both(root: Path, presets: Path) -> list[str]:
        return [*section(root, presets), *claims_section(root, presets)]

    return both
