"""Write a report of a results folder: summary.md, summary.csv and figures; the claims page; all of it.

    python -m moe_rl.report RESULTS_DIR [--out OUT_DIR] [--by arm [N ...]] [--pool KEY ...]
                            [--variant auto|all|offpolicy] [--ref ARM]
    python -m moe_rl.report --claims [RESULTS_ROOT]                # RESULTS_ROOT/CLAIMS.md
    python -m moe_rl.report --collapse-definitions [RESULTS_ROOT]  # RESULTS_ROOT/collapse_definitions.md
    python -m moe_rl.report --all [RESULTS_ROOT]                   # every RESULTS_ROOT/*/runs (or */), then both pages

`--all` writes each folder's report next to its runs (drift_scaling through moe_rl.analysis.drift_scaling_report).

`--by` names the comparison (default arm); every other run key that varies is added to the
grouping unless `--pool` names it, and summary.md says what was added and what was pooled. Runs
are pooled only when they share every config key except the seed (their `config.yaml`): other
differences (a reward, a step count, a data file) become a `config` column of the grouping, unless
`--pool` names those keys too (e.g. `--pool task.reward`). A group whose runs repeat a seed or ran
different numbers of steps is flagged at the top of summary.md. When
the runs vary in learning rate and N the report adds the phase map. Every file is written to a
temporary name and renamed into place, so a reader never sees a half-written report.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib
import pandas as pd
from matplotlib.figure import Figure

from moe_rl import analysis
from moe_rl.analysis.claims import runs_folder
from moe_rl.analysis.collapse_definitions import ALTERNATIVE_DEFINITION, DEFINITION_TEXT, MAIN_DEFINITION
from moe_rl.analysis.configs import group_checks, with_config
from moe_rl.analysis.frontier_report import claims_section as frontier_claims_section
from moe_rl.analysis.load import INCOMPLETE_STATUSES
from moe_rl.analysis.phase import REFERENCE_ARM, cell_label
from moe_rl.analysis.provenance import commits, load_provenance, provenance_line
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


def _drift_report(runs_dir: Path, out: Path) -> list[Path]:
    """The drift-scaling folder has its own report (moe_rl.analysis.drift_scaling_report, what
    `python -m moe_rl.drift_report` writes); keep the wall time it quotes."""
    from moe_rl.analysis import drift_scaling_report

    return drift_scaling_report.write_report(runs_dir, out, wall=_kept_wall(out))


def _forecast_report(runs_dir: Path, out: Path) -> list[Path]:
    """The drift-forecast folder: the curve fit and its validation (moe_rl.analysis.forecast_report, what
    `python -m moe_rl.forecast --fit` writes), wall time kept."""
    from moe_rl.analysis import forecast_report

    forecast_report.run_fit(runs_dir, out, _kept_wall(out))
    return [out / n for n in forecast_report.FILES]


def _kept_wall(out: Path) -> str | None:
    """The sweep's wall time that out/summary.md quotes, if it is there."""
    old = out / "summary.md"
    found = WALL_LINE.search(old.read_text()) if old.is_file() else None
    return found.group(1) if found else None


def _after_title(summary: Path, text: str) -> None:
    """Insert `text` (and a blank line) after the title line of `summary`."""
    title, _, rest = summary.read_text().partition("\n")
    page = f"{title}\n\n{text}\n{rest}"
    write_atomic(summary, lambda f: f.write(page.encode()))


def _with_provenance(writer: Callable[[Path, Path], list[Path]]) -> Callable[[Path, Path], list[Path]]:
    """A dedicated report whose summary.md also names where its runs came from (after its title)."""

    def write(runs_dir: Path, out: Path) -> list[Path]:
        written = writer(runs_dir, out)
        _after_title(out / "summary.md", provenance_line(load_provenance(runs_dir)))
        return written

    return write


# folders whose report also reads the runs of another folder: name -> (folder, the run keys it keeps)
BORROWS = {"stabilizers": ("dense_control", {"family": "qwen3_moe"})}


