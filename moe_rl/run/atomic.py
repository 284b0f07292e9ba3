"""One way to write a file so that no reader ever sees it half-written."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def write_atomic(path: str | Path, data: bytes | str | Callable[[IO[bytes]], None]) -> None:
    """Write `data` (bytes, text, or a function writing to a binary file) to a temporary file in
    the same folder, then rename it onto `path`; on failure the temporary file is removed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
