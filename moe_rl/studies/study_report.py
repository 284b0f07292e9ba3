"""A declared study's report (`moe_rl.studies.study_rule`'s result): summary.md with the contrasts, the cells and the
starts, the forest and profile figures, the computations a declaration names in `sections`, and README.md's tables
of the studies that name `readme`."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from moe_rl.studies.design import TWINS_UNIT, UNITS, Admission, Study, declaration, load_study, study_files
from moe_rl.studies.matching import read_lrs
from moe_rl.studies.secondary import LOG_SCALE, SECONDARY
from moe_rl.studies.secondary import markdown as secondary_markdown
from moe_rl.studies.study_rule import (
    AGAINST,
    DETECTED,
    INCONCLUSIVE,
    NEGLIGIBLE,
    NOT_REPRODUCED,
    REPRODUCED,
    UNMATCHED,
    UNTESTABLE,
    StudyResult,
    analyse,
)


def forest_figure(study: Study, result: StudyResult):
    """Each contrast's estimate and repeated confidence interval, the margin shaded, claims named; below, a panel per
    secondary outcome (`result.secondary`) with each of its contrasts' estimate and 95% interval over starts."""
    from matplotlib.figure import Figure

    v, sec = result.verdicts, result.secondary
    outcomes = list(dict.fromkeys(sec["outcome"])) if len(sec) else []
    names = list(dict.fromkeys(sec["contrast"])) if len(sec) else []
    top, bottom = 0.5 + 0.45 * len(v), (1.2 + 0.3 * len(names)) if outcomes else 0.0
    fig = Figure(figsize=(max(7, 1.9 * len(outcomes)), top + bottom))
    grid = fig.add_gridspec(
        2 if outcomes else 1, max(1, len(outcomes)), height_ratios=[top, bottom] if outcomes else None
    )
    ax = fig.add_subplot(grid[0, :])
    y = np.arange(len(v))[::-1]
    margins = dict(zip(v["contrast"], v["margin"] if "margin" in v else [study.margin_of(c) for c in study.contrasts]))
    for yi, name in zip(y, v["contrast"]):  # each contrast's own margin (its outcome's units)
        ax.fill_betweenx([yi - 0.4, yi + 0.4], -margins[name], margins[name], color="0.92", zorder=0)
    ax.axvline(0, color="0.4", lw=0.8)
    colors = {REPRODUCED: "tab:green", NOT_REPRODUCED: "tab:red", INCONCLUSIVE: "tab:gray", UNTESTABLE: "tab:orange"}
    colors.update({DETECTED: "tab:green", NEGLIGIBLE: "tab:red", AGAINST: "tab:red", UNMATCHED: "tab:purple"})
    for yi, row in zip(y, v.itertuples()):
        c = colors.get(str(row.verdict), "k")
        ax.errorbar([row.estimate], [yi], xerr=[[row.estimate - row.lo], [row.hi - row.estimate]], fmt="o", color=c)
    labels = [f"{r.contrast} (claim {r.claim})" if r.claim != "exploratory" else r.contrast for r in v.itertuples()]
    ax.set_yticks(y, labels, fontsize=8)
    primary = ", ".join(dict.fromkeys(study.outcome_of(c) for c in study.contrasts))
    ax.set_xlabel(f"{primary}: paired difference (mean of start means, repeated CI at the look)", fontsize=8)
    ax.set_title(f"{study.name}: shaded, each contrast's margin (too small to matter)", fontsize=9)
    ys = np.arange(len(names))[::-1]
    for i, outcome in enumerate(outcomes):
        sub = fig.add_subplot(grid[1, i])
        rows = sec[sec["outcome"] == outcome].set_index("contrast").reindex(names)
        ratio = outcome in LOG_SCALE
        scale = 1.0 if ratio else 100.0
        est, lo, hi = (scale * rows[k].to_numpy(float) for k in ("estimate", "lo", "hi"))
        sub.errorbar(est, ys, xerr=[est - lo, hi - est], fmt="o", ms=3, color="tab:blue")
        sub.axvline(1.0 if ratio else 0.0, color="0.4", lw=0.8)
        sub.set_yticks(ys, names if i == 0 else [""] * len(names), fontsize=7)
        sub.set_title(f"{SECONDARY[outcome]} ({'x' if ratio else 'pp'})", fontsize=7)
        sub.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    return fig


