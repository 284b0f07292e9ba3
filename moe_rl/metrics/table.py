"""The metric table of docs/metrics.md, rendered from `moe_rl.metrics.names.METRICS`.

python -m moe_rl.metrics.table --write     # rewrite the table in docs/metrics.md (no --write: check it)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from moe_rl.metrics.names import METRICS, OFFPOLICY_KEYS, OFFPOLICY_SUFFIX, PAIRS, layer_key

# --- the generated table ---------------------------------------------------------------------------
BEGIN = "<!-- metric table: generated from moe_rl/metrics/names.py by `python -m moe_rl.metrics.table --write`; "
BEGIN += "do not edit -->"
END = "<!-- end of metric table -->"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"  # the one page that holds the table


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table() -> str:
    """The markdown table of every metric, the pairs and the off-policy suffix (between BEGIN and END)."""
    rows = ["| key | meaning |", "|---|---|"]
    for metric in METRICS:
        also = f" (also per layer: `{layer_key(metric.key, '{i}')}`)" if metric.per_layer else ""
        rows.append(f"| `{_cell(metric.key)}` | {_cell(metric.meaning)}{also} |")
    offpolicy = ", ".join(f"`{key}`" for key in OFFPOLICY_KEYS)
    rows.append(
        f"| `{{key}}{OFFPOLICY_SUFFIX}` | {{key}} averaged over the off-policy updates 2..N only (update 1 "
        f"runs on the old weights, so its values are ~0), for {_cell(offpolicy)} |"
    )
    for pair, meaning in PAIRS.items():
        rows.append(f"| `{{pair}}` = `{pair}` | {_cell(meaning)} |")
    return "\n".join(rows)


def with_table(text: str, name: str = "the document") -> str:
    """`text` with the lines between BEGIN and END replaced by `render_table()`."""
    lines = text.split("\n")
    try:
        start, end = lines.index(BEGIN), lines.index(END)
    except ValueError:
        raise ValueError(f"{name} has no metric table markers ({BEGIN!r} ... {END!r} on lines of their own)") from None
    if end < start:
        raise ValueError(f"{name}: the metric table's end marker comes before its start")
    return "\n".join([*lines[: start + 1], render_table(), *lines[end:]])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render the metric table into markdown files, or check them.")
    parser.add_argument("files", nargs="*", type=Path, default=[PAGE], help="markdown files (default: docs/metrics.md)")
    parser.add_argument("--write", action="store_true", help="rewrite the tables (default: check, exit 1 on a diff)")
    args = parser.parse_args(argv)
    stale = []
    for path in args.files:
        text = path.read_text()
        new = with_table(text, str(path))
        if new != text:
            if args.write:
                path.write_text(new)
            stale.append(str(path))
    if stale and not args.write:
        print(
            f"metric table out of date in {', '.join(stale)}: run python -m moe_rl.metrics.table --write "
            f"{' '.join(map(str, args.files))}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":  # python -m moe_rl.metrics.table [--write]
    sys.exit(main())
