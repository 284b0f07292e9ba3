"""Collapse recomputed after the fact from a run's logged metrics, under several definitions.

The loop labels a run with its configured definition; analysis recomputes every definition from
`metrics.parquet` with the same function (`moe_rl.metrics.collapse.detect_collapse`), so arms can be
compared under one definition whatever their runs were configured with.

- `relative` (main, and the loop's default): against the run's own start: rolling reward below half
  the mean of its first 10 reward records, or eval accuracy below half its step-0 accuracy at 2
  consecutive evaluations (plus non-finite loss/gradient and entropy collapse). Fair to an arm whose
  reward never climbs.
- `absolute` (alternative): rolling reward below half its running best once that best passed 0.2
  (plus non-finite and entropy collapse).

In both, an entropy collapse is a loss of performance with low entropy, never low entropy alone:
entropy (mean of 10 records) below 0.05 while the reward, or accuracy, has fallen by the same drop
fraction against the run's best or start.

In both, and at every point of the grid, a collapse is a loss the run does not recover from: a
performance trigger's event stands only if its condition still holds at the run's last record (its
final rolling reward, or its last evaluations, still below the fraction); otherwise it is a recovered
dip, listed but not a collapse (`moe_rl.metrics.collapse.judge_collapse`); and no performance event stands
in a run whose last evaluation is above its step-0 evaluation (it ended above its cold start). A standing
event keeps the step of its first firing.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from moe_rl.analysis.load import run_key_columns
from moe_rl.metrics.collapse import HISTORY_KEYS, MAIN_DEFINITION, judge_collapse
from moe_rl.metrics.names import REWARD_MEAN, TASK_ACCURACY

ALTERNATIVE_DEFINITION = "absolute"
# The parameters both definitions share: `detect_collapse`'s defaults, which `CollapseConfig` repeats
# (a test keeps the three equal).
_SHARED = {
    "reward_window": 10,
    "reward_drop_frac": 0.5,
    "reward_floor": 0.2,
    "entropy_floor": 0.05,
    "entropy_window": 10,
    "baseline_window": 10,
    "accuracy_drop_frac": 0.5,
    "accuracy_patience": 2,
}
# name -> detect_collapse keyword arguments
COLLAPSE_DEFINITIONS: dict[str, dict] = {name: {"definition": name, **_SHARED} for name in ("relative", "absolute")}
# A declared grid of reasonable definitions (claims report the share of it that gives each verdict):
# both definitions, drop fractions 0.3-0.7 (reward and accuracy alike), for the relative accuracy
# trigger a patience of 1-4 consecutive evaluations, and for the entropy trigger floors 0.02-0.1 on
# entropy averaged over 1 or 10 records. Each main definition is one point of the grid.
GRID_DROP_FRACS = (0.3, 0.4, 0.5, 0.6, 0.7)
GRID_PATIENCES = (1, 2, 3, 4)
GRID_ENTROPY_FLOORS = (0.02, 0.05, 0.1)
GRID_ENTROPY_WINDOWS = (1, 10)


def _entropy_suffix(floor: float, window: int) -> str:
    """Name suffix of an entropy grid point; empty at the defaults, so the older names stay valid."""
    return "" if (floor, window) == (_SHARED["entropy_floor"], _SHARED["entropy_window"]) else f":e{floor:g}:w{window}"


def main_definition_kwargs() -> dict:
    """`detect_collapse` keyword arguments of the main definition (`COLLAPSE_DEFINITIONS[MAIN_DEFINITION]`)."""
    return COLLAPSE_DEFINITIONS[MAIN_DEFINITION]


def definition_grid() -> dict[str, dict]:
    """Name -> `detect_collapse` keyword arguments for every point of the declared grid
    ("relative:d0.5:p2" is the main definition, "absolute:d0.5" the alternative; a non-default entropy
    rule adds ":e<floor>:w<window>")."""
    grid = {}
    for floor in GRID_ENTROPY_FLOORS:
        for window in GRID_ENTROPY_WINDOWS:
            entropy = {"entropy_floor": floor, "entropy_window": window}
            suffix = _entropy_suffix(floor, window)
            for frac in GRID_DROP_FRACS:
                for patience in GRID_PATIENCES:
                    grid[f"relative:d{frac:g}:p{patience}{suffix}"] = {
                        **COLLAPSE_DEFINITIONS["relative"],
                        **entropy,
                        "reward_drop_frac": frac,
                        "accuracy_drop_frac": frac,
                        "accuracy_patience": patience,
                    }
                grid[f"absolute:d{frac:g}{suffix}"] = {
                    **COLLAPSE_DEFINITIONS["absolute"],
                    **entropy,
                    "reward_drop_frac": frac,
                }
    return grid


_ENTROPY_TEXT = (
    "or entropy (mean of 10 records) < 0.05 while the rolling reward is < 0.5 x its best or its start, or "
    "accuracy < 0.5 x step 0 (low entropy alone is convergence, not collapse); an event stands only if "
    "the run has not recovered by its end (final rolling reward, or last evaluations, still below the "
    "fraction) and does not end above its step-0 accuracy: a recovered dip is not a collapse"
)
DEFINITION_TEXT = {
    "relative": "rolling reward (10 steps) < 0.5 x the mean of the run's first 10 rewards, or eval accuracy "
    f"< 0.5 x its step-0 accuracy at 2 consecutive evaluations; or non-finite loss/gradient; {_ENTROPY_TEXT}",
    "absolute": "rolling reward (10 steps) < 0.5 x its running best once that best passed 0.2; or non-finite "
    f"loss/gradient; {_ENTROPY_TEXT}",
}


def run_history(run: pd.DataFrame) -> dict[str, list[tuple[int, float]]]:
    """(step, value) records in step order of the keys collapse detection reads, from one run's rows."""
    sub = run.loc[run["key"].isin(HISTORY_KEYS), ["key", "step", "value"]].sort_values("step", kind="stable")
    return {k: list(zip(g["step"].astype(int), g["value"].astype(float))) for k, g in sub.groupby("key")}