def _stabilizers_report(runs_dir: Path, out: Path) -> list[Path]:
    """The stabilizer bench: the usual report of its own runs, opened by the leaderboard of every arm against
    grpo+none, whose runs (and gspo+none's) it borrows from `dense_control` (the same configs but the name)."""
    from moe_rl.analysis import leaderboard as lb

    written = write_report(runs_dir, out, by=["arm"])
    folder, keep = BORROWS[out.name]
    own = analysis.load_results(runs_dir)
    borrowed_dir = runs_folder(out.parent, folder)
    borrowed = analysis.load_results(borrowed_dir)
    for key, value in keep.items():
        borrowed = borrowed[borrowed[key] == value]
    borrowed = borrowed[~borrowed["arm"].isin(set(own["arm"]))]
    runs = lb.per_run(pd.concat([own, borrowed], ignore_index=True))
    runs = runs[~runs["status"].isin(INCOMPLETE_STATUSES)]
    pooled = lb.leaderboard(runs)
    cells = [(cell, lb.leaderboard(g)) for cell, g in runs.groupby(["lr", "N"], sort=True)]
    frames = [pooled.assign(cell="pooled")] + [t.assign(cell=f"lr {lr:g}, N = {n}") for (lr, n), t in cells]
    csv = _csv(out / "leaderboard.csv", pd.concat(frames, ignore_index=True))
    section = lb.bench_section(runs, own_runs=set(own["run"]), runs_dir=runs_dir, borrowed_dir=borrowed_dir, keep=keep)
    section.append(lb.format_leaderboard_markdown(pooled))
    for (lr, n), table in cells:
        section += [f"lr {lr:g}, N = {n}:", "", lb.format_leaderboard_markdown(table)]
    _after_title(out / "summary.md", "\n".join(section))
    return [*written, csv]


def _mechanism_report(runs_dir: Path, out: Path) -> list[Path]:
    """The mechanism ladder: the usual report of its runs by rung, opened by the ladder (each rung's share
    of the dense - moe gap, `moe_rl.analysis.mechanism`) as a table, a csv and a figure."""
    from moe_rl.analysis.mechanism import REFERENCE, ladder_section

    written = write_report(runs_dir, out, by=["rung"], reference=REFERENCE)
    df = analysis.load_results(runs_dir)
    files, text = ladder_section(df[~df["status"].isin(INCOMPLETE_STATUSES)])
    written += [_png(out / name, v) if isinstance(v, Figure) else _csv(out / name, v) for name, v in files.items()]
    _after_title(out / "summary.md", text)
    return written


def _csv(path: Path, table: pd.DataFrame) -> Path:
    write_atomic(path, lambda f: f.write(table.to_csv(index=False).encode()))
    return path


def _png(path: Path, fig: Figure) -> Path:
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120))
    return path


def _frontier_report(runs_dir: Path, out: Path) -> list[Path]:
    """The stability frontier: the table of every arm's edges (`moe_rl.analysis.frontier_report`), a csv and a
    figure, from its runs and those of the same configs in the folders beside it."""
    from moe_rl.analysis import frontier, frontier_report

    table, text, fig = frontier_report.frontier_section(
        frontier.load_runs(dict.fromkeys(p.resolve() for p in (out.parent, runs_dir.parent.parent)))
    )
    write_atomic(out / "summary.md", lambda f: f.write(f"# frontier\n\n{text}".encode()))
    return [out / "summary.md", _csv(out / "frontier.csv", table), _png(out / "frontier.png", fig)]


