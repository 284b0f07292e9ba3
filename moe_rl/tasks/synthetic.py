"""The synthetic tasks: digit reversal, digit sorting, running sum, addition, countdown (docs/design.md §4).

Every prompt is `<prefix letter><instance><separator>` over the tokenizer alphabet, so tasks are
told apart by their first character; the answer is the demonstration completion without eos.
Rewards are exact: 1.0 for a correct completion, `partial_credit` for a well-formed wrong one,
0.0 for anything malformed. Rewards never raise.
"""

from __future__ import annotations

import random
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from moe_rl.tasks.expr import parse_expression


def _is_digits(text: str) -> bool:
    """Non-empty and ASCII digits only (`str.isdigit` also accepts '²' and other scripts)."""
    return bool(text) and text.isascii() and text.isdigit()


def _clean(completion: Any) -> str | None:
    return completion.strip() if isinstance(completion, str) else None


@dataclass(frozen=True)
class Task(ABC):
    """A synthetic task: samples examples from a `random.Random` and scores completions exactly."""

    name: str
    prefix: str

    @abstractmethod
    def make_example(self, rng: random.Random, **kwargs: Any) -> dict[str, Any]:
        """One example: {"prompt", "answer", task fields}; all randomness comes from `rng`."""

    @abstractmethod
    def reward(self, completion: str, example: dict[str, Any], *, partial_credit: float = 0.0) -> float:
        """1.0 if correct, `partial_credit` if well-formed but wrong, else 0.0."""

    def longest_answer(self, **kwargs: Any) -> int | None:
        """Characters in the longest answer `make_example(rng, **kwargs)` can draw; None where not bounded here."""
        return None


def _check_range(lo: int, hi: int, floor: int, what: str) -> None:
    if not floor <= lo <= hi:
        raise ValueError(f"need {floor} <= min_{what} <= max_{what}, got ({lo}, {hi})")


@dataclass(frozen=True)
class _DigitStringTask(Task):
    """Map a random digit string to another digit string of the same length."""

    @abstractmethod
    def solve(self, digits: str) -> str:
        """The exact answer for `digits`."""

    def longest_answer(self, *, min_len: int = 3, max_len: int = 6) -> int:
        """As long as the longest digit string."""
        return max_len

    def make_example(self, rng: random.Random, *, min_len: int = 3, max_len: int = 6) -> dict[str, Any]:
        """Digits of length uniform in [min_len, max_len], e.g. {"prompt": "R3071=", "answer": "1703"}."""
        _check_range(min_len, max_len, 1, "len")
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))
        return {"prompt": f"{self.prefix}{digits}=", "answer": self.solve(digits), "digits": digits}

    def reward(self, completion: str, example: dict[str, Any], *, partial_credit: float = 0.0) -> float:
        """Exact string match; well-formed = ASCII digits of the answer's length."""
        text = _clean(completion)
        if text is None:
            return 0.0
        if text == example["answer"]:
            return 1.0
        return partial_credit if _is_digits(text) and len(text) == len(example["answer"]) else 0.0


@dataclass(frozen=True)
class ReversalTask(_DigitStringTask):
    """Reverse a digit string: "R3071=" -> "1703"."""

    name: str = "reversal"
    prefix: str = "R"

    def solve(self, digits: str) -> str:
        return digits[::-1]


@dataclass(frozen=True)
class SortingTask(_DigitStringTask):
    """Sort the digits ascending: "S3071=" -> "0137"."""

    name: str = "sorting"
    prefix: str = "S"

    def solve(self, digits: str) -> str:
        return "".join(sorted(digits))


@dataclass(frozen=True)
class RunningSumTask(_DigitStringTask):
    """The running sum mod 10 of a digit string: "P3071=" -> "3301" (3, 3+0, 3+0+7, 3+0+7+1, mod 10).

    A task whose response length is the controlled variable (`min_len = max_len = L`): output digit t
    is `(y_{t-1} + x_t) mod 10`, so every position, at any length, needs the same two steps (find input
    t, add it to the previous output digit) and depends on every earlier input; an error anywhere
    carries into every later digit. A copy (reversal) needs only the first step, which a small model
    learns near-perfectly per token, so its sequence accuracy saturates at length. Carry-dependent
    addition was the other candidate; its carry makes a digit depend on the later (less significant)
    digits when the sum is written most significant first, a difficulty that differs by position.
    """

    name: str = "running_sum"
    prefix: str = "P"

    def solve(self, digits: str) -> str:
        total, out = 0, []
        for d in digits:
            total = (total + int(d)) % 10
            out.append(str(total))
        return "".join(out)