def collapse_events(df: pd.DataFrame, definitions: Mapping[str, dict] | None = None) -> pd.DataFrame:
    """One row per (run, definition): run keys, definition, collapsed, step (first event), trigger, detail.

    `definitions` maps a name to `detect_collapse` keyword arguments (default COLLAPSE_DEFINITIONS).
    `triggers` lists every collapse event that stands, in step order; `recovered` the dips a trigger
    caught that the run recovered from by its end (not a collapse).
    """
    definitions = COLLAPSE_DEFINITIONS if definitions is None else definitions
    keys = run_key_columns(df)
    rows = []
    for _, g in df.groupby("run", sort=True):
        history = run_history(g)
        info = g.iloc[0][keys].to_dict()
        for name, kwargs in definitions.items():
            judged = judge_collapse(history, **kwargs)
            events = judged.collapsed
            first = events[0] if events else None
            rows.append(
                {
                    **info,
                    "definition": name,
                    "collapsed": first is not None,
                    "step": float(first.step) if first else float("nan"),
                    "trigger": first.trigger if first else "",
                    "detail": first.detail if first else "",
                    "triggers": ", ".join(f"{e.trigger}@{e.step}" for e in events),
                    "recovered": ", ".join(f"{e.trigger}@{e.step}" for e in judged.recovered),
                }
            )
    return pd.DataFrame(rows)


def collapse_wide(events: pd.DataFrame) -> pd.DataFrame:
    """`collapse_events` as one row per run: collapsed_<def>, collapse_step_<def>, trigger_<def>."""
    wide = events.pivot(index="run", columns="definition", values=["collapsed", "step", "trigger"])
    wide.columns = [f"{'collapse_step' if v == 'step' else v}_{d}" for v, d in wide.columns]
    wide = wide.astype({c: bool for c in wide.columns if c.startswith("collapsed_")})
    return wide.copy().reset_index()  # the copy consolidates the columns' blocks (else pandas warns of fragmentation)


def _cell(collapsed: bool, step: float, trigger: str) -> str:
    return f"step {int(step)} `{trigger}`" if collapsed else "—"


