"""The report of one folder of runs: summary.md, summary.csv, tests.csv, figures and the phase map.

`write_report(runs_dir, out, by=[...])` groups the runs by `by` (every other run key that varies is added to
the grouping unless `pool` names it), tests each group against a reference, and writes the page and its
files; the helpers below write a table, a figure or a paragraph after a page's title, each to a temporary
name renamed into place, so a reader never sees a half-written report. A study with a report of its own
(`moe_rl.studies`) builds on these.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from moe_rl import analysis
from moe_rl.analysis.clustered import MIN_UNITS
from moe_rl.analysis.collapse_definitions import ALTERNATIVE_DEFINITION, DEFINITION_TEXT, MAIN_DEFINITION
from moe_rl.analysis.configs import format_starts, group_checks, run_starts, start_covariates, with_config
from moe_rl.analysis.load import INCOMPLETE_STATUSES
from moe_rl.analysis.phase import REFERENCE_ARM, cell_label
from moe_rl.analysis.provenance import load_provenance, provenance_line
from moe_rl.analysis.shift import plot_shift_dynamics
from moe_rl.metrics.names import ROUTE_LOAD_ENTROPY, ROUTE_SHIFT_MEAN
from moe_rl.metrics.status import NO_SIGNAL, REWARD_FAILED
from moe_rl.run.atomic import write_atomic

FIGURES: dict[str, Callable[..., object]] = {
    "flip_rate.png": lambda df, by, events: analysis.plot_flip_rate(df, by=by),
    "layer_heatmap.png": lambda df, by, events: analysis.plot_layer_heatmap(df, by=by),
    "load_entropy.png": lambda df, by, events: analysis.plot_layer_heatmap(df, by=by, key=ROUTE_LOAD_ENTROPY),
    "flip_by_position.png": lambda df, by, events: analysis.plot_flip_by_position(df, by=by),
    "ratio_variance.png": lambda df, by, events: analysis.plot_ratio_variance(df, by=by),
    "reward_accuracy.png": lambda df, by, events: analysis.plot_reward_accuracy(df, events=events, by=by),
}
PHASE_AXES = ("lr", "N")
WALL_LINE = re.compile(r"^Wall time of the sweep on 2 cores: (.+)\.$", re.M)


def kept_wall(out: Path) -> str | None:
    """The sweep's wall time that out/summary.md quotes, if it is there."""
    old = out / "summary.md"
    found = WALL_LINE.search(old.read_text()) if old.is_file() else None
    return found.group(1) if found else None


def after_title(summary: Path, text: str) -> None:
    """Insert `text` (and a blank line) after the title line of `summary`."""
    title, _, rest = summary.read_text().partition("\n")
    page = f"{title}\n\n{text}\n{rest}"
    write_atomic(summary, lambda f: f.write(page.encode()))


def write_csv(path: Path, table: pd.DataFrame) -> Path:
    write_atomic(path, lambda f: f.write(table.to_csv(index=False).encode()))
    return path


def write_png(path: Path, fig: Figure) -> Path:
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120))
    return path


VARIANT_TEXT = {
    "auto": "Route flips and ratio variances of runs with N > 1 are their off-policy values (updates 2..N, "
    "`<key>/offpolicy`; update 1 runs on the old weights and flips nothing); runs with N = 1 show "
    "every update.",
    "all": "Route flips and ratio variances average every update, update 1 (on the old weights, no flips) included.",
    "offpolicy": "Route flips and ratio variances are off-policy values (updates 2..N); — where a run logged none.",
}


def _runs_line(df: pd.DataFrame, by: list[str], root: Path) -> str:
    table = analysis.runs(df)
    per_group = table.groupby(by, dropna=False).size()
    seeds = ", ".join(str(s) for s in sorted(table["seed"].unique())) if "seed" in table else "?"
    count = f"{per_group.iloc[0]}" if per_group.nunique() == 1 else f"{per_group.min()}–{per_group.max()}"
    line = (
        f"{len(table)} runs from `{root}`: {len(per_group)} group(s) by {', '.join(by)}, "
        f"{count} run(s) each (seeds {seeds})."
    )
    for statuses, what in (
        (INCOMPLETE_STATUSES, "Incomplete (running, failed or no status.json)"),
        ((NO_SIGNAL, REWARD_FAILED), "Learned nothing (see each run's status.json `reason`)"),
    ):
        some = table[table["status"].isin(statuses)]
        if len(some):
            line += f" {what}: " + ", ".join(f"`{r}` ({s})" for r, s in zip(some["run"], some["status"])) + "."
    return line