@dataclass(frozen=True)
class AdditionTask(Task):
    """Add two non-negative integers: "A57+968=" -> "1025"."""

    name: str = "addition"
    prefix: str = "A"

    def make_example(self, rng: random.Random, *, min_digits: int = 1, max_digits: int = 3) -> dict[str, Any]:
        """Each operand has a digit count uniform in [min_digits, max_digits], no leading zeros."""
        _check_range(min_digits, max_digits, 1, "digits")

        def operand() -> int:
            n = rng.randint(min_digits, max_digits)
            return rng.randint(0 if n == 1 else 10 ** (n - 1), 10**n - 1)

        a, b = operand(), operand()
        return {"prompt": f"{self.prefix}{a}+{b}=", "answer": str(a + b), "a": a, "b": b}

    def reward(self, completion: str, example: dict[str, Any], *, partial_credit: float = 0.0) -> float:
        """Exact match with the canonical sum (no leading zeros); well-formed = ASCII digits, at
        most one more digit than the longer operand."""
        text = _clean(completion)
        if text is None:
            return 0.0
        if text == example["answer"]:
            return 1.0
        max_len = max(len(str(example["a"])), len(str(example["b"]))) + 1
        return partial_credit if _is_digits(text) and len(text) <= max_len else 0.0


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3


@dataclass(frozen=True)
class CountdownTask(Task):
    """TinyZero-style countdown: combine every given number once with + - * / to hit the target.

    "C3,5,7>22:" -> "3*5+7". The target comes from a random expression tree over all numbers
    (division only where exact, every intermediate an integer), resampled until the target is
    positive; the answer is that expression with minimal parentheses.
    """

    name: str = "countdown"
    prefix: str = "C"

    def make_example(
        self, rng: random.Random, *, n_numbers: int = 3, min_number: int = 1, max_number: int = 9
    ) -> dict[str, Any]:
        """`n_numbers` integers uniform in [min_number, max_number] and a positive integer target."""
        if n_numbers < 2:
            raise ValueError(f"n_numbers must be >= 2, got {n_numbers}")
        _check_range(min_number, max_number, 0, "number")
        numbers = [rng.randint(min_number, max_number) for _ in range(n_numbers)]
        for _ in range(100):
            order = rng.sample(numbers, len(numbers))
            answer, target, _ = _random_expression(rng, order)
            if target > 0:
                break
        else:  # practically unreachable unless all numbers are 0
            answer, target = "+".join(map(str, numbers)), sum(numbers)
        prompt = f"{self.prefix}{','.join(map(str, numbers))}>{target}:"
        return {"prompt": prompt, "answer": answer, "numbers": numbers, "target": target}

    def reward(self, completion: str, example: dict[str, Any], *, partial_credit: float = 0.0) -> float:
        """1.0 iff the completion uses each given number exactly once (as a multiset) and evaluates
        exactly to the target; well-formed = any expression that parses and evaluates."""
        text = _clean(completion)
        parsed = parse_expression(text) if text is not None else None
        if parsed is None:
            return 0.0
        value, literals = parsed
        uses_each_once = sorted(literals) == sorted(str(n) for n in example["numbers"])
        return 1.0 if uses_each_once and value == example["target"] else partial_credit


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[str, int, int]:
    """A random binary expression tree over `numbers` in order: (text, integer value, precedence)."""
    if len(numbers) == 1:
        return str(numbers[0]), numbers[0], _ATOM
    split = rng.randint(1, len(numbers) - 1)
    left_text, left, left_prec = _random_expression(rng, numbers[:split])
    right_text, right, right_prec = _random_expression(rng, numbers[split:])
    op = rng.choice("+-*/")
    if op == "/" and (right == 0 or left % right != 0):
        op = rng.choice("+-*")  # division only where exact
    if op == "+":
        value = left + right
    elif op == "-":
        value = left - right
    elif op == "*":
        value = left * right
    else:
        value = left // right
    prec = _PRECEDENCE[op]
    # Parenthesise only where needed: a lower-precedence child, or an equal-precedence right
    # child of a non-associative op (a-(b+c), a/(b*c)). a*(b/c) == a*b/c exactly, so no parens.
    if left_prec < prec:
        left_text = f"({left_text})"
    if right_prec < prec or (right_prec == prec and op in "-/"):
        right_text = f"({right_text})"
    return f"{left_text}{op}{right_text}", value, prec