def profile_figure(study: Study, result: StudyResult):
    """Per declared axis, a panel: each arm's mean of start means of the study's outcome at each level of the axis
    (x 100), with its 95% t interval over starts; None where the study declares no axis."""
    from matplotlib.figure import Figure

    if not study.axes:
        return None
    cells = result.cells.set_index("cell")
    fig = Figure(figsize=(4.2 * len(study.axes), 3.4))
    axs = fig.subplots(1, len(study.axes), squeeze=False)[0]
    for ax, (axis, levels) in zip(axs, study.axes.items(), strict=True):
        x = np.arange(len(levels))
        for arm in study.arms:
            names = [f"{arm}@{lv}" for lv in levels]
            if not any(n in cells.index for n in names):
                continue
            row = cells.reindex(names)
            mean = 100 * row[study.outcome].to_numpy(float)
            err = 100 * np.vstack([mean / 100 - row["lo"], row["hi"] - mean / 100])
            ax.errorbar(x, mean, yerr=err, marker="o", ms=3, capsize=2, lw=1, label=arm)
        ax.axhline(0, color="0.5", lw=0.6)
        ax.set_xticks(x, levels, fontsize=8)
        ax.set_title(axis, fontsize=9)
        ax.set_ylabel(f"{study.outcome} ({UNITS[study.outcome]})", fontsize=8)
    axs[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def _fmt(frame: pd.DataFrame) -> str:
    return frame.to_markdown(index=False, floatfmt=".4g")


Section = Callable[[Study, StudyResult, Path], tuple[list[str], list[Path]]]


def section_function(name: str) -> Section:
    """The computation a declaration names in `sections` ("module:function")."""
    import importlib

    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def confirmed_text(lrs: pd.DataFrame | None) -> str:
    """How many of a confirmed study's seeds their own probe placed within the tolerance (its match/lrs.csv)."""
    if lrs is None or lrs.empty:
        return ""
    n, k = len(lrs), int((lrs["status"] == "confirmed").sum())
    return f" {k} of its {n} matched seeds were within the tolerance (`confirmed`), the others at their nearest probe."


def placebo_lr_md(study: Study, result: StudyResult, lrs: pd.DataFrame | None) -> list[str]:
    """A paragraph on the lr the placebo ran at and what it did (`matching.placebo_lr`), for a study matched per start
    with a placebo whose chosen lrs are `lrs` (its match/lrs.csv); [] otherwise."""
    from moe_rl.studies.matching import placebo_lr

    read = None if lrs is None else placebo_lr(study, result.runs, lrs)
    if read is None:
        return []
    what = UNITS.get(study.outcome, "(x 100)")
    assert study.match is not None
    if not np.isfinite(read["slope"]):
        how = " over the pool" if study.match.pooled else ""
        return [
            f"The placebo's lr: brought to the reference's early KL{how}, the placebo ran every one of its "
            f"{read['n']:.0f} starts at {read['ratio']:.3f}x the reference's lr"
            + (" (`match.per: pool`; 1: the matching put the reference back at its own lr)." if how else "."),
            "",
        ]
    from moe_rl.studies.matching import pooled_reading

    assert lrs is not None
    pooled = pooled_reading(study, lrs)
    each = "; ".join(
        f"{r.arm} {r.pooled:.2f}x ({r.status.replace('_', ' ')}, {r.n} starts; its runs {r.ran:.2f}x)"
        if np.isfinite(r.pooled)
        else f"{r.arm} none ({r.status}; its runs {r.ran:.2f}x)"
        for r in pooled.itertuples()
    )
    return [
        f"The placebo's lr: brought to the reference's early KL, the placebo ran at a median {read['ratio']:.2f}x the "
        f"reference's lr over {read['n']:.0f} starts, and its difference from the reference moves by "
        f"{100 * read['slope']:+.1f} {what} [{100 * read['lo']:+.1f}, {100 * read['hi']:+.1f}] per doubling of that "
        "multiple (least squares over starts, 95% t interval; `matching.placebo_lr`). Below 0: at equal early KL a "
        "higher lr still ends lower, so a matched arm run at another lr than its model's carries that as well. "
        "Over the pool instead (one lr per arm where the mean over starts of its bracket probes' log KL ratio to the "
        "reference's crosses 0, `matching.pooled_reading`), as multiples of the reference's lr, against the geometric "
        f"mean its runs went at: {each}.",
        "",
    ]


def write_study_report(study: Study, result: StudyResult, out: Path) -> list[Path]:
    """<out>/summary.md, cells.csv, contrasts.csv, starts.csv, runs.csv, forest.png (profile.png where the study
    declares axes) from the declaration, and the sections it names (their markdown after the contrasts): every file
    written, summary.md first."""
    from moe_rl.run.atomic import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    d = study.design
    written = []
    for name, frame in (("cells", result.cells), ("contrasts", result.verdicts), ("starts", result.starts)):
        write_atomic(out / f"{name}.csv", frame.to_csv(index=False).encode())
        written.append(out / f"{name}.csv")
    write_atomic(out / "runs.csv", result.runs.drop(columns=["run_dir"]).to_csv(index=False).encode())
    forest_figure(study, result).savefig(out / "forest.png", dpi=120)
    written += [out / "runs.csv", out / "forest.png"]
    sections_md: list[str] = []
    for name in study.sections:
        lines, files = section_function(name)(study, result, out)
        sections_md += lines
        written += files
    profile = profile_figure(study, result)
    if profile is not None:
        profile.savefig(out / "profile.png", dpi=120)
        written.append(out / "profile.png")
    shown = ["contrast", "claim", "verdict", "starts", "estimate", "lo", "hi", "bound", "look", "z", "boundary"]
    shown += ["futility", "p_repeated", "holm", "margin", "detectable", "reason"]
    own = "".join(
        f" Contrast {c.name} reads `{study.outcome_of(c)}` (MDE {study.mde_of(c):g}, margin +-{study.margin_of(c):g})."
        for c in study.contrasts
        if study.outcome_of(c) != study.outcome
    )
    a = study.admission
    rules = [
        *(["a warm-up that ended inside its band"] if a.in_band else []),
        *(
            [
                f"sampled reward >= {a.min_sampled_reward:g} and a share of held-out prompts without reward "
                f"variance <= {a.max_zero_variance:g}"
            ]
            if a.bounds_covariates
            else []
        ),
    ]
    admit = (
        f" Admitted starts: {' and '.join(rules)} (the warm-up's record); the others are listed and left out."
        if a != Admission()
        else ""
    )
    unit = TWINS_UNIT if study.by_member else f"{'new ' if not study.declared else ''}cold starts"
    out_w, out_r = result.starts[~result.starts["admitted"]], int((~result.runs["admitted"]).sum())
    left_out = f"; {len(out_w)} of {len(result.starts)} warm-ups left out, {out_r} runs" if len(out_w) else ""
    beside = ["contrast", "estimate", "kl_ratio", "kl_lo", "kl_hi"]
    match = study.match
    lrs = read_lrs(out / "match" / "lrs.csv") if match is not None and match.probes else None
    matched = (
        f"Arms are matched {match.scope} on `{match.divergence}`: a matched contrast whose ratio lies outside "
        f"[{1 / match.tolerance:.3f}, {match.tolerance:g}] reads **unmatched**"
        + (f"; the placebo `{match.placebo}` must read inside its margin." if match.placebo else ".")
        + (
            f" Each arm runs every start at one lr per level, where the mean over the first look's "
            f"{study.design.looks[0]} starts of its probes' log KL ratio to the reference's crosses 0 (`match.per: "
            "pool`, a line between neighbouring bracket multipliers): no start's lr follows its own noisy probe, and "
            "the runs' early KL, chosen by nothing, reads the ratio."
            if match.pooled
            else ""
        )
        + (
            " Each run goes at the lr of its seed's probe nearest the reference's KL among those at "
            f"{', '.join(f'x{c:g}' for c in match.confirm)} of the lr its bracket solved (`match.confirm`): the run's "
            "first steps are that probe, so its ratio was known before it ran." + confirmed_text(lrs)
            if match.confirm
            else ""
        )
        if match
        else "The study matches no arm per start: the ratio is what the arms ran at, not a declared match."
    )
    margins = (
        f"margin {d.margin_relative:g} of the reference's own loss (absolute {d.margin:g} where it has none)"
        if d.margin_relative is not None
        else f"margin {d.margin:g}"
    )
    secondary = result.secondary
    secondary_md = (
        [
            "## The mission's outcomes",
            "",
            "Secondary, paired over starts like the primary outcome, with 95% t intervals over starts (not corrected; "
            "they do not change a verdict): collapse events (difference of the share of runs that collapsed, the counts "
            "and the exact McNemar test on discordant pairs), route flips on the routes each arm acts with and on the "
            "live router's, the token importance-ratio variance over steps 1..20 and over the run (a ratio of the "
            "cells), and the clip fraction (`moe_rl.studies.secondary`).",
            "",
            secondary_markdown(secondary),
            "",
        ]
        if len(secondary)
        else []
    )
    declared = f"{study.declared} " if study.declared else f"Declared in `experiments/conf/study/{study.file.name}`. "
    declared += result.preregistration.text if result.preregistration else ""
    columns = "".join(f" `{k}`: the run mean of `{v}`." for k, v in study.columns.items())
    lines = [
        f"# Study `{study.name}`",
        "",
        f"{declared} {study.question}",
        "",
        f"Design: outcome `{study.outcome}`; MDE {d.mde:g} at power {d.power:g}, one-sided alpha {d.alpha:g} spent "
        f"over looks at {', '.join(map(str, d.looks))} starts (O'Brien-Fleming-type)"
        f"{', futility by beta spending (non-binding)' if d.futility else ''}; {margins}; "
        f"{study.seeds_per_start} seed(s) per start; sized from: {d.sized_from}.{own}{admit}",
        f"Runs: {len(result.runs)} from {result.runs['start'].nunique()} {unit} "
        f"({result.runs.loc[result.runs['admitted'], 'start'].nunique()} admitted{left_out}), "
        f"{result.runs['wall_s'].sum() / 60:.0f} min of run time in all (status.json `wall_s`); numerics domain: "
        f"{'; '.join(result.domains)}.",
        result.provenance,
        "",
        "## Contrasts",
        "",
        _fmt(result.verdicts[[c for c in shown if c in result.verdicts]]),
        "",
        "![forest](forest.png)",
        "",
        "The rule (docs/statistics.md): `z` is the one-sided t on start means in the claimed direction read as a z; "
        "reproduced at `z >= boundary`; not reproduced where `bound`, the repeated one-sided bound on the effect in "
        "the claimed direction, excludes the margin, or where z falls below the `futility` boundary; `p_repeated` "
        "is the repeated p-value Holm corrects across the study's claims (`holm`, for a contrast that reached its own "
        "boundary).",
        "",
        f"The realised divergence: `kl_ratio` is the cells' early per-update KL on the routes each arm acts with "
        f"(steps 1..20), combined as the contrast combines outcomes (1.0: equal), with its 95% t interval over "
        f"starts. {matched}",
        "",
        _fmt(result.verdicts[[c for c in beside if c in result.verdicts]]),
        "",
        *placebo_lr_md(study, result, lrs),
        *secondary_md,
        *sections_md,
        *(
            [
                "## Profiles",
                "",
                "Each arm along each declared axis (95% t interval over starts).",
                "",
                "![profile](profile.png)",
                "",
            ]
            if profile is not None
            else []
        ),
        "## Cells",
        "",
        f"Each cell's mean of start means of `{study.outcome}` with its 95% t interval over starts, the share of runs "
        f"at accuracy 0 and collapsed, and the early acting KL.{columns}",
        "",
        _fmt(result.cells),
        "",
        "## Starts",
        "",
        _fmt(result.starts),
        "",
    ]
    path = out / "summary.md"
    write_atomic(path, "\n".join(lines).encode())
    return [path, *written]


def study_report(study_name: str) -> Callable[[Path, Path, Path], list[Path]]:
    """The report of the declared study `study_name` (a `StudyReport`: runs_dir, out, presets folder -> files)."""

    def write(runs_dir: Path, out: Path, presets: Path) -> list[Path]:
        study = load_study(declaration(study_name, presets))
        return write_study_report(study, analyse(study, runs_dir), out)

    return write


def readme_tables(studies_dir: Path) -> list[tuple[tuple[str, str], Callable[[Path], str | None]]]:
    """(markers, table from the results root) of every declared study in `studies_dir` that names `readme`, in file
    order: README.md's generated tables of them."""
    out: list[tuple[tuple[str, str], Callable[[Path], str | None]]] = []
    for path in study_files(studies_dir):
        study = load_study(path)
        if study.readme is not None:
            out.append(
                (readme_markers(study.name), functools.partial(readme_table, study.name, contrasts=study.readme))
            )
    return out


def readme_markers(study_name: str) -> tuple[str, str]:
    """README.md's markers around a declared study's generated table."""
    return (f"<!-- {study_name} table: python -m moe_rl.report --readme -->", f"<!-- end of {study_name} table -->")


def readme_table(study_name: str, root: Path, contrasts: tuple[str, ...] = ()) -> str | None:
    """README.md's table of a declared study, from its shipped results/<study>/contrasts.csv: each contrast (those
    named in `contrasts`, in that order; default all), the claim it reads, its starts, estimate with the repeated
    interval (x 100, in its outcome's units), look and verdict; None where nothing is shipped."""
    path = Path(root) / study_name / "contrasts.csv"
    if not path.is_file():
        return None
    lines = [
        "| contrast | claim | starts | difference [repeated CI] | look | verdict |",
        "|:---|:---|---:|:---|---:|:---|",
    ]
    table = pd.read_csv(path, keep_default_na=False, na_values=[""])
    if contrasts:
        table = table.set_index("contrast").loc[list(contrasts)].reset_index()
    for r in table.itertuples():
        unit = UNITS[str(r.outcome)]
        interval = "" if math.isnan(float(r.lo)) else f" [{100 * r.lo:+.1f}, {100 * r.hi:+.1f}]"
        lines.append(
            f"| {r.contrast} | {r.claim} | {int(r.starts)} | {100 * r.estimate:+.1f} {unit}{interval} | {int(r.look)} "
            f"| {r.verdict} |"
        )
    return "\n".join(lines) + "\n"
