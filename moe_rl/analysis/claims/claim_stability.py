"""Claims 2 and 3, stability off-policy: GRPO needs replay (R2); GSPO is stable without it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd

from moe_rl.analysis.claims.arms import Comparison, compare_arms, comparison_text, counts_note, pair_runs
from moe_rl.analysis.claims.cells import cell_list, degrading_cells, offpolicy_runs, phase_cells, phase_outcomes
from moe_rl.analysis.claims.declared import Declared, extension_of, looks_note
from moe_rl.analysis.claims.pooled import kappa_by_cell
from moe_rl.analysis.claims.rules import (
    ACCURACY_MARGIN,
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    Claim,
    accuracy_points,
    set_robustness,
    shares,
    would_change,
)
from moe_rl.analysis.collapse_definitions import ALTERNATIVE_DEFINITION, MAIN_DEFINITION

FAMILY_PHASES = {"phase_mixtral": "mixtral"}  # phase maps of other families: claims 2 and 3 per family and pooled


def family_notes(
    root: Path, fn: Callable[..., Claim], phase: pd.DataFrame | None, declared: dict[str, Declared]
) -> list[str]:
    """Claim 2 or 3 (`fn`) on each other family's phase map alone, and pooled with `phase` (pairs within a
    family), as notes beside the verdict `phase` gives."""
    notes = []
    for experiment, family in FAMILY_PHASES.items():
        other = phase_outcomes(root, experiment, grid=True)
        if other is None:
            continue
        alone = fn(root, other, declared.get(experiment))
        notes.append(f"{family} alone ({experiment}): **{alone.verdict}** ({alone.reason}); {alone.statistic or '—'}")
        if phase is not None:
            pooled = fn(root, pd.concat([phase, other], ignore_index=True), declared.get("phase"))
            notes.append(
                f"{', '.join(sorted(set(phase['family'])))} and {family} pooled (phase and {experiment}, pairs within "
                f"a family): **{pooled.verdict}** ({pooled.reason}); {pooled.statistic or '—'}"
            )
    return notes


def claim_offpolicy_grpo(root: Path, outcomes: pd.DataFrame | None = None, declared: Declared | None = None) -> Claim:
    c = Claim(
        2,
        "Off-policy (N >= 2), GRPO without replay is less stable than GRPO with R2",
        "GSPO 2507.18071; R3 2510.11370",
        "grpo+r2 vs grpo+none, paired by seed in the off-policy (lr, N) cells where the two arms' mean final "
        "accuracy ends below the cold start's. Primary outcomes: final accuracy (mean of the last 3 evaluations) "
        "and reward AUC (sign-flip test, bootstrap interval) and time to collapse (log-rank stratified on the "
        "pairs), Holm over the three and Bonferroni over the looks at the data. reproduced if one favours R2 at "
        "p < 0.05 and none favours no replay; not reproduced if one favours no replay, or the accuracy and reward "
        f"AUC intervals lie inside ±{ACCURACY_MARGIN}; inconclusive otherwise. **fragile** when another "
        "definition of collapse in the declared grid gives another verdict. Collapse counts: secondary, exact "
        "McNemar on the pairs",
        experiment="phase",
    )
    outcomes = phase_outcomes(root, "phase", grid=True) if outcomes is None else outcomes
    if outcomes is None:
        return c
    return _collapse_claim(c, outcomes, "grpo+none", "grpo+r2", declared)


def _collapse_claim(c: Claim, outcomes: pd.DataFrame, worse: str, better: str, declared: Declared | None) -> Claim:
    cells = phase_cells(outcomes)
    off = offpolicy_runs(outcomes)
    missing = [arm for arm in (worse, better) if arm not in set(off["arm"])]
    if missing:
        c.reason = f"no off-policy runs of {missing}"
        return c
    ext = extension_of(off, declared)

    def run(frame: pd.DataFrame, looks: int) -> Comparison | None:
        sel = degrading_cells(frame, [worse, better], cells)
        return (
            compare_arms(sel, worse, better, cells, looks=looks) if len(pair_runs(sel, worse, better, cells)) else None
        )

    base = run(off[ext == ""], 1) if (ext != "").any() else None
    without = f"{base.verdict} ({base.reason})" if base else "no degrading cell"
    looks = looks_note(c, declared, ext, without)
    cmp = run(off, looks)
    if cmp is None:
        c.verdict, c.reason = (
            INCONCLUSIVE,
            "no off-policy cell where the runs degrade: the grid never reached instability",
        )
        return c
    sel = degrading_cells(off, [worse, better], cells)
    c.cells = f"{sel[cells].drop_duplicates().shape[0]} degrading cell(s): {cell_list(sel, cells)}"
    c.statistic = comparison_text(cmp)
    c.test = "paired sign-flip (accuracy, reward AUC), log-rank on pairs (time to collapse); Holm" + (
        f", x {looks} looks" if looks > 1 else ""
    )
    c.p_value, c.verdict, c.reason = cmp.p, cmp.verdict, cmp.reason
    c.notes.append(counts_note(cmp))
    c.notes.append(
        f"agreement of the {MAIN_DEFINITION} and {ALTERNATIVE_DEFINITION} definitions: "
        + kappa_by_cell(offpolicy_runs(outcomes), cells)
    )
    set_robustness(c, {d: v for d, (v, _) in cmp.grid.items()}, {d: k for d, (_, k) in cmp.grid.items()})
    c.plain = _plain_collapse(c, cmp, looks, (base.verdict if base else without) if looks > 1 else "")
    return c


def claim_gspo_stable(root: Path, outcomes: pd.DataFrame | None = None, declared: Declared | None = None) -> Claim:
    c = Claim(
        3,
        "GSPO is stable without routing replay",
        "GSPO, arXiv 2507.18071",
        "in the off-policy cells where grpo+none's mean final accuracy ends below the cold start's, paired by "
        "seed: gspo+none vs grpo+none and grpo+r2 vs gspo+none, each on the three primary outcomes of claim 2 "
        "(Holm within a comparison, Bonferroni over looks). reproduced if gspo+none beats grpo+none and grpo+r2 "
        "does not beat gspo+none; not reproduced if grpo+r2 beats gspo+none, or gspo+none vs grpo+none is not "
        "reproduced (grpo+none better, or both differences inside their margins); inconclusive otherwise. "
        "**fragile** when the grid of collapse definitions disagrees",
        experiment="phase",
    )
    outcomes = phase_outcomes(root, "phase", grid=True) if outcomes is None else outcomes
    if outcomes is None:
        return c
    off = offpolicy_runs(outcomes)
    arms = {"gspo+none", "grpo+none", "grpo+r2"}
    if not arms <= set(off["arm"]):
        c.reason = f"no off-policy runs of {sorted(arms - set(off['arm']))}"
        return c
    cells = phase_cells(off)
    ext = extension_of(off, declared)

    def unstable(frame: pd.DataFrame) -> pd.DataFrame:
        keep = degrading_cells(frame, ["grpo+none"], cells)[cells].drop_duplicates()
        return frame.merge(keep, on=cells)

    def decide(frame: pd.DataFrame, looks: int) -> tuple | None:
        sel = unstable(frame)
        if sel.empty:
            return None
        vs_none = compare_arms(sel, "grpo+none", "gspo+none", cells, looks=looks)
        vs_r2 = compare_arms(sel, "gspo+none", "grpo+r2", cells, looks=looks)

        def rule(v_none: str, v_r2: str) -> str:
            if v_r2 == REPRODUCED or v_none == NOT_REPRODUCED:
                return NOT_REPRODUCED
            return REPRODUCED if v_none == REPRODUCED else INCONCLUSIVE

        grid = {
            d: (rule(vs_none.grid[d][0], vs_r2.grid[d][0]), rule(vs_none.grid[d][1], vs_r2.grid[d][1]))
            for d in vs_none.grid
        }
        return sel, vs_none, vs_r2, rule(vs_none.verdict, vs_r2.verdict), grid

    base = decide(off[ext == ""], 1) if (ext != "").any() else None
    without = base[3] if base else "no unstable cell"
    looks = looks_note(c, declared, ext, without)
    got = decide(off, looks)
    if got is None:
        c.verdict, c.reason = INCONCLUSIVE, "grpo+none never degrades off-policy: no unstable cell to test"
        return c
    sel, vs_none, vs_r2, verdict, grid = got
    c.cells = f"{sel[cells].drop_duplicates().shape[0]} cell(s) where grpo+none degrades: {cell_list(sel, cells)}"
    c.statistic = f"{comparison_text(vs_none)}. {comparison_text(vs_r2)}"
    c.test = "as claim 2, per comparison" + (f", x {looks} looks" if looks > 1 else "")
    c.p_value, c.verdict = vs_none.p, verdict
    c.reason = (
        f"vs grpo+none: {vs_none.verdict} ({vs_none.reason}); grpo+r2 vs gspo+none: {vs_r2.verdict} ({vs_r2.reason})"
    )
    c.notes += [counts_note(vs_none), counts_note(vs_r2)]
    set_robustness(c, {d: v for d, (v, _) in grid.items()}, {d: k for d, (_, k) in grid.items()})
    c.plain = _plain_collapse(c, vs_none, looks, without if looks > 1 else "", second=vs_r2)
    return c


def _plain_collapse(c: Claim, cmp: Comparison, looks: int, without: str, second: Comparison | None = None) -> str:
    acc, s = cmp.cont["late_accuracy"], cmp.surv
    text = (
        f"We compared {cmp.better} with {cmp.worse} on {acc['n']} seed-matched pairs of runs in the cells of the "
        f"phase map where runs lose accuracy. {cmp.better} ended {accuracy_points(acc['mean_diff'])} {cmp.worse} "
        f"(95% interval of the difference {100 * acc['lo']:+.1f} to {100 * acc['hi']:+.1f}); {s['kw']} of {s['n']} "
        f"{cmp.worse} runs and {s['kb']} of {s['n']} {cmp.better} runs collapsed under the main definition."
    )
    if second is not None:
        a2 = second.cont["late_accuracy"]
        auc, auc2 = cmp.cont["reward_auc"], second.cont["reward_auc"]
        text += (
            f" Against {second.better}, {second.worse} ended {accuracy_points(-a2['mean_diff'])} it "
            f"({-100 * a2['hi']:+.1f} to {-100 * a2['lo']:+.1f}). Its reward AUC (mean reward over the run) was "
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