# result folders with a report of their own: name -> writer(runs_dir, out)
DEDICATED_REPORTS: dict[str, Callable[[Path, Path], list[Path]]] = {
    "drift_scaling": _with_provenance(_drift_report),
    "drift_forecast": _with_provenance(_forecast_report),
    "stabilizers": _stabilizers_report,
    **dict.fromkeys(("mechanism", "mechanism_gentle", "mechanism_fine"), _with_provenance(_mechanism_report)),
    "frontier": _with_provenance(_frontier_report),
}
SHIPPED_COLLAPSE_FOLDERS = ("stress", "compare")
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
            f"Wilson interval, in loop (status.json) and under the `{MAIN_DEFINITION}` definition recomputed from the "
            f"metrics ({DEFINITION_TEXT[MAIN_DEFINITION]}); p: Boschloo's exact test, two-sided. Δ: paired by seed "
            "(same cold start and prompts), mean difference with a 95% bootstrap (BCa) interval, p from a sign-flip "
            "permutation test, P(better) = share of seeds where the arm beats the reference. Holm-adjusted p in "
            "parentheses, over each column's tests. Reward AUC: area under the mean-reward curve divided by the steps "
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
            f"Per ({', '.join(axes)}) cell and arm: collapse probability with a 95% Wilson interval, the mean step of the "
            "first collapse over the runs that collapsed, final accuracy and reward AUC with 95% bootstrap intervals "
            f"over seeds. p: Boschloo's exact test of {reference} against the arm in the same cell, Holm-adjusted over "
            "every testable cell and arm (a cell where all runs of both arms ended alike is untestable and left out); "
            "* = significant at 0.05 after Holm."
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
        "mean ± 95% Student-t half-width across seeds. " + VARIANT_TEXT[variant] + " Final accuracy is each run's "
        "last evaluation; the gain is over step 0. Routing share: the routing part's share of the token "
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
        from moe_rl.analysis.shift import plot_shift_dynamics

        figs["router_shift.png"] = plot_shift_dynamics(df)  # RSPO: does router shift lead clip bursts?
    extra = _tests_section(tests, groups, compare)
    run_table = analysis.runs(df)
    if all(a in run_table and run_table[a].nunique() > 1 for a in phase_axes) and compare == "arm":
        lines, phase_figs, phase = _phase_section(outcomes, tuple(phase_axes), REFERENCE_ARM)
        extra += lines
        figs.update(phase_figs)
        written.append(_csv(out / "phase_map.csv", phase))
    written += [_png(out / name, fig) for name, fig in figs.items()]
    _csv(out / "summary.csv", summary)
    _csv(out / "tests.csv", tests)
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


def write_claims(root: Path, out: Path | None = None) -> Path:
    """RESULTS_ROOT/CLAIMS.md from the result folders under root."""
    path = (out or root) / "CLAIMS.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = analysis.format_claims_markdown(analysis.evaluate_claims(root), root)
    sections = [*_leaderboard_section(root), *frontier_claims_section(root), *_provenance_section(root)]
    text = text.rstrip("\n") + "\n\n" + "\n".join(sections) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))
    return path


def _leaderboard_section(root: Path) -> list[str]:
    """The stabilizer bench's pooled leaderboard (its report's leaderboard.csv), for CLAIMS.md; none without it."""
    from moe_rl.analysis.leaderboard import format_leaderboard_markdown

    csv = root / "stabilizers" / "leaderboard.csv"
    if not csv.is_file():
        return []
    table = pd.read_csv(csv)
    return [
        "## Stabilizer leaderboard",
        "",
        "Every published stabilizer against grpo+none on the default model in the two cells of the phase map "
        "where it degrades (lr 3e-4 with N = 8, lr 1e-3 with N = 2), 8 seeds each, paired by cell and seed; "
        "not a claim of the papers, so no verdict. Per cell and with the rules: `stabilizers/summary.md`.",
        "",
        format_leaderboard_markdown(table[table["cell"] == "pooled"]),
    ]


def _provenance_section(root: Path) -> list[str]:
    """The commits each result folder's runs came from (their meta.json), for CLAIMS.md."""
    lines = [
        "## Provenance",
        "",
        "The commits each folder's runs were made by (meta.json; runs that recorded none name the commit that "
        "shipped them). A rerun agrees bitwise on a CPU of the same vendor and model for runs with `numerics=avx2` "
        "(on one of the same kernel set for `native` runs), and lies within seed variation elsewhere; see "
        "docs/reproducing.md.",
        "",
        "| folder | runs | commits |",
        "|---|---|---|",
    ]
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        frame = load_provenance(folder)
        if len(frame):
            lines.append(f"| {folder.name} | {len(frame)} | {', '.join(f'`{c}`' for c in commits(frame)) or '—'} |")
    return lines


