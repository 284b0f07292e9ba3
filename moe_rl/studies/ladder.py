"""The routing-dominance ladder: where routing carries the divergence. Each rung is a model geometry and the task its
members warm up and train on (a subfolder of the runs, `<runs>/<rung>/`), run with GRPO without replay off-policy
across new pool members at a bracket of lrs; per rung and lr, the accuracy change (where the rung's edge lies) beside
what routing does per off-policy update: routing's share of the token log-ratio variance, the log-probability change
per changed route (how much the experts a flip swaps differ), the activated experts changed, the top-k sets changed
and the tokens with a changed route in some layer, each a run mean with its 95% t interval over starts."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from moe_rl.analysis.folder_report import with_provenance
from moe_rl.analysis.load import load_results, run_lr
from moe_rl.analysis.outcomes import finished_runs
from moe_rl.analysis.power import interval_text
from moe_rl.metrics.names import (
    RATIO_SPLIT_FLIP_LOGP,
    RATIO_SPLIT_ROUTING_SHARE,
    ROUTE_EXPERT_FLIP_FRAC,
    ROUTE_FLIP_RATE,
    ROUTE_TOKEN_FLIP_RATE,
    TASK_ACCURACY,
    offpolicy_key,
)
from moe_rl.run.atomic import write_atomic
from moe_rl.studies.ladder_mission import mission_section

COLUMNS = {  # column: (metric key, what it is)
    "routing_share": (offpolicy_key(RATIO_SPLIT_ROUTING_SHARE), "routing's share of the token log-ratio variance"),
    "flip_logp": (
        offpolicy_key(RATIO_SPLIT_FLIP_LOGP),
        "the log-probability change per changed route, in millinats: how much experts differ",
    ),
    "experts_changed": (offpolicy_key(ROUTE_EXPERT_FLIP_FRAC), "activated experts changed per off-policy update"),
    "topk_changed": (offpolicy_key(ROUTE_FLIP_RATE), "top-k sets changed per off-policy update"),
    "tokens_changed": (offpolicy_key(ROUTE_TOKEN_FLIP_RATE), "tokens with a changed route in some MoE layer"),
}
UNIT = {"flip_logp": "mnat"}  # x 1000 (millinats); every other column x 100 (pp)
PAPERS = (
    "The papers' figures: ~10% of activated experts change per gradient update on Qwen3-30B-A3B (128 experts, "
    "top-8, 48 layers; GSPO arXiv 2507.18071); ~94% of tokens are routed differently in at least one layer between "
    "inference and training (R3 arXiv 2510.11370)."
)


def per_run(runs_dir: Path) -> pd.DataFrame:
    """One row per finished run: its rung (subfolder), lr, start, change, floor (late accuracy 0), and the run
    mean of each of `COLUMNS` (steps 1..end; NaN where not logged)."""
    frames = []
    for rung in sorted(p for p in Path(runs_dir).iterdir() if p.is_dir() and any(p.rglob("metrics.parquet"))):
        df = load_results(rung, keys=[TASK_ACCURACY, *(k for k, _ in COLUMNS.values())])
        table = finished_runs(df)
        for name, (key, _) in COLUMNS.items():
            table[name] = df[(df["key"] == key) & (df["step"] >= 1)].groupby("run")["value"].mean()
        table["rung"] = rung.name
        table["lr"] = [run_lr(Path(str(r))) for r in table["run_dir"]]
        table["floor"] = table["late_accuracy"] <= 0
        frames.append(table[["rung", "lr", "start", "change", "floor", *COLUMNS]].reset_index(drop=True))
    if not frames:
        raise FileNotFoundError(f"no finished runs under {runs_dir}/<rung>/")
    return pd.concat(frames, ignore_index=True)


def ladder_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per rung and lr: starts, the accuracy change and each routing column (pp, mean [95% t interval]), the share of
    runs at the floor."""
    rows = []
    for (rung, lr), g in runs.groupby(["rung", "lr"], sort=True):
        row = {"rung": rung, "lr": f"{lr:g}", "starts": g["start"].nunique(), "change (pp)": interval_text(g["change"])}
        row["at the floor"] = f"{int(g['floor'].sum())} of {len(g)}"
        for name in COLUMNS:
            unit = UNIT.get(name, "pp")
            row[f"{name} ({unit})"] = interval_text(g[name], 1000.0 if unit == "mnat" else 100.0)
        rows.append(row)
    return pd.DataFrame(rows)


def write_ladder_report(runs_dir: Path, out: Path, presets: Path | None = None) -> list[Path]:
    """<out>/summary.md and ladder.csv from the rungs under `runs_dir`; with `presets`, the mission's comparison per
    rung from the declared studies beside it (`moe_rl.studies.ladder_mission`)."""
    runs = per_run(runs_dir)
    table = ladder_table(runs)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "ladder.csv", runs.to_csv(index=False).encode())
    legend = "; ".join(f"`{k}`: {what} (`{key}`)" for k, (key, what) in COLUMNS.items())
    lines = [
        "# The routing-dominance ladder: a pilot",
        "",
        "GRPO without replay, N = 8 updates per rollout, 200 steps, one run per pool member and lr; each rung a model "
        "geometry and a task, with a warm-up of its own per member (`moe_rl.studies.ladder`). A rung's edge: the lr "
        "where GRPO loses about 10-20 points with most runs above the floor. Each column: the mean over starts of the "
        "run means, with its 95% t interval over starts, x 100 (x 1000 for `flip_logp`, logged by runs from "
        "commit e46d213 on; — where a rung's runs predate it). " + legend + ".",
        "",
        table.to_markdown(index=False),
        "",
        PAPERS,
        "",
    ]
    if presets is not None:  # the declared studies beside this one: <root>/<study>/runs
        lines += mission_section(Path(runs_dir).parent.parent, presets)
    write_atomic(out / "summary.md", "\n".join(lines).encode())
    return [out / "summary.md", out / "ladder.csv"]


report = with_provenance(
    write_ladder_report
)  # the report its declaration names: summary.md says where its runs came from
