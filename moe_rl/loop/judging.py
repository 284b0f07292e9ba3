"""What the loop decides about a run as it goes: the collapse events after each step, and at the end whether a
completed run had a learning signal and a working reward (`moe_rl.metrics.collapse`, `moe_rl.metrics.verdict`)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from moe_rl.loop.checkpoint import LOOP_HISTORY_KEYS
from moe_rl.metrics.collapse import judge_collapse
from moe_rl.metrics.verdict import Verdict, history_verdict
from moe_rl.run.folder import RunWriter, note_meta

log = logging.getLogger(__name__)
History = dict[str, list[tuple[int, float]]]


def judge_step(
    history: History, writer: RunWriter, collapse: Any, step: int, metrics: dict[str, float], seen: set[str]
) -> None:
    """The step's outcomes into the history, and the collapse events judged on it so far (`collapse`: the config's
    collapse section). An event stands while performance has not recovered: the last step's label is the whole
    run's. A trigger's first firing is logged and added to `seen`."""
    for key in LOOP_HISTORY_KEYS:
        if key in metrics:  # task/accuracy only at evaluation steps
            history[key].append((step, metrics[key]))
    judged = judge_collapse(history, **vars(collapse))
    for event in judged.collapsed:
        if event.trigger not in seen:
            seen.add(event.trigger)
            log.warning("collapse at step %d: %s (%s)", event.step, event.trigger, event.detail)
    writer.events = [dataclasses.asdict(e) for e in judged.collapsed]  # as status.json records them
    writer.recovered = [dataclasses.asdict(e) for e in judged.recovered]


def signal_verdict(
    history: History, writer: RunWriter, signal: Any, *, completions_per_step: int, cold_start: dict
) -> Verdict | None:
    """A completed run's `no_signal` / `reward_failed` verdict from the steps' reward statistics (`signal`: the
    config's signal section), warned of and noted in meta.json; None: none."""
    verdict = history_verdict(
        history,
        completions_per_step=completions_per_step,
        no_signal_steps=signal.no_signal_steps,
        max_reward_error_frac=signal.max_reward_error_frac,
        cold_start=cold_start,
    )
    if verdict is not None:
        log.warning("run %s: %s", verdict.status, verdict.reason)
        note_meta(writer.dir / "meta.json", "warnings", f"{verdict.status}: {verdict.reason}")
    return verdict