def _grouping_line(by: list[str], added: list[str], pooled: list[str]) -> str:
    line = f"Grouped by {', '.join(by)}"
    if added:
        line += (
            f"; {', '.join(added)} also {'varies' if len(added) == 1 else 'vary'} across runs and "
            f"{'was' if len(added) == 1 else 'were'} added to the grouping (pass "
            f"`--pool {' '.join(added)}` to average over them)"
        )
    line += f". Pooled within a group: {', '.join(pooled)}."
    return line


def _events_lines(events: pd.DataFrame, by: list[str]) -> list[str]:
    if events.empty:
        return ["No collapse events."]
    lines = []
    for _, e in events.iterrows():
        keys = ", ".join(f"{c}={e[c]}" for c in [*by, "seed"] if c in e.index)
        detail = f": {e['detail']}" if e["detail"] else ""
        lines.append(f"- `{e['run']}` ({keys}): step {e['step']}, trigger `{e['trigger']}`{detail}")
    return lines


def _tests_section(tests: pd.DataFrame, groups: list[str], compare: str) -> list[str]:
    ref = tests.attrs.get("reference")
    return [
        f"## Tests against {compare} = {ref}",
        "",
        (
            f"Within each group of the other keys, every {compare} against {ref}. Collapsed: k of n runs with a 95% "
            f"Wilson interval (below {MIN_UNITS} starts in either arm: the counts alone, no interval and no p), in loop (status.json) and under the `{MAIN_DEFINITION}` definition recomputed from the "
            f"metrics ({DEFINITION_TEXT[MAIN_DEFINITION]}); p: Boschloo's exact test, two-sided. Δ: paired by seed "
            "(same cold start and prompts), with the cold start as the unit: the mean over starts of the mean paired "
            "difference, its 95% t interval over start means and the two-sided p of the same t (the interval excludes 0 "
            "exactly when p < 0.05; the declared studies' statistic), P(better) = share of starts where the arm beats the reference. Below "
            f"{MIN_UNITS} independent starts a Δ is descriptive: no interval and no p (runs from one start say nothing "
            "about another). Holm-adjusted p in parentheses, over each column's tests. Reward AUC: area under the "
            "mean-reward curve divided by the steps "
            "(a mean reward)."
        ),
        "",
        analysis.format_arm_tests_markdown(
            tests,
            groups=groups,
            collapse_cols={
                "collapsed_in_loop": "collapsed (in loop)",
                f"collapsed_{MAIN_DEFINITION}": f"collapsed ({MAIN_DEFINITION})",
            },
        ),
    ]


def _phase_section(
    outcomes: pd.DataFrame, axes: tuple[str, ...], reference: str
) -> tuple[list[str], dict, pd.DataFrame]:
    """Markdown lines, figures {name: Figure} and the phase table (main definition) of the phase map."""
    lines = ["## Phase map", ""]
    figs: dict[str, object] = {}
    tables = []
    sig: dict[str, set] = {}
    for definition in (MAIN_DEFINITION, ALTERNATIVE_DEFINITION):
        table = analysis.phase_table(outcomes, axes=axes, definition=definition)
        has_ref = reference in set(outcomes["arm"])
        tests = (
            analysis.phase_tests(outcomes, axes=axes, reference=reference, definition=definition) if has_ref else None
        )
        tables.append(table.assign(definition=definition))
        label = "main" if definition == MAIN_DEFINITION else "alternative"
        lines += [
            f"### Collapse definition `{definition}` ({label})",
            "",
            DEFINITION_TEXT[definition] + ".",
            "",
            analysis.format_phase_markdown(table, tests, axes=axes),
        ]
        suffix = "" if definition == MAIN_DEFINITION else f"_{definition}"
        figs[f"phase_map{suffix}.png"] = analysis.plot_phase_map(
            table, axes=axes, title=f"P(collapse) per cell, {definition} definition (k/n runs)"
        )
        if definition == MAIN_DEFINITION and outcomes[f"collapsed_{definition}"].any():
            figs["survival.png"] = analysis.plot_survival(outcomes, definition=definition, axes=axes)
        if tests is not None and len(tests):
            figs[f"phase_difference{suffix}.png"] = analysis.plot_phase_difference(tests, axes=axes)
            sig[definition] = set(tests.loc[tests["significant"], [*axes, "arm"]].itertuples(index=False, name=None))
    lines[2:2] = [
        (
            f"Per ({', '.join(axes)}) cell and arm: the cold starts and runs behind it, collapse probability with a 95% "
            "Wilson interval, the mean step of the first collapse over the runs that collapsed, final accuracy and "
            "reward AUC with 95% hierarchical bootstrap intervals (starts, then runs within each). p: Boschloo's exact "
            f"test of {reference} against the arm in the same cell, Holm-adjusted over every testable cell and arm (a "
            "cell where all runs of both arms ended alike is untestable and left out); * = significant at 0.05 after "
            f"Holm. Below {MIN_UNITS} independent starts a cell is descriptive: no interval and no test (its runs "
            "share their starts' weights)."
        ),
        "",
    ]
    if len(sig) == 2:
        a, b = sig[MAIN_DEFINITION], sig[ALTERNATIVE_DEFINITION]
        lines += [
            "### Does anything depend on the definition?",
            "",
            "Significance: the same cells are significant under both definitions."
            if a == b
            else f"Significance: significant only under `{MAIN_DEFINITION}`: {sorted(a - b) or 'none'}; only under "
            f"`{ALTERNATIVE_DEFINITION}`: {sorted(b - a) or 'none'}.",
            "",
            _moved_counts(tables, axes),
            "",
        ]
    return lines, figs, pd.concat(tables, ignore_index=True)


