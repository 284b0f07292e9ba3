"""Collapse detection (docs/design.md §3): pure Python over a run's (step, value) records, no torch, so
analysis can recompute any definition without importing the training stack. Re-exported by
`moe_rl.metrics.ratio_stats`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moe_rl.metrics.names import LOSS, OPTIM_GRAD_NORM, POLICY_ENTROPY, REWARD_MEAN, TASK_ACCURACY


@dataclass(frozen=True)
class CollapseEvent:
    """The first step at which a collapse trigger fired."""

    step: int
    trigger: str
    detail: str


@dataclass(frozen=True)
class CollapseJudgement:
    """A run's trigger firings split by whether performance recovered by the end of its history.

    `collapsed`: the events that stand (the run's collapse; empty: not collapsed). `recovered`: dips a
    performance trigger caught that the run had recovered from by its last record (not a collapse;
    each detail says by how much). Both sorted by step; every event keeps its first firing's step.
    """

    collapsed: list[CollapseEvent]
    recovered: list[CollapseEvent]


TRIGGERS = ("nonfinite", "reward_drop", "reward_below_start", "accuracy_below_start", "entropy_collapse")
# The metrics the triggers read, as (step, value) records: what a caller keeps for `detect_collapse`.
HISTORY_KEYS = (LOSS, OPTIM_GRAD_NORM, REWARD_MEAN, POLICY_ENTROPY, TASK_ACCURACY)
# definition -> the triggers it uses (nonfinite and entropy_collapse, which checks both levels, are in both)
DEFINITIONS = {
    "absolute": ("nonfinite", "reward_drop", "entropy_collapse"),
    "relative": ("nonfinite", "reward_below_start", "accuracy_below_start", "entropy_collapse"),
}
# The one default definition: the loop's label (`CollapseConfig`) and the analysis' main definition
# (`moe_rl.analysis.collapse_definitions`) both read it, so a run's status.json and its report agree.
MAIN_DEFINITION = "relative"
# The version of the collapse rule (`judge_collapse` under the main definition) that labelled a run: written into every
# status.json, by the loop and by scripts/relabel_collapse.py, so folders labelled by different rules can be told
# apart. Bump it with any change to the triggers, their defaults or the recovered-dip logic.
RULE_VERSION = 1


def _rolling_means(values: Sequence[float], window: int) -> list[float | None]:
    """Mean of the last `window` values at each index; None until `window` values exist."""
    out: list[float | None] = []
    for j in range(len(values)):
        out.append(math.fsum(values[j + 1 - window : j + 1]) / window if j + 1 >= window else None)
    return out


def detect_collapse(history: Mapping[str, Sequence[tuple[int, float]]], **kwargs: Any) -> list[CollapseEvent]:
    """The collapse events of a run that stand at the end of `history`: `judge_collapse(...).collapsed`
    (same arguments). Empty: the run did not collapse (it may have recovered from a dip)."""
    return judge_collapse(history, **kwargs).collapsed


def judge_collapse(
    history: Mapping[str, Sequence[tuple[int, float]]],
    *,
    definition: str = MAIN_DEFINITION,
    reward_window: int = 10,
    reward_drop_frac: float = 0.5,
    reward_floor: float = 0.2,
    entropy_floor: float = 0.05,
    entropy_window: int = 10,
    baseline_window: int = 10,
    accuracy_drop_frac: float = 0.5,
    accuracy_patience: int = 2,
) -> CollapseJudgement:
    """A run's trigger firings, at most one per trigger (its first step), judged at the end of `history`.

    `history` maps a metric key to its (step, value) records in step order; keys used are
    `loss`, `optim/grad_norm`, `reward/mean`, `policy/entropy` and (relative) `task/accuracy`
    (a missing key disables the triggers that need it). Windows count logged records, not raw
    steps. `definition` picks the triggers (DEFINITIONS):
      nonfinite         `loss` or `optim/grad_norm` is NaN or +-inf at a step.
      reward_drop       (absolute) the rolling mean of `reward/mean` over the last `reward_window`
                        records (defined once that many exist) is below `reward_drop_frac` times the
                        best rolling mean seen at earlier records, and that best is above `reward_floor`.
                        A run whose reward never passes the floor can never fire it.
      reward_below_start (relative) the rolling reward is below `reward_drop_frac` times the run's
                        early level: the mean of its first `baseline_window` reward records.
      accuracy_below_start (relative) `task/accuracy` is below `accuracy_drop_frac` times its first
                        record (the step-0 evaluation of the cold start) at `accuracy_patience`
                        consecutive evaluations (one evaluation of 128 prompts has a standard error
                        of ~4 pp); the event's step is the last of them, when a monitor would know.
      entropy_collapse  (both) a collapse of the policy, not its convergence: the mean of the last
                        `entropy_window` `policy/entropy` records is below `entropy_floor` AND performance
                        has fallen materially by that step, with the drop fractions above: the rolling
                        reward is below `reward_drop_frac` times its best earlier rolling mean (once that
                        passed `reward_floor`) or times the start level, or the last `accuracy_patience`
                        evaluations are below `accuracy_drop_frac` times the first. Low entropy alone, or
                        with a reward wobble, is a converged policy and never fires.
    The relative triggers measure each run against its own start, so an arm whose reward never
    climbs (e.g. GSPO's clipped updates under stress) is judged like one that climbs and falls.

    A collapse is a loss of performance the run does not recover from. A performance trigger's event
    (every trigger but `nonfinite`, which always stands) stands only if its condition on performance
    still holds at the end of `history`, on the trigger's own signal:
      reward_drop        the last rolling reward is below `reward_drop_frac` times the best rolling
                         reward of the records before it (the run's best, recoveries included);
      reward_below_start the last rolling reward is below `reward_drop_frac` times the start level;
      accuracy_below_start the last `accuracy_patience` evaluations are below `accuracy_drop_frac`
                         times the first;
      entropy_collapse   performance is still fallen at the last step of the history, by the test the
                         trigger used (reward against best or start, or accuracy); entropy need not
                         stay low (a policy that lost its performance has collapsed either way).
    And whatever its trigger, a performance event stands only if the run did not end above its cold
    start: a history whose last `task/accuracy` record is above its first (the step-0 evaluation) lost
    no performance, so a fall of its reward from a peak (e.g. in the last steps, with none left to
    recover) is not a collapse. Without a later evaluation this test does not apply.
    Otherwise the event moves to `recovered`: a dip, recorded with how it recovered, not a collapse.
    A standing event keeps its first step, so the time to collapse is that of the first firing. On
    a prefix of a run (the loop, each step) the same call gives the events that stand so far.
    """
    if definition not in DEFINITIONS:
        raise ValueError(f"definition={definition!r} is not valid; valid: {sorted(DEFINITIONS)}")
    for name, w in (
        ("reward_window", reward_window),
        ("entropy_window", entropy_window),
        ("baseline_window", baseline_window),
        ("accuracy_patience", accuracy_patience),
    ):
        if w < 1:
            raise ValueError(f"windows must be >= 1, got {name}={w}")
    use = DEFINITIONS[definition]
    first: dict[str, CollapseEvent] = {}

    for key in (LOSS, OPTIM_GRAD_NORM):
        for step, value in history.get(key, ()):
            if not math.isfinite(value):
                if "nonfinite" not in first or step < first["nonfinite"].step:
                    first["nonfinite"] = CollapseEvent(step, "nonfinite", f"{key}={value}")
                break

    reward = list(history.get(REWARD_MEAN, ()))
    rolling = _rolling_means([v for _, v in reward], reward_window)

    if "reward_drop" in use:
        best = -math.inf
        for (step, _), roll in zip(reward, rolling):
            if roll is None:
                continue
            if best > reward_floor and roll < reward_drop_frac * best:
                detail = f"rolling reward {roll:.4g} < {reward_drop_frac} * best {best:.4g} (window {reward_window})"
                first["reward_drop"] = CollapseEvent(step, "reward_drop", detail)
                break
            best = max(best, roll)

    if "reward_below_start" in use and len(reward) >= baseline_window:
        start = math.fsum(v for _, v in reward[:baseline_window]) / baseline_window
        for j, ((step, _), roll) in enumerate(zip(reward, rolling)):
            if roll is not None and j >= baseline_window - 1 and roll < reward_drop_frac * start:
                detail = (
                    f"rolling reward {roll:.4g} < {reward_drop_frac} * start {start:.4g} "
                    f"(window {reward_window}; start = first {baseline_window} records)"
                )
                first["reward_below_start"] = CollapseEvent(step, "reward_below_start", detail)
                break

    accuracy = list(history.get(TASK_ACCURACY, ()))
    if "accuracy_below_start" in use and len(accuracy) > 1 and accuracy[0][1] > 0:
        start_step, start = accuracy[0]
        run = 0
        for step, value in accuracy[1:]:
            run = run + 1 if value < accuracy_drop_frac * start else 0
            if run >= accuracy_patience:
                detail = (
                    f"accuracy {value:.4g} < {accuracy_drop_frac} * step-{start_step} accuracy {start:.4g} "
                    f"at {accuracy_patience} consecutive evaluations"
                )
                first["accuracy_below_start"] = CollapseEvent(step, "accuracy_below_start", detail)
                break

    if "entropy_collapse" in use:
        fallen = _performance_fell(
            reward,
            rolling,
            accuracy,
            reward_drop_frac=reward_drop_frac,
            reward_floor=reward_floor,
            baseline_window=baseline_window,
            accuracy_drop_frac=accuracy_drop_frac,
            accuracy_patience=accuracy_patience,
        )
        entropy = list(history.get(POLICY_ENTROPY, ()))
        for (step, _), level in zip(entropy, _rolling_means([v for _, v in entropy], entropy_window)):
            if level is None or not level < entropy_floor:
                continue
            why = fallen(step)
            if why:
                detail = f"entropy {level:.4g} < {entropy_floor} (mean of {entropy_window} records) and {why}"
                first["entropy_collapse"] = CollapseEvent(step, "entropy_collapse", detail)
                break

    holds = _still_fallen(
        reward,
        rolling,
        accuracy,
        reward_drop_frac=reward_drop_frac,
        reward_floor=reward_floor,
        baseline_window=baseline_window,
        accuracy_drop_frac=accuracy_drop_frac,
        accuracy_patience=accuracy_patience,
    )
    collapsed, recovered = [], []
    for event in sorted(first.values(), key=lambda e: (e.step, TRIGGERS.index(e.trigger))):
        still, how = holds(event.trigger)
        if still:
            collapsed.append(event)
        else:
            recovered.append(CollapseEvent(event.step, event.trigger, f"{event.detail}; recovered: {how}"))
    return CollapseJudgement(collapsed, recovered)


def _still_fallen(
    reward: Sequence[tuple[int, float]],
    rolling: Sequence[float | None],
    accuracy: Sequence[tuple[int, float]],
    *,
    reward_drop_frac: float,
    reward_floor: float,
    baseline_window: int,
    accuracy_drop_frac: float,
    accuracy_patience: int,
) -> Callable[[str], tuple[bool, str]]:
    """trigger -> (whether its performance condition still holds at the end of the history, why not).

    Read only for a trigger that fired, so the records its condition needs exist.
    """
    last_roll = rolling[-1] if rolling else None
    earlier = [r for r in rolling[:-1] if r is not None]
    best = max(earlier) if earlier else -math.inf
    start = (
        math.fsum(v for _, v in reward[:baseline_window]) / baseline_window if len(reward) >= baseline_window else None
    )
    acc_start = accuracy[0][1] if accuracy else 0.0
    last_acc = accuracy[max(1, len(accuracy) - accuracy_patience) :]

    def reward_vs_best() -> tuple[bool, str]:
        if last_roll is None or not best > reward_floor:
            return False, "no rolling reward to judge"
        held = last_roll < reward_drop_frac * best
        return held, f"final rolling reward {last_roll:.4g} >= {reward_drop_frac} * best {best:.4g}"

    def reward_vs_start() -> tuple[bool, str]:
        if last_roll is None or start is None:
            return False, "no rolling reward to judge"
        held = last_roll < reward_drop_frac * start
        return held, f"final rolling reward {last_roll:.4g} >= {reward_drop_frac} * start {start:.4g}"

    def accuracy_vs_start() -> tuple[bool, str]:
        if acc_start <= 0 or len(last_acc) < accuracy_patience:
            return False, "no evaluations to judge"
        held = all(v < accuracy_drop_frac * acc_start for _, v in last_acc)
        return held, (
            f"final accuracy {last_acc[-1][1]:.4g} (last {accuracy_patience} evaluations not all < "
            f"{accuracy_drop_frac} * step-{accuracy[0][0]} accuracy {acc_start:.4g})"
        )

    def own_test(trigger: str) -> tuple[bool, str]:
        if trigger == "reward_drop":
            return reward_vs_best()
        if trigger == "reward_below_start":
            return reward_vs_start()
        if trigger == "accuracy_below_start":
            return accuracy_vs_start()
        # entropy_collapse: the tests `_performance_fell` applies, at the end of the history
        tests = (reward_vs_best(), reward_vs_start(), accuracy_vs_start())
        if any(held for held, _ in tests):
            return True, ""
        return False, "; ".join(how for _, how in tests if not how.startswith("no "))

    # a run whose last evaluation is above its step-0 evaluation ended above its cold start: it lost
    # no performance, whatever its reward did on the way
    above_start = len(accuracy) > 1 and accuracy[-1][1] > acc_start

    def holds(trigger: str) -> tuple[bool, str]:
        if trigger == "nonfinite":
            return True, ""
        held, how = own_test(trigger)
        if held and above_start:
            return False, (
                f"ended above its cold start (final accuracy {accuracy[-1][1]:.4g} > step-{accuracy[0][0]} "
                f"accuracy {acc_start:.4g})"
            )
        return held, how

    return holds


def _performance_fell(
    reward: Sequence[tuple[int, float]],
    rolling: Sequence[float | None],
    accuracy: Sequence[tuple[int, float]],
    *,
    reward_drop_frac: float,
    reward_floor: float,
    baseline_window: int,
    accuracy_drop_frac: float,
    accuracy_patience: int,
) -> Callable[[int], str]:
    """step -> why performance had fallen materially by then ("" if it had not), for the entropy trigger.

    Fallen: the rolling reward at the latest reward record at or before the step is below
    `reward_drop_frac` times the best rolling reward of earlier records (once that best passed
    `reward_floor`) or times the start level (the mean of the first `baseline_window` records); or the
    last `accuracy_patience` evaluations at or before the step are all below `accuracy_drop_frac` times
    the first one.
    """
    steps = [s for s, _ in reward]
    why_reward: list[str] = []
    best = -math.inf
    start = (
        math.fsum(v for _, v in reward[:baseline_window]) / baseline_window if len(reward) >= baseline_window else None
    )
    for j, roll in enumerate(rolling):
        why = ""
        if roll is not None:
            if best > reward_floor and roll < reward_drop_frac * best:
                why = f"rolling reward {roll:.4g} < {reward_drop_frac} * best {best:.4g}"
            elif start is not None and j >= baseline_window - 1 and roll < reward_drop_frac * start:
                why = f"rolling reward {roll:.4g} < {reward_drop_frac} * start {start:.4g}"
            best = max(best, roll)
        why_reward.append(why)
    acc_steps = [s for s, _ in accuracy]
    acc_start = accuracy[0][1] if accuracy else 0.0

    def fallen(step: int) -> str:
        j = bisect.bisect_right(steps, step) - 1
        if j >= 0 and why_reward[j]:
            return why_reward[j]
        i = bisect.bisect_right(acc_steps, step)  # evaluations at or before `step`
        last = accuracy[max(1, i - accuracy_patience) : i]
        if (
            acc_start > 0
            and len(last) == accuracy_patience
            and all(v < accuracy_drop_frac * acc_start for _, v in last)
        ):
            return f"accuracy {last[-1][1]:.4g} < {accuracy_drop_frac} * step-{accuracy[0][0]} accuracy {acc_start:.4g}"
        return ""

    return fallen