def write_collapse_definitions(
    root: Path, out: Path | None = None, folders: tuple[str, ...] = SHIPPED_COLLAPSE_FOLDERS
) -> Path | None:
    """RESULTS_ROOT/collapse_definitions.md: which runs each collapse definition flags, and why."""
    frames = {}
    for name in folders:
        runs_dir = runs_folder(root, name)
        if runs_dir.is_dir() and any(runs_dir.rglob("metrics.parquet")):
            frames[f"{root.name}/{runs_dir.relative_to(root).as_posix()}"] = analysis.load_results(runs_dir)
    if not frames:
        print(f"skipped collapse_definitions.md: none of {list(folders)} under {root}", file=sys.stderr)
        return None
    path = (out or root) / "collapse_definitions.md"
    text = analysis.collapse_definitions_markdown(frames)
    write_atomic(path, lambda f: f.write(text.encode()))
    return path


def main(argv: list[str] | None = None) -> int:
    matplotlib.use("Agg")
    parser = argparse.ArgumentParser(prog="python -m moe_rl.report", description=__doc__.splitlines()[0])
    parser.add_argument(
        "results_dir",
        type=Path,
        nargs="?",
        default=None,
        help="folder searched recursively for runs (with --claims/--all: the results root, default `results`)",
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: RESULTS_DIR)")
    parser.add_argument("--by", nargs="+", default=["arm"], help="run keys to compare and group by (default: arm)")
    parser.add_argument("--pool", nargs="+", default=[], help="run keys to average over instead of grouping by")
    parser.add_argument(
        "--variant",
        choices=analysis.tables.VARIANTS,
        default="auto",
        help="route-flip / ratio-variance variant: auto (off-policy where N > 1), all, offpolicy",
    )
    parser.add_argument("--ref", default=None, help="reference value of the first --by key (default grpo+r2)")
    parser.add_argument("--claims", action="store_true", help="write RESULTS_ROOT/CLAIMS.md")
    parser.add_argument(
        "--collapse-definitions",
        action="store_true",
        help="write RESULTS_ROOT/collapse_definitions.md from the stress and compare runs",
    )
    parser.add_argument(
        "--all", action="store_true", help="report every RESULTS_ROOT/*/runs into its folder, then both pages"
    )
    args = parser.parse_args(argv)
    by = [c for item in args.by for c in item.split(",") if c]
    pool = [c for item in args.pool for c in item.split(",") if c]

    def report_one(out: Path, runs_dir: Path) -> list[Path]:
        """The report of the runs under `runs_dir` into `out`; a folder with a report of its own (e.g.
        results/stabilizers) writes it whatever the options."""
        if out.name in DEDICATED_REPORTS:
            return DEDICATED_REPORTS[out.name](runs_dir, out)
        return write_report(runs_dir, out, by=by, pool=pool, variant=args.variant, reference=args.ref)

    if args.claims or args.collapse_definitions or args.all:
        root = args.results_dir or Path("results")
        written: list[Path | None] = []
        if args.all:
            folders = [runs_folder(root, p.name) for p in sorted(root.iterdir()) if p.is_dir()]
            for runs_dir in [f for f in folders if any(f.rglob("metrics.parquet"))]:
                try:
                    written += report_one(runs_dir.parent if runs_dir.name == "runs" else runs_dir, runs_dir)
                except (FileNotFoundError, KeyError) as err:
                    print(f"skipped {runs_dir}: {err}", file=sys.stderr)
        if args.all or args.collapse_definitions:
            written.append(write_collapse_definitions(root, args.out))
        if args.all or args.claims:
            written.append(write_claims(root, args.out))
        for path in written:
            if path is not None:
                print(path)
        return 0

    if args.results_dir is None:
        parser.error("RESULTS_DIR is required (or pass --claims / --collapse-definitions / --all)")
    try:
        written = report_one(args.out or args.results_dir, args.results_dir)
    except (FileNotFoundError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