def _moved_counts(tables: list[pd.DataFrame], axes: list[str], share: float = 0.25) -> str:
    """Cells whose collapse count moves by `share` of the runs or more between the two definitions:
    where a binary call depends on the threshold, not on the runs."""
    key = [*axes, "arm"]
    both = tables[0].merge(tables[1], on=key, suffixes=("", "_alt"))
    moved = both[(both["p_collapse"] - both["p_collapse_alt"]).abs() >= share]
    if moved.empty:
        return f"Counts: no cell and arm moves by {share:.0%} of its runs or more between the definitions."
    cells = "; ".join(
        f"{cell_label(key, [r[c] for c in key])}: {r['k']}/{r['n']} vs {r['k_alt']}/{r['n_alt']}"
        for _, r in moved.iterrows()
    )
    return (
        f"Counts: {len(moved)} cell(s) and arm(s) move by {share:.0%} of their runs or more "
        f"(`{MAIN_DEFINITION}` vs `{ALTERNATIVE_DEFINITION}`): {cells}."
    )


def _sweep_axis(df: pd.DataFrame, groups: list[str], compare: str) -> str | None:
    """A numeric grouping key besides the comparison with >= 3 values (e.g. N in the offpolicy sweep)."""
    table = analysis.runs(df)
    for c in groups:
        if c != compare and pd.api.types.is_numeric_dtype(table[c]) and table[c].nunique() >= 3:
            return c
    return None


def build_markdown(
    root: Path,
    df: pd.DataFrame,
    summary: pd.DataFrame,
    events: pd.DataFrame,
    by: list[str],
    figures: list[str],
    *,
    grouping_line: str = "",
    variant: str = "all",
    extra: list[str] | None = None,
) -> str:
    """The text of summary.md."""
    experiments = sorted(df["experiment"].astype(str).unique()) if "experiment" in df else []
    parts = [
        f"# Results: {', '.join(experiments) or root.resolve().name}",
        "",
        _runs_line(df, by, root),
        "",
        provenance_line(load_provenance(root)),
        "",
        *([grouping_line, ""] if grouping_line else []),
        "Per-run means over all steps (old-vs-new route flips, ratio statistics before clipping), then "
        "mean ± SD across seeds: their spread, not an interval (the tests below count the cold starts behind a "
        "difference). " + VARIANT_TEXT[variant] + " Final accuracy is each run's last evaluation; the gain is over "
        "step 0. Routing share: the routing part's share of the token "
        "log-ratio variance (`ratio/split/routing_share`, next to the ratio variance it splits). — marks a metric "
        "the runs did not log.",
        "",
        analysis.format_summary_markdown(summary),
        *(extra or []),
        "## Collapse events (in loop)",
        "",
        *_events_lines(events, by),
        "",
    ]
    if figures:
        parts += ["## Figures", ""] + [f"![{Path(f).stem}]({f})" for f in figures] + [""]
    return "\n".join(parts)


