"""Verifiable rewards for dataset tasks: by name (`exact`, `numeric`, `math`) or a user function.

A reward is `(completion: str, example: dict) -> float`. `reward=package.module:function` imports
the user's own; it is checked once (importable, callable, takes two arguments) before a run starts.
During a run a reward that raises on one completion scores 0 for it and is counted
(`reward/errors`); one that returns a non-number is a bug in the function and stops the run with
its name.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

RewardFn = Callable[[str, dict], float]


class TaskInputError(ValueError):
    """The user's data file or reward cannot be used; the message says why in one line."""


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str) -> float | None:
    """The last number in `text` (commas as thousands separators), or None."""
    found = _NUMBER.findall(text or "")
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def reference_number(answer: str) -> float | None:
    """The reference value of an answer: GSM8K's `#### 42` convention when present, else its last number."""
    answer = str(answer)
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    return last_number(answer)


def exact_reward(completion: str, example: dict) -> float:
    """1.0 iff the stripped completion equals the stripped answer."""
    return float(completion.strip() == str(example["answer"]).strip())


def numeric_reward(completion: str, example: dict) -> float:
    """1.0 iff the last number of the completion equals the reference number (GSM8K `####` aware)."""
    got, want = last_number(completion), reference_number(example["answer"])
    return float(got is not None and want is not None and math.isclose(got, want, rel_tol=0, abs_tol=1e-9))


def math_reward(completion: str, example: dict) -> float:
    """1.0 iff `math-verify` finds the completion's answer equivalent to the reference (LaTeX or plain)."""
    from math_verify import parse, verify

    answer = str(example["answer"])
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1].strip()
    gold, pred = parse(answer), parse(completion)
    return float(bool(gold) and bool(pred) and verify(gold, pred))


REWARDS: dict[str, RewardFn] = {"exact": exact_reward, "numeric": numeric_reward, "math": math_reward}


def _import_reward_module(spec: str, module_name: str) -> Any:
    """Import the user's reward module from `sys.path`, else from the working directory (which
    `python experiments/train.py` does not put on the path: the script's folder is there instead)."""
    cwd, added = os.getcwd(), False
    while True:
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            missing = err.name is not None and module_name.startswith(err.name)  # the module itself, not its imports
            if missing and cwd not in sys.path:
                sys.path.append(cwd)
                added = True
                continue
            if added:
                sys.path.remove(cwd)
            if missing:
                raise TaskInputError(
                    f"reward={spec!r}: no module named {err.name!r}; the module must be on PYTHONPATH "
                    f"or importable from the working directory ({cwd})"
                ) from err
            raise TaskInputError(f"reward={spec!r}: importing module {module_name!r} failed: {err}") from err
        except Exception as err:
            raise TaskInputError(
                f"reward={spec!r}: importing module {module_name!r} raised {type(err).__name__}: {err}"
            ) from err


def resolve_reward(spec: str) -> RewardFn:
    """A reward by name, or `package.module:function`; errors name what is wrong."""
    if spec in REWARDS:
        if spec == "math":
            try:
                importlib.import_module("math_verify")
            except ImportError as err:
                raise TaskInputError("reward='math' needs the math-verify package: pip install 'moe_rl[math]'") from err
        return REWARDS[spec]
    if ":" not in spec:
        raise TaskInputError(f"unknown reward {spec!r}; valid: {sorted(REWARDS)} or 'package.module:function'")
    module_name, _, attr = spec.partition(":")
    module = _import_reward_module(spec, module_name)
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise TaskInputError(f"reward={spec!r}: module {module_name!r} has no callable {attr!r}")
    try:
        inspect.signature(fn).bind("completion", {})
    except TypeError as err:
        raise TaskInputError(
            f"reward={spec!r}: {attr}{inspect.signature(fn)} cannot be called as (completion: str, example: dict)"
        ) from err
    except ValueError:  # builtins without a signature: trust them
        pass
    return fn


class Scorer:
    """Calls a reward function on (completion, example) pairs, counting the calls that raised."""

    def __init__(self, fn: RewardFn, name: str) -> None:
        self.fn, self.name = fn, name
        self.errors = 0
        self._warned = False

    def __call__(self, completion: str, example: dict) -> float:
        try:
            value = self.fn(completion, example)
        except Exception as err:  # one bad completion must not end the run
            self.errors += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "reward %s raised %s: %s (scored 0; counted in reward/errors)", self.name, type(err).__name__, err
                )
            return 0.0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise TypeError(f"reward {self.name} returned {value!r} ({type(value).__name__}), not a finite number")
        return float(value)


def zero_variance_frac(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of prompt groups whose G rewards are all equal: their advantages are 0, no signal."""
    groups = rewards.view(-1, group_size)
    return (groups == groups[:, :1]).all(dim=1).float().mean().item()


def reward_name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
