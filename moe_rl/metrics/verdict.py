"""Whether a run that ran all its steps was of any use: `no_signal` and `reward_failed` (pure).

GRPO and GSPO learn only from prompt groups whose rewards differ; a run where every group of every
step scored alike changed nothing on purpose, and a run whose reward function raised on most
completions scored zeros, not answers. Such runs must not call themselves `completed`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from moe_rl.metrics.names import REWARD_ERRORS, REWARD_MEAN, REWARD_ZERO_VAR_GROUP_FRAC
from moe_rl.metrics.status import NO_SIGNAL, REWARD_FAILED


class Verdict(NamedTuple):
    status: str  # no_signal | reward_failed
    reason: str  # what happened, with numbers, and the likely cause


def longest_no_signal(zero_var: Sequence[float]) -> tuple[int, int]:
    """(length, index of the first step) of the longest stretch of steps with every group zero-variance."""
    best, best_start, run = 0, 0, 0
    for i, frac in enumerate(zero_var):
        run = run + 1 if frac >= 1.0 else 0
        if run > best:
            best, best_start = run, i - run + 1
    return best, best_start


def run_verdict(
    steps: Sequence[int],
    zero_var: Sequence[float],
    errors: Sequence[float],
    reward_mean: Sequence[float],
    *,
    completions_per_step: int,
    no_signal_steps: int,
    max_reward_error_frac: float,
    cold_start: dict[str, Any] | None = None,
) -> Verdict | None:
    """`reward_failed` when the reward raised on more than `max_reward_error_frac` of all completions,
    else `no_signal` when `no_signal_steps` consecutive steps (all of them, in a shorter run) had every
    prompt group zero-variance (`0` turns that check off); None when neither holds.

    Per-step inputs are aligned with `steps`: `reward/zero_var_group_frac`, `reward/errors` (count)
    and `reward/mean`. `cold_start` is the run's cold-start info (its `in_band` and `accuracy`), used
    only to name the likely cause.
    """
    if not steps:
        return None
    total = completions_per_step * len(steps)
    failed = sum(errors)
    if failed > max_reward_error_frac * total:
        return Verdict(
            REWARD_FAILED,
            (
                f"the reward function raised on {failed:.0f} of {total} completions ({failed / total:.0%}, more than "
                f"signal.max_reward_error_frac={max_reward_error_frac}); they scored 0. Likely cause: a bug in the reward "
                "or an example field it expects (its first error is in train.log)"
            ),
        )
    need = min(no_signal_steps, len(steps))
    length, first = longest_no_signal(zero_var)
    if not no_signal_steps or length < need:
        return None
    stretch = slice(first, first + length)
    means = list(reward_mean[stretch])
    low, high = min(means), max(means)
    where = f"steps {steps[first]}-{steps[first + length - 1]}" if length > 1 else f"step {steps[first]}"
    return Verdict(
        NO_SIGNAL,
        (
            f"{where}: every prompt group's completions scored alike (reward/zero_var_group_frac 1.0, reward/mean "
            f"{_span(low, high)}), so every advantage was 0 and nothing was learned. Likely cause: "
            f"{_cause(low, high, cold_start or {})}"
        ),
    )


def history_verdict(history: Mapping[str, Sequence[tuple[int, float]]], **limits: Any) -> Verdict | None:
    """`run_verdict` of a run's (step, value) history of reward/zero_var_group_frac, reward/errors (a step
    without one: 0) and reward/mean; `limits`: run_verdict's keyword arguments."""
    zero_var = dict(history.get(REWARD_ZERO_VAR_GROUP_FRAC, []))
    errors, means = dict(history.get(REWARD_ERRORS, [])), dict(history.get(REWARD_MEAN, []))
    steps = sorted(zero_var)
    return run_verdict(
        steps, [zero_var[s] for s in steps], [errors.get(s, 0.0) for s in steps], [means[s] for s in steps], **limits
    )


def no_signal_warning(step: int, reward_mean: float) -> str:
    """The warning of the first step whose every prompt group has zero reward variance."""
    return (
        f"step {step}: every prompt group has zero reward variance (reward/mean {reward_mean:.3f}), so no "
        "learning signal; check the reward and the starting policy (cold_start=sft warms a checkpoint up on the "
        "task's answers)"
    )


def _span(low: float, high: float) -> str:
    return f"{low:.3f}" if low == high else f"{low:.3f} to {high:.3f}"


def _cause(low: float, high: float, cold_start: dict[str, Any]) -> str:
    causes = []
    if cold_start.get("in_band") is False:
        causes.append(
            f"the cold start ended outside its band (held-out accuracy {cold_start.get('accuracy', 0):.3f} "
            f"vs band {cold_start.get('band')}; see cold_start.max_steps, task.n_train)"
        )
    if low == high == 1.0:
        causes.append(
            "every completion already earns the full reward (training prompts memorised or the task "
            "solved; compare task/accuracy on the held-out split)"
        )
    elif low == high:
        causes.append(f"the reward is always {low:g} (a constant reward, or a policy that never succeeds)")
    if not causes:
        causes.append(
            "rewards vary across prompts but never within a group; raise rollout.temperature or rollout.group_size"
        )
    return "; ".join(causes)
