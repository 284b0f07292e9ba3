"""A declared study's claims on CLAIMS.md: a claim decided by one contrast of a declared study, its earlier looks
in its notes (`study_claim`), a claim as a declaration states it before any look (`stated_claim`), and a study's
section of secondary readings (`claims_section`) and those readings as one cell of the claim table per claim
(`rung_readings`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from moe_rl.analysis.claims.rules import NO_DATA, Claim
from moe_rl.analysis.preregistration import Preregistration
from moe_rl.studies.design import UNITS, Contrast, Study, declaration, load_study
from moe_rl.studies.secondary import describe as describe_secondary
from moe_rl.studies.study_rule import NOTED_CONTRASTS, analyse


def rule_text(study: Study, contrast: Contrast) -> str:
    d, margin, mde = study.design, study.margin_of(contrast), study.mde_of(contrast)
    outcome = "" if study.outcome_of(contrast) == study.outcome else f" of `{study.outcome_of(contrast)}`"
    relative = (
        f" ({d.margin_relative:g} of the reference's own loss where it has one)"
        if d.margin_relative is not None
        else ""
    )
    futility = " or crosses its futility boundary (beta spending at power, non-binding)" if d.futility else ""
    matched = (
        f"; matched {study.match.scope} on `{study.match.divergence}` within [{1 / study.match.tolerance:.3f}, "
        f"{study.match.tolerance:g}] (else unmatched)"
        if study.match and study.match.covers(contrast.name)
        else ""
    )
    return (
        f"declared in experiments/conf/study/{study.name}.yaml: the contrast's{outcome} one-sided t on start means, "
        f"read as a z, against O'Brien-Fleming-type boundaries spending alpha {d.alpha:g} over looks at "
        f"{', '.join(map(str, d.looks))} starts, Holm across the study's claims (reproduced); not reproduced where "
        f"the repeated one-sided bound excludes an effect of {margin:g} in the claimed direction{relative}{futility}; "
        f"untestable at a floor, a ceiling or where the reference does not degrade{matched}; sized for {mde:g} at "
        f"power {d.power:g}"
    )


def interval(row: pd.Series) -> str:
    """ " [lo, hi]" of a contrast's repeated interval in its units x 100; "" where its starts give none."""
    lo, hi = float(row["lo"]), float(row["hi"])
    return "" if math.isnan(lo) else f" [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def declared_words(study: Study, prereg: Preregistration | None) -> str:
    """How a claim's paragraph says when its design was written: checked against git where it can be."""
    if study.declared:
        return study.declared.rstrip(".")
    if prereg is None or prereg.problem is not None:
        return "Declared on new pool members (its history not checked)"
    if prereg.before_runs:
        return "Declared before its runs (checked against git) on new pool members"
    if prereg.design_amended:
        return "Declared on new pool members and amended after its runs began (each amendment in the notes)"
    return "Declared before its runs on new pool members (amended after them in reporting keys only)"


def stated_claim(
    claim_id: int, study_name: str, first_look: tuple[str, Callable[[Path, Path], Claim]] | None = None
) -> Callable[[Path, Path], Claim]:
    """Claim `claim_id` as the declared study `study_name` states it (its `claims` entry), before any look of it
    (`NO_DATA`); `first_look` (label, claim) a reading by an older design, kept in its notes at the level it was
    read."""

    def judge(root: Path, presets: Path) -> Claim:
        path = declaration(study_name, presets)
        if path.is_file():
            statement = load_study(path).claims[str(claim_id)]
            c = Claim(claim_id, statement.text, statement.source, rule="", experiment=study_name)
        else:
            c = Claim(claim_id, f"claim {claim_id} ({path.name}, which states it, is not here)", "", rule="")
        if first_look is not None:
            label, look = first_look
            old = look(root, presets)
            c.notes += [f"{label}: {old.verdict} ({old.reason})", *old.notes]
        return c

    return judge