def write_report(
    results_dir: Path,
    out: Path,
    *,
    by: list[str],
    pool: list[str] | None = None,
    variant: str = "auto",
    reference: str | None = None,
    phase_axes: tuple[str, ...] = PHASE_AXES,
) -> list[Path]:
    """Write summary.md, summary.csv, tests.csv, figures (and the phase map when the runs vary in
    `phase_axes`) for the runs under `results_dir` into `out`; return the paths written."""
    df = with_config(analysis.load_results(results_dir), pool or [])  # runs of other configs stay apart
    pool = [p for p in pool or [] if p in df.columns]  # config keys in `pool` were pooled by with_config
    events = analysis.load_events(results_dir)
    groups, added, pooled = analysis.grouping(df, by, pool)
    summary = analysis.summarize(df, by=groups, variant=variant, pool=pool)
    checks = group_checks(df, groups)
    for line in checks:
        print(f"warning: {line[2:]}", file=sys.stderr)
    outcomes = analysis.run_outcomes(df)
    outcomes["start"] = outcomes["run"].map(run_starts(df))  # the unit of replication of every Δ
    compare = by[0]
    tests = analysis.arm_tests(
        outcomes,
        groups=groups,
        compare=compare,
        reference=reference,
        collapse_cols=("collapsed_in_loop", f"collapsed_{MAIN_DEFINITION}"),
        pair_on=pooled,
    )
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    figs: dict[str, object] = {}
    for name, make in FIGURES.items():
        try:
            figs[name] = make(df, groups, events)
        except ValueError as err:
            print(f"skipped {name}: {err}", file=sys.stderr)
    axis = _sweep_axis(df, groups, compare)
    if axis is not None:
        values = summary_per_run(df, outcomes, variant)
        figs[f"summary_vs_{axis}.png"] = analysis.plot_metric_vs_axis(
            values,
            {"flip_rate": "flip rate", "token_var": "token ratio variance", "final_accuracy": "final accuracy"},
            axis,
            by=compare,
            logx=axis == "lr",
        )
    if any(k.startswith(ROUTE_SHIFT_MEAN) for k in df["key"].unique()):
        figs["router_shift.png"] = plot_shift_dynamics(df)  # RSPO: does router shift lead clip bursts?
    extra = _tests_section(tests, groups, compare)
    run_table = analysis.runs(df)
    if outcomes["start"].nunique() > 1:  # the starts behind the Δs, with what each start was like
        starts = start_covariates(run_table.assign(start=run_table["run"].map(outcomes.set_index("run")["start"])))
        extra += ["", "## The cold starts", "", format_starts(starts)]
    if all(a in run_table and run_table[a].nunique() > 1 for a in phase_axes) and compare == "arm":
        lines, phase_figs, phase = _phase_section(outcomes, tuple(phase_axes), REFERENCE_ARM)
        extra += lines
        figs.update(phase_figs)
        written.append(write_csv(out / "phase_map.csv", phase))
    written += [write_png(out / name, fig) for name, fig in figs.items()]
    write_csv(out / "summary.csv", summary)
    write_csv(out / "tests.csv", tests)
    grouping_line = _grouping_line(by, added, pooled)
    if checks:
        grouping_line += (
            "\n\n**Check before reading the table**: some groups hold runs that should not be "
            "pooled:\n" + "\n".join(checks)
        )
    text = build_markdown(
        results_dir, df, summary, events, groups, list(figs), grouping_line=grouping_line, variant=variant, extra=extra
    )
    write_atomic(out / "summary.md", lambda f: f.write(text.encode()))
    return [out / "summary.md", out / "summary.csv", out / "tests.csv", *written]


def summary_per_run(df: pd.DataFrame, outcomes: pd.DataFrame, variant: str) -> pd.DataFrame:
    """One row per run: outcomes plus the flip rate and token ratio variance in the chosen variant."""
    values = outcomes.set_index("run")
    values["flip_rate"] = analysis.variant_per_run(df, analysis.SUMMARY_METRICS["flip_rate"], variant)
    values["token_var"] = analysis.variant_per_run(df, analysis.SUMMARY_METRICS["token_var"], variant)
    return values.reset_index()


StudyReport = Callable[[Path, Path, Path], list[Path]]  # (runs_dir, out, presets folder) -> the files written


def with_provenance(writer: StudyReport) -> StudyReport:
    """A study's report whose summary.md also names where its runs came from (after its title)."""

    def write(runs_dir: Path, out: Path, presets: Path) -> list[Path]:
        written = writer(runs_dir, out, presets)
        after_title(out / "summary.md", provenance_line(load_provenance(runs_dir)))
        return written

    return write
