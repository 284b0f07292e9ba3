"""Write a report of a results folder: summary.md, summary.csv and figures.

    python -m moe_rl.report RESULTS_DIR [--out OUT_DIR] [--by arm [N ...]]

Every file is written to a temporary name in OUT_DIR (default RESULTS_DIR) and renamed into
place, so a reader never sees a half-written report.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib
import pandas as pd

from moe_rl import analysis
from moe_rl.atomic import write_atomic
from moe_rl.analysis.load import INCOMPLETE_STATUSES

FIGURES: dict[str, Callable[..., object]] = {
    "flip_rate.png": lambda df, by, events: analysis.plot_flip_rate(df, by=by),
    "layer_heatmap.png": lambda df, by, events: analysis.plot_layer_heatmap(df, by=by),
    "flip_by_position.png": lambda df, by, events: analysis.plot_flip_by_position(df, by=by),
    "ratio_variance.png": lambda df, by, events: analysis.plot_ratio_variance(df, by=by),
    "reward_accuracy.png": lambda df, by, events: analysis.plot_reward_accuracy(df, events=events, by=by),
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
    incomplete = table[table["status"].isin(INCOMPLETE_STATUSES)]
    if len(incomplete):
        listed = ", ".join(f"`{r}` ({s})" for r, s in zip(incomplete["run"], incomplete["status"]))
        line += f" Incomplete (running, failed or no status.json): {listed}."
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


def build_markdown(
    root: Path, df: pd.DataFrame, summary: pd.DataFrame, events: pd.DataFrame, by: list[str], figures: list[str]
) -> str:
    """The text of summary.md."""
    experiments = sorted(df["experiment"].astype(str).unique()) if "experiment" in df else []
    parts = [
        f"# Results: {', '.join(experiments) or root.resolve().name}",
        "",
        _runs_line(df, by, root),
        "",
        "Per-run means over all steps (old-vs-new route flips, ratio statistics before clipping), then "
        "mean ± 95% Student-t half-width across seeds. Final accuracy is each run's last evaluation; "
        "the gain is over step 0. — marks a metric the runs did not log.",
        "",
        analysis.format_summary_markdown(summary),
        "## Collapse events",
        "",
        *_events_lines(events, by),
        "",
    ]
    if figures:
        parts += ["## Figures", ""] + [f"![{Path(f).stem}]({f})" for f in figures] + [""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    matplotlib.use("Agg")
    parser = argparse.ArgumentParser(prog="python -m moe_rl.report", description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", type=Path, help="folder searched recursively for runs")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: RESULTS_DIR)")
    parser.add_argument("--by", nargs="+", default=["arm"], help="run keys to group by (default: arm)")
    args = parser.parse_args(argv)
    by = [c for item in args.by for c in item.split(",") if c]
    out = args.out or args.results_dir

    try:
        df = analysis.load_results(args.results_dir)
        events = analysis.load_events(args.results_dir)
        summary = analysis.summarize(df, by=by)
    except (FileNotFoundError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    figures = []
    for name, make in FIGURES.items():
        try:
            fig = make(df, by, events)
        except ValueError as err:
            print(f"skipped {name}: {err}", file=sys.stderr)
            continue
        write_atomic(out / name, lambda f, fig=fig: fig.savefig(f, format="png", dpi=120))
        figures.append(name)
        written.append(out / name)

    write_atomic(out / "summary.csv", lambda f: f.write(summary.to_csv(index=False).encode()))
    text = build_markdown(args.results_dir, df, summary, events, by, figures)
    write_atomic(out / "summary.md", lambda f: f.write(text.encode()))
    written = [out / "summary.md", out / "summary.csv", *written]
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