@dataclass(frozen=True)
class MixtureTask(_DigitStringTask):
    """Reversal, sorting and running sum drawn with equal chance, each under its own prefix: the same digit strings
    map three ways, so a token's answer depends on its task ("R3071=" -> "1703", "S3071=" -> "0137", "P3071=" ->
    "3301"). A task whose experts have something to specialise on (the routing-dominance ladder's specialisation
    rung): a warm-up on it trains experts that serve different tasks, as pretraining on mixed data does."""

    name: str = "mixture"
    prefix: str = "RSP"  # each example takes one of these, its task's
    parts: tuple[_DigitStringTask, ...] = (ReversalTask(), SortingTask(), RunningSumTask())

    def solve(self, digits: str) -> str:
        raise NotImplementedError("a mixture's answer depends on the example's task: see make_example")

    def make_example(self, rng: random.Random, *, min_len: int = 3, max_len: int = 6) -> dict[str, Any]:
        """One part's example (chosen first, uniformly), with its task's name under "task"."""
        part = self.parts[rng.randrange(len(self.parts))]
        return {**part.make_example(rng, min_len=min_len, max_len=max_len), "task": part.name}


TASKS: dict[str, Task] = {
    task.name: task
    for task in (ReversalTask(), SortingTask(), RunningSumTask(), AdditionTask(), CountdownTask(), MixtureTask())
}


def get_task(name: str) -> Task:
    """Look a task up by name; unknown names raise a ValueError listing the valid ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {sorted(TASKS)}")
    return TASKS[name]


def sized_new_tokens(name: str, kwargs: dict[str, Any], max_new_tokens: int | None) -> int | None:
    """`task.max_new_tokens`, where null (None) means the longest answer synthetic task `name` can draw with
    `kwargs`, and eos (left None for a task without that bound: `check_new_tokens` refuses it)."""
    longest = TASKS[name].longest_answer(**kwargs) if max_new_tokens is None and name in TASKS else None
    return max_new_tokens if longest is None else longest + 1


def check_new_tokens(name: str, kwargs: dict[str, Any], max_new_tokens: int | None) -> None:
    """Refuse `task.max_new_tokens` below 1 or null for a task without a known longest answer; warn where it is too
    short for the longest answers (a cap is a legitimate setting, as TRL's max_completion_length: the benchmarks cap
    at 2 tokens; but a run at the default cap on long answers would score 0 on every one of them)."""
    if max_new_tokens is None:
        raise ValueError(
            f"task.max_new_tokens=null sizes completions to a synthetic task's answers; set it for task={name}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"task.max_new_tokens={max_new_tokens} must be >= 1")
    longest = TASKS[name].longest_answer(**kwargs) if name in TASKS else None
    if longest is not None and max_new_tokens < longest:
        warnings.warn(
            f"task.max_new_tokens={max_new_tokens} cannot hold task={name}'s answers of up to {longest} characters "
            f"(task.kwargs={dict(kwargs)}): longer answers are cut and score 0; set task.max_new_tokens=null (the "
            f"longest answer and eos) or >= {longest}",
            stacklevel=2,
        )


def explicit_task_kwargs(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` without the entries equal to the synthetic task's `make_example` defaults.

    The task config files spell the defaults out (so `task.kwargs.max_len=8` needs no `+`); caches
    and run identities depend only on what differs from them.
    """
    import inspect

    if name not in TASKS:
        return dict(kwargs)
    params = inspect.signature(TASKS[name].make_example).parameters
    return {k: v for k, v in kwargs.items() if k not in params or params[k].default != v}
