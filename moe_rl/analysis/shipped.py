"""A rerun's summary table against the shipped one: per arm and outcome, whether it has the same bits, lies within the
shipped 95% interval of the mean over starts, or outside it (`python -m moe_rl.analysis.shipped SHIPPED NEW`, as the
main job prints it). The shipped interval is the spread a rerun on another CPU (other kernels, so other numbers within
seed variation) is expected to land in; on the CPU that made the shipped runs the main job repeats their bits."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd

SAME, WITHIN, OUTSIDE, MISSING = "same bits", "within", "outside", "missing"


def compare_summaries(shipped: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    """One row per arm and outcome (each `<outcome>_mean` with its `<outcome>_ci95` in the shipped table): the shipped
    mean and its 95% half-width, the new mean, and how they stand (`SAME`, `WITHIN`, `OUTSIDE`, `MISSING`)."""
    shipped, new = shipped.set_index("arm"), new.set_index("arm")
    outcomes = [c.removesuffix("_mean") for c in shipped.columns if c.endswith("_mean")]
    rows = []
    for arm in shipped.index:
        for name in outcomes:
            mean, half = float(shipped.at[arm, f"{name}_mean"]), shipped.get(f"{name}_ci95")
            half = float(half[arm]) if half is not None else math.nan
            value = float(new.at[arm, f"{name}_mean"]) if arm in new.index and f"{name}_mean" in new else math.nan
            if math.isnan(mean):
                continue
            if math.isnan(value):
                status = MISSING
            elif value == mean:
                status = SAME
            elif not math.isnan(half) and abs(value - mean) <= half:
                status = WITHIN
            else:
                status = OUTSIDE
            rows.append(
                {"arm": arm, "outcome": name, "shipped": mean, "ci95": half, "this run": value, "status": status}
            )
    return pd.DataFrame(rows)


def verdict(table: pd.DataFrame) -> str:
    """One line: the same bits everywhere, within the shipped intervals, or where not."""
    counts = table["status"].value_counts()
    n = len(table)
    if counts.get(SAME, 0) == n:
        return f"SAME BITS as the shipped table ({n} arm x outcome means)"
    off = table[table["status"].isin([OUTSIDE, MISSING])]
    head = f"{counts.get(SAME, 0)} of {n} means with the same bits, {counts.get(WITHIN, 0)} within the shipped 95% interval"
    if off.empty:
        return f"WITHIN THE SHIPPED INTERVALS: {head}"
    where = ", ".join(f"{r.arm} {r.outcome} ({r.status})" for r in off.itertuples())
    return f"NOT ALL WITHIN: {head}; {len(off)} outside or missing: {where}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("shipped", type=Path, help="the shipped summary.csv (e.g. results/compare/summary.csv)")
    ap.add_argument("new", type=Path, help="the rerun's summary.csv")
    args = ap.parse_args(argv)
    for path in (args.shipped, args.new):
        if not path.is_file():
            sys.exit(f"error: {path}: no such summary table")
    table = compare_summaries(pd.read_csv(args.shipped), pd.read_csv(args.new))
    shown = table[table["status"] != SAME]
    if not shown.empty:
        print(shown.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print(f"against {args.shipped}: {verdict(table)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
