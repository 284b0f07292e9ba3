"""Notes added to a run's meta.json after it was written (e.g. a warning raised mid-run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moe_rl.atomic import write_atomic


def note_meta(path: str | Path, key: str, message: Any) -> None:
    """Append `message` to the list `key` of the JSON file at `path` (created if missing), atomically."""
    path = Path(path)
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        meta = {}
    meta.setdefault(key, []).append(message)
    write_atomic(path, json.dumps(meta, indent=1, default=str))
