"""Report of a drift-scaling results folder: per-run drift, the power-law fit with seed-bootstrap
intervals, held-out checks, the extrapolation to Qwen3-30B-A3B and the flip-vs-margin curve.

    python -m moe_rl.drift_report results/drift_scaling/runs --out results/drift_scaling

Writes drift_table.csv (one row per run), points.csv (one row per design point), fit.json (read
by the claims table), flip_vs_margin.csv, summary.md and the figures drift_scaling.png and
flip_vs_margin.png (`moe_rl.studies.drift_scaling_report`, the report itself).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

from moe_rl.studies.drift_scaling_report import write_report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--wall", default=None, help="wall time of the sweep, quoted in summary.md")
    parser.add_argument("--n-boot", type=int, default=2000)
    args = parser.parse_args(argv)
    matplotlib.use("Agg")
    out = args.out or args.root
    write_report(args.root, out, wall=args.wall, n_boot=args.n_boot)
    print(f"wrote {out}/summary.md, fit.json, points.csv, drift_table.csv and figures")


if __name__ == "__main__":
    main()
