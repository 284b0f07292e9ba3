"""Relabel finished run folders with the current collapse rule, from their own metrics.

    python scripts/relabel_collapse.py [ROOT ...] [--dry-run]     (default ROOT: results)

For every run folder under ROOT (a `status.json` next to a `metrics.parquet`) whose status is one
the collapse rule decides (completed, collapsed, no_signal, reward_failed), recompute its collapse
events with `moe_rl.metrics.collapse.detect_collapse` under the collapse settings of its own `config.yaml`
(keys a folder predates at the values it was labelled with), as the loop would record them if it
ran that config now: the events that stand at the end of the run, and the dips it recovered from
(`moe_rl.metrics.collapse.judge_collapse`; a recovered dip is not a collapse). Where the standing events
differ from those recorded, or the run has none, the status is re-judged as the loop sets it: `collapsed`
with events, else the `no_signal` / `reward_failed` verdict (`moe_rl.metrics.verdict`) or `completed`
(so a run labelled before the verdict existed says today whether it learned anything). Rewrites
`status.json` where that, its `recovered_events` or its `collapse_rule` (the rule's version,
`moe_rl.metrics.collapse.RULE_VERSION`) changed (other fields kept) and prints each change.
Rerunnable: a second run changes nothing. Diverged, failed, invalid and running folders are left
as they are (a non-finite loss stops a run; its label does not depend on the thresholds).
Torch-free.

    python scripts/relabel_collapse.py [ROOT ...] --grid

checks instead, writing nothing, that no run which ends above its cold start (its last `task/accuracy`
above its step-0 one) is collapsed under any definition of the declared grid
(`moe_rl.analysis.collapse_definitions.definition_grid`); it prints each that is, and exits 1 if any.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from moe_rl.analysis.collapse_definitions import definition_grid, run_history
from moe_rl.metrics.collapse import RULE_VERSION, CollapseEvent, judge_collapse
from moe_rl.metrics.names import REWARD_ERRORS, REWARD_MEAN, REWARD_ZERO_VAR_GROUP_FRAC, TASK_ACCURACY
from moe_rl.metrics.status import COLLAPSED, COMPLETED, NO_SIGNAL, REWARD_FAILED
from moe_rl.metrics.verdict import run_verdict
from moe_rl.run.atomic import write_atomic

RELABELLED = (COMPLETED, COLLAPSED, NO_SIGNAL, REWARD_FAILED)
# moe_rl.config.SignalConfig's defaults, for folders written before the `signal` section existed
SIGNAL_DEFAULTS = {"no_signal_steps": 20, "max_reward_error_frac": 0.5}
# the collapse keys added after runs were shipped, at the values those runs were labelled with (the
# loop's default definition was `absolute` until it became the analysis' main definition)
COLLAPSE_BEFORE_KEYS = {
    "definition": "absolute",
    "baseline_window": 10,
    "accuracy_drop_frac": 0.5,
    "accuracy_patience": 2,
}
_COLLAPSE_ARGS = [k for k in inspect.signature(judge_collapse).parameters if k != "history"]


def relabel(run: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(old status.json, new status.json) of the run folder `run`, recomputed from its metrics."""
    old = json.loads((run / "status.json").read_text())
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    collapse = {**COLLAPSE_BEFORE_KEYS, **{k: v for k, v in (cfg.get("collapse") or {}).items() if k in _COLLAPSE_ARGS}}
    frame = pd.read_parquet(run / "metrics.parquet", columns=["step", "key", "value"])
    judged = judge_collapse(run_history(frame), **collapse)
    events = judged.collapsed
    new = {**old, "collapse_events": [_record(e) for e in events], "collapse_rule": RULE_VERSION}
    new.pop("recovered_events", None)
    if judged.recovered:  # as the loop writes it: only when there are any
        new["recovered_events"] = [_record(e) for e in judged.recovered]
    if events:
        if new["collapse_events"] != old.get("collapse_events", []) or old["status"] != COLLAPSED:
            new.pop("reason", None)
        new["status"] = COLLAPSED
        return old, new
    new.pop("reason", None)
    wide = frame[frame["step"] >= 1].pivot_table(index="step", columns="key", values="value")
    signal = {**SIGNAL_DEFAULTS, **(cfg.get("signal") or {})}
    meta = json.loads((run / "meta.json").read_text()) if (run / "meta.json").is_file() else {}
    column = lambda key, fill: wide[key].fillna(fill).tolist() if key in wide else [fill] * len(wide)  # noqa: E731
    verdict = run_verdict(
        [int(s) for s in wide.index],
        column(REWARD_ZERO_VAR_GROUP_FRAC, 0.0),
        column(REWARD_ERRORS, 0.0),
        column(REWARD_MEAN, 0.0),
        completions_per_step=cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["group_size"],
        no_signal_steps=signal["no_signal_steps"],
        max_reward_error_frac=signal["max_reward_error_frac"],
        cold_start=meta.get("cold_start"),
    )
    new["status"] = verdict.status if verdict else COMPLETED
    if verdict:
        new["reason"] = verdict.reason
    return old, new