def study_claim(
    claim_id: int, study_name: str, contrast: str, earlier: Callable[[Path, Path], Claim] | None = None
) -> Callable[[Path, Path], Claim]:
    """Claim `claim_id` decided by `contrast` of the declared study `study_name` (its declaration beside the presets
    folder, its runs under root/<study>/runs), the verdicts `earlier` gives kept in its notes as earlier looks at the
    level they were read (None: the first look, the claim as the declaration states it); `earlier`'s claim as it is
    where the study has no runs yet."""
    before = earlier or stated_claim(claim_id, study_name)

    def judge(root: Path, presets: Path) -> Claim:
        prior = before(root, presets)
        try:  # no declaration here (a presets folder of another checkout) or no finished run: the earlier looks
            study = load_study(declaration(study_name, presets))
            result = analyse(study, Path(root) / study.name / "runs")
        except FileNotFoundError:
            prior.notes.append(f"the declared study `{study_name}` that decides it has no finished runs here yet")
            return prior
        row = result.verdicts.set_index("contrast").loc[contrast]
        declared = next(x for x in study.contrasts if x.name == contrast)
        outcome = str(row["outcome"])
        unit = UNITS[outcome]
        stated = study.claims.get(str(claim_id))  # the latest declaration that states the claim words it
        c = Claim(
            claim_id,
            stated.text if stated else prior.claim,
            stated.source if stated else prior.source,
            rule_text(study, declared),
            experiment=study.name,
            cells=f"{contrast}: {int(row['starts'])} {'' if study.declared else 'new '}{row['unit']} x "
            f"{study.seeds_per_start} seed(s)",
            statistic=f"{100 * row['estimate']:+.1f} {unit}{interval(row)}",
            test=f"z {row.get('z', math.nan):.2f}, boundary {row.get('boundary', math.nan):.2f} at look {row['look']}",
            p_value=float(row.get("p_repeated", math.nan)),
            verdict=str(row["verdict"]),
            reason=str(row["reason"]),
            repeated_p=declared.claim != "exploratory",
            read_on=str(row.get("read_on", "")),
        )
        if study.as_ran is not None:
            c.looked = f"re-read by the one rule as `{study.name}` ran"
        cells_run = result.runs[result.runs["cell"].isin([f"{a}@{lv}" for a, lv in declared.weights])]
        if "collapse" in c.claim.lower() and len(cells_run) and not cells_run["collapsed"].astype(bool).any():
            c.reason += f"; read as an erosion of gain: none of the {len(cells_run)} runs of its cells collapsed"
        c.divergence = divergence_text(study, row, contrast)
        if c.divergence:
            c.notes.append(f"realised early acting KL ratio {c.divergence}")
        past = int(row.get("looks_past_stop", 0) or 0)
        if past:
            c.notes.append(
                f"the rule stops at look {row['look']}; the {past} look(s) after it were run all the same (not read)"
            )
        crossed = int(row.get("futility_crossed", 0) or 0)
        if crossed:
            c.notes.append(
                f"the futility boundary was crossed at look {crossed}; the study ran on (the boundary is non-binding), "
                "so its later looks decide"
            )
        if row.get("holm"):
            c.notes.append(f"Holm across the study's claims (repeated p {float(row['p_repeated']):.4f}): {row['holm']}")
        if c.read_on:
            c.notes.append(f"read on: {c.read_on}")
        prereg = result.preregistration
        if prereg is not None:
            label = (
                "not a pre-registration, its declaration's history" if study.as_ran is not None else "pre-registration"
            )
            c.notes.append(f"{label}, from git: {prereg.text}")
        c.secondary = describe_secondary(result.secondary, contrast) if len(result.secondary) else ""
        if c.secondary:
            c.notes.append(f"the mission's outcomes, paired over starts (95% t): {c.secondary}")
        if not math.isnan(float(row.get("reference", math.nan))):
            c.notes.append(f"the reference's own change: {100 * float(row['reference']):+.1f} pp")
        few = len(result.verdicts) <= NOTED_CONTRASTS  # a small study's exploratory contrasts beside its claims
        for _, other in result.verdicts.iterrows():  # the study's other contrasts, at the level they were read
            if other["contrast"] != contrast and (few or other["claim"] != "exploratory"):
                c.notes.append(
                    f"{other['contrast']} ({other['claim']}): {100 * other['estimate']:+.1f} {UNITS[other['outcome']]}"
                    f"{interval(other)}, {other['verdict']} ({other['reason']})"
                )
        read = list(dict.fromkeys(f"{a}@{lv}" for a, lv in (*declared.weights, *declared.requires)))
        if len(result.cells):
            cells = result.cells.set_index("cell")[outcome].reindex(read).dropna()
            c.notes.append(
                f"each cell's mean of start means of `{outcome}`: "
                + ", ".join(f"{k} {100 * v:+.1f} {unit}" for k, v in cells.items())
            )
        if earlier is not None:  # the earlier looks' verdict (none where `earlier` only states the claim)
            if prior.reason != NO_DATA:  # read by earlier runs, not only stated
                c.notes.append(f"earlier looks, {prior.looked}: {prior.verdict} ({prior.reason})")
            c.notes += prior.notes
        c.plain = (
            f"{study.question} {declared_words(study, prereg)}; "
            f"{c.cells}. The contrast "
            f"{contrast} is {c.statistic} ({outcome}, mean of start means, repeated confidence interval). "
            f"Verdict: **{c.verdict}** ({c.reason})."
            + (f" Read on {c.read_on}." if c.read_on else "")
            + (f" Beside it: {c.secondary}." if c.secondary else "")
        )
        return c

    judge.__name__ = f"claim_{claim_id}_{study_name}"
    return judge