def collapse_definitions_markdown(frames: Mapping[str, pd.DataFrame], *, group: str = "arm") -> str:
    """Markdown comparing the definitions on result folders: counts per arm, then every run and why.

    `frames` maps a title (e.g. "results/stress/runs") to a `load_results` frame. The in-loop
    column is what the run's status.json recorded.
    """
    names = list(COLLAPSE_DEFINITIONS)
    lines = [
        "# Collapse definitions on the shipped runs",
        "",
        (
            "Generated by `python -m moe_rl.report --collapse-definitions`; recomputed from each run's "
            "metrics.parquet with `moe_rl.metrics.collapse.detect_collapse`."
        ),
        "",
    ]
    lines += [f"- **{n}**{' (main)' if n == MAIN_DEFINITION else ''}: {DEFINITION_TEXT.get(n, '')}" for n in names]
    lines.append("")
    for title, df in frames.items():
        events = collapse_events(df)
        wide = collapse_wide(events)
        info = df.drop_duplicates("run").set_index("run")
        lines += [
            f"## `{title}`",
            "",
            f"| {group} | runs | in loop | " + " | ".join(names) + " |",
            "|:---|---:|---:|" + "---:|" * len(names),
        ]
        wide[group] = wide["run"].map(info[group])
        wide["in_loop"] = wide["run"].map(info["n_collapse_events"] > 0)
        for value, g in wide.groupby(group, sort=True):
            counts = [f"{int(g[f'collapsed_{n}'].sum())} of {len(g)}" for n in names]
            lines.append(f"| {value} | {len(g)} | {int(g['in_loop'].sum())} of {len(g)} | " + " | ".join(counts) + " |")
        lines += [
            "",
            "| run | "
            + " | ".join(f"{n}: first event" for n in names)
            + f" | why ({MAIN_DEFINITION}) | why ({ALTERNATIVE_DEFINITION}) |",
            "|:---|" + "---:|" * len(names) + ":---|:---|",
        ]
        by_run = events.set_index(["run", "definition"])
        for run in sorted(wide["run"]):
            cells = [_cell(*by_run.loc[(run, n), ["collapsed", "step", "trigger"]]) for n in names]
            rows = df[df["run"] == run]
            main = _why(by_run.loc[(run, MAIN_DEFINITION)]) or _no_event_reason(rows)
            alt = _why(by_run.loc[(run, ALTERNATIVE_DEFINITION)]) or _no_absolute_reason(rows)
            lines.append(f"| `{run}` | " + " | ".join(cells) + f" | {main} | {alt} |")
        lines.append("")
    return "\n".join(lines)


def _why(row: pd.Series) -> str:
    """The first standing event's detail, else the dips the run recovered from ("" if neither)."""
    if row["detail"]:
        return str(row["detail"])
    return f"recovered dip {row['recovered']} (not a collapse)" if row["recovered"] else ""


def _no_event_reason(run: pd.DataFrame) -> str:
    """Why no definition fired: the lowest rolling reward vs the start and the lowest accuracy vs step 0."""
    reward = run.loc[run["key"] == REWARD_MEAN].sort_values("step")["value"]
    acc = run.loc[run["key"] == TASK_ACCURACY].sort_values("step")["value"]
    parts = []
    if len(reward) >= 10:
        parts.append(f"min rolling reward {reward.rolling(10).mean().min():.3g} vs start {reward.iloc[:10].mean():.3g}")
    if len(acc) > 1:
        parts.append(f"accuracy {acc.iloc[0]:.2f} -> min {acc.iloc[1:].min():.2f}")
    return "no trigger: " + "; ".join(parts) if parts else "no trigger"


def _no_absolute_reason(run: pd.DataFrame) -> str:
    """Why the absolute reward trigger did not fire: the best rolling reward and the lowest after it."""
    kw = COLLAPSE_DEFINITIONS[ALTERNATIVE_DEFINITION]
    roll = run.loc[run["key"] == REWARD_MEAN].sort_values("step")["value"].rolling(kw["reward_window"]).mean()
    roll = roll.dropna().reset_index(drop=True)
    if roll.empty:
        return "no trigger: too few reward records"
    best = roll.idxmax()
    if roll[best] <= kw["reward_floor"]:
        return f"no trigger: best rolling reward {roll[best]:.3g} never passed the floor {kw['reward_floor']}"
    return f"no trigger: best rolling reward {roll[best]:.3g}, lowest after it {roll[best:].min():.3g}"
