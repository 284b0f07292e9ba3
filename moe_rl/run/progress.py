"""Progress a person can follow: a bar for an interactive run, log lines otherwise.

A run shows a tqdm bar when `progress=true` and it runs alone (parallel runs would garble each
other's bars on one terminal); with `progress=false` it logs one line every `log_every` steps
(step, reward, flip rate, accuracy when known, steps/s, ETA) to its train.log and the console.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from moe_rl.metrics.names import REWARD_MEAN, ROUTE_FLIP_RATE, TASK_ACCURACY

log = logging.getLogger("moe_rl.train")


def format_duration(seconds: float) -> str:
    """`1h02m`, `3m04s`, `12s`; `?` when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def eta_seconds(done: int, total: int, elapsed: float) -> float:
    """Time left at the mean pace so far (`done` units in `elapsed` s, `total` in all); inf if unknown."""
    if done <= 0 or elapsed <= 0:
        return math.inf
    return (total - done) * elapsed / done


def progress_fields(metrics: dict[str, float], accuracy: float | None) -> dict[str, str]:
    """The short fields a bar or a line shows; accuracy only once an evaluation has measured it."""
    fields = {"reward": f"{metrics[REWARD_MEAN]:.2f}"} if REWARD_MEAN in metrics else {}
    if ROUTE_FLIP_RATE in metrics:
        fields["flip"] = f"{metrics[ROUTE_FLIP_RATE]:.3f}"
    if accuracy is not None and math.isfinite(accuracy):
        fields["acc"] = f"{accuracy:.2f}"
    return fields


def progress_line(step: int, total: int, fields: dict[str, str], rate: float, eta: float) -> str:
    """`step 20/300 reward=0.41 flip=0.031 acc=0.38 1.52 steps/s ETA 3m04s`."""
    parts = [
        f"step {step}/{total}",
        *(f"{k}={v}" for k, v in fields.items()),
        f"{rate:.2f} steps/s",
        f"ETA {format_duration(eta)}",
    ]
    return " ".join(parts)


class Progress:
    """Per-step progress of one run: a bar (`bar=True`) or a log line every `every` steps."""

    def __init__(
        self, *, total: int, initial: int, desc: str, bar: bool, every: int, accuracy: float | None = None
    ) -> None:
        self.total, self.initial, self.every = total, initial, every
        self.accuracy = accuracy
        self.flip: float | None = None  # the flip rate of the last step that ran the route instruments
        self.start = time.perf_counter()
        self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True) if bar else None

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        if TASK_ACCURACY in metrics:
            self.accuracy = float(metrics[TASK_ACCURACY])
        if ROUTE_FLIP_RATE in metrics:  # logged every `metrics.route_every` steps: show the last one between
            self.flip = float(metrics[ROUTE_FLIP_RATE])
        shown = metrics if self.flip is None else {**metrics, ROUTE_FLIP_RATE: self.flip}
        fields = progress_fields(shown, self.accuracy)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(fields)
            return
        if self.every and (step % self.every == 0 or step == self.total):
            done, elapsed = step - self.initial, time.perf_counter() - self.start
            rate = done / elapsed if elapsed > 0 else 0.0
            log.info(
                progress_line(step, self.total, fields, rate, eta_seconds(done, self.total - self.initial, elapsed))
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextmanager
def run_log(run_dir: str | Path) -> Iterator[None]:
    """Send moe_rl's INFO lines to `<run_dir>/train.log` (and the console if logging is not set up)
    for the duration of a run, unless a handler already writes that file (Hydra's job logging)."""
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 writes the run folder
        yield
        return
    path = (Path(run_dir) / "train.log").resolve()
    root, package = logging.getLogger(), logging.getLogger("moe_rl")
    handlers = [h for lg in (root, package) for h in lg.handlers]
    added: list[logging.Handler] = []
    if not any(getattr(h, "baseFilename", None) == str(path) for h in handlers):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        added.append(logging.FileHandler(path))
        if not root.handlers:
            added.append(logging.StreamHandler(sys.stderr))
    old_level = package.level
    if added and (package.getEffectiveLevel() > logging.INFO):
        package.setLevel(logging.INFO)
    formatter = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    for handler in added:
        handler.setFormatter(formatter)
        handler.setLevel(logging.INFO)
        package.addHandler(handler)
    try:
        yield
    finally:
        for handler in added:
            package.removeHandler(handler)
            handler.close()
        package.setLevel(old_level)