def divergence_text(study: Study, row: pd.Series, contrast: str) -> str:
    """A contrast's realised early acting KL ratio with its interval over starts and whether it is a declared match
    ("" where not measured)."""
    ratio = float(row.get("kl_ratio", math.nan))
    if math.isnan(ratio):
        return ""
    band = f" [{float(row['kl_lo']):.2f}, {float(row['kl_hi']):.2f}]" if row["kl_lo"] == row["kl_lo"] else ""
    if not (study.match and study.match.covers(contrast)):
        return f"{ratio:.2f}{band}, not a declared match"
    low, high = 1 / study.match.tolerance, study.match.tolerance
    inside = "matched within" if low <= ratio <= high else "outside its declared match"
    tolerance = f", {inside} [{low:.3f}, {high:g}]"
    return f"{ratio:.2f}{band}{tolerance}"


def claims_section(study_name: str, title: str, claims: tuple[str, ...]) -> Callable[[Path, Path], list[str]]:
    """CLAIMS.md's section of a declared study's secondary readings: each contrast of `claims` with its verdict by
    the one rule, at the level it was read ([] where the study has no finished runs)."""

    def section(root: Path, presets: Path) -> list[str]:
        try:
            study = load_study(declaration(study_name, presets))
            result = analyse(study, Path(root) / study.name / "runs")
        except FileNotFoundError:
            return []
        lines = [
            f"## {title}",
            "",
            f"From the declared study `{study_name}` (`results/{study_name}/`): {study.question}",
        ]
        lines += [
            "",
            "| claim | contrast | starts | difference [repeated CI] | look | verdict | reason | read on | divergence ratio |",
        ]
        lines.append("|---|---|---:|---|---:|---|---|---|---|")
        for _, r in result.verdicts[result.verdicts["claim"].isin(claims)].iterrows():
            lines.append(
                f"| {r['claim']} | {r['contrast']} | {int(r['starts'])} | {100 * r['estimate']:+.1f} {UNITS[r['outcome']]} "
                f"[{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}] | {int(r['look'])} | **{r['verdict']}** | {r['reason']} "
                f"| {r.get('read_on', '') or '—'} | {divergence_text(study, r, str(r['contrast'])) or '—'} |"
            )
        placebo = study.match.placebo if study.match else None
        if placebo is not None and placebo in set(result.verdicts["contrast"]):
            p = result.verdicts.set_index("contrast").loc[placebo]
            lines += [
                "",
                f"The placebo `{placebo}` (the reference against itself at another lr, matched back like any arm) reads "
                f"{100 * p['estimate']:+.1f} {UNITS[p['outcome']]} [{100 * p['lo']:+.1f}, {100 * p['hi']:+.1f}]: "
                f"{p['verdict']} ({p['reason']}).",
            ]
        return [*lines, ""]

    return section


def rung_readings(study_name: str, claims: tuple[str, ...]) -> Callable[[Path, Path], dict[int, str]]:
    """The claim table's cell of each of `claims` read by a declared study on another rung than the claim's current
    reading: its verdict, difference [repeated CI] over its starts, the look, the model and routing share it was read
    on and the divergence ratio ({} where the study has no finished runs)."""

    def readings(root: Path, presets: Path) -> dict[int, str]:
        try:
            study = load_study(declaration(study_name, presets))
            result = analyse(study, Path(root) / study.name / "runs")
        except FileNotFoundError:
            return {}
        out = {}
        for _, r in result.verdicts[result.verdicts["claim"].isin(claims)].iterrows():
            ratio = divergence_text(study, r, str(r["contrast"]))
            out[int(r["claim"])] = (
                f"{r['verdict']}: {100 * r['estimate']:+.1f} {UNITS[r['outcome']]} [{100 * r['lo']:+.1f}, "
                f"{100 * r['hi']:+.1f}], {int(r['starts'])} starts, look {int(r['look'])} ({study_name}: "
                f"{r['contrast']}{'; ' + str(r['read_on']) if r.get('read_on') else ''}"
                f"{'; divergence ratio ' + ratio if ratio else ''}); {r['reason']}"
            )
        return out

    return readings