def _record(event: CollapseEvent) -> dict[str, Any]:
    return {"step": event.step, "trigger": event.trigger, "detail": event.detail}


def _triggers(status: dict[str, Any]) -> str:
    out = ", ".join(f"{e['trigger']}@{e['step']}" for e in status.get("collapse_events", [])) or "-"
    recovered = ", ".join(f"{e['trigger']}@{e['step']}" for e in status.get("recovered_events", []))
    return f"{out}; recovered {recovered}" if recovered else out


def grid_collapses(run: Path) -> list[str] | None:
    """The grid definitions under which `run` is collapsed, if it ends above its cold start (else None)."""
    history = run_history(pd.read_parquet(run / "metrics.parquet", columns=["step", "key", "value"]))
    accuracy = history.get(TASK_ACCURACY, [])
    if len(accuracy) < 2 or not accuracy[-1][1] > accuracy[0][1]:
        return None
    return [name for name, kwargs in definition_grid().items() if judge_collapse(history, **kwargs).collapsed]


def _runs(roots: list[Path]) -> list[Path]:
    """The run folders under `roots` whose label the collapse rule decides."""
    return [
        path.parent
        for root in roots
        for path in sorted(root.rglob("status.json"))
        if (path.parent / "metrics.parquet").is_file() and json.loads(path.read_text())["status"] in RELABELLED
    ]


def check_grid(roots: list[Path]) -> int:
    above = bad = 0
    for run in _runs(roots):
        names = grid_collapses(run)
        if names is None:
            continue
        above += 1
        if names:
            bad += 1
            print(f"{run}: ends above its cold start, collapsed under {len(names)} definitions: {', '.join(names)}")
    print(f"{above} runs end above their cold start; collapsed under some definition of the grid: {bad}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="*", type=Path, default=[Path("results")])
    parser.add_argument("--dry-run", action="store_true", help="print the changes, write nothing")
    parser.add_argument("--grid", action="store_true", help="check the grid on runs that end above their start")
    args = parser.parse_args(argv)
    if args.grid:
        return check_grid(args.roots)
    moves: Counter[tuple[str, str]] = Counter()
    seen = 0
    for run in _runs(args.roots):
        seen += 1
        old, new = relabel(run)
        if new == old:
            continue
        moves[(old["status"], new["status"])] += 1
        print(f"{run}: {old['status']} ({_triggers(old)}) -> {new['status']} ({_triggers(new)})")
        if not args.dry_run:
            write_atomic(run / "status.json", json.dumps(new, indent=1))
    summary = ", ".join(f"{a} -> {b}: {n}" for (a, b), n in sorted(moves.items())) or "none"
    print(f"{seen} run folders relabelled from their metrics; changed: {summary}{' (dry run)' if args.dry_run else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
