"""The largest modules of moe_rl, longest first: a list to read when deciding where a module splits.

    python scripts/largest_modules.py [N]     (default N: 10)

Prints each module's line count and path. A module is split where its responsibilities part (docs/testing.md),
not at a line count; this list shows where to look.
"""

from __future__ import annotations

import argparse
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moe_rl"


def largest_modules(n: int = 10, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """(lines, path relative to the package's parent) of the `n` longest modules under `package`, longest first."""
    counts = [(len(p.read_text().splitlines()), str(p.relative_to(package.parent))) for p in package.rglob("*.py")]
    return sorted(counts, key=lambda c: (-c[0], c[1]))[:n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print the N largest modules of moe_rl with their line counts.")
    parser.add_argument("n", nargs="?", type=int, default=10, help="how many modules (default 10)")
    args = parser.parse_args(argv)
    for lines, path in largest_modules(args.n):
        print(f"{lines:6d}  {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
