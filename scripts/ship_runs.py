"""Copy the small files of each finished run (metrics, status, config, meta) next to a shipped report.

    python scripts/ship_runs.py runs/phase results/phase/runs [--drop-prefix route/flip_vs_margin/ ...] [--new-only]

Checkpoints and route snapshots stay behind. `--drop-prefix` removes metric keys from the copied
metrics.parquet to keep committed folders small (the report notes which). `--new-only` leaves runs already shipped
untouched (extra seeds added to a shipped sweep). `--finished` copies only runs whose status.json says they ended (a
sweep still running beside it leaves its runs in progress behind).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pandas as pd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--drop-prefix", nargs="*", default=[])
    parser.add_argument("--new-only", action="store_true", help="skip runs whose metrics are already shipped")
    parser.add_argument("--finished", action="store_true", help="only runs whose status.json says they ended")
    args = parser.parse_args()
    n = 0
    for metrics in sorted(args.src.rglob("metrics.parquet")):
        run = metrics.parent
        out = args.dst / run.relative_to(args.src)
        if args.new_only and (out / "metrics.parquet").exists():
            continue
        if args.finished and not _ended(run):
            continue
        out.mkdir(parents=True, exist_ok=True)
        frame = pd.read_parquet(metrics)
        if args.drop_prefix:
            frame = frame[~frame["key"].str.startswith(tuple(args.drop_prefix))]
        frame.to_parquet(out / "metrics.parquet", index=False, compression="zstd")
        for name in ("status.json", "config.yaml", "meta.json"):
            if (run / name).is_file():
                shutil.copy2(run / name, out / name)
        n += 1
    print(f"copied {n} runs from {args.src} to {args.dst}")


def _ended(run: Path) -> bool:
    """Whether the run's status.json exists and says anything but running."""
    status = run / "status.json"
    return status.is_file() and json.loads(status.read_text()).get("status") not in (None, "running")


if __name__ == "__main__":
    main()
