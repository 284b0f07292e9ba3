"""Seeded train/eval datasets of task examples, and batch scoring (docs/design.md §4)."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import Any

from datasets import Dataset, DatasetDict, Features

from moe_rl.tasks.synthetic import Task, get_task


def _unique_examples(
    task: Task, rng: random.Random, n: int, exclude: set[str], task_kwargs: dict[str, Any]
) -> list[dict[str, Any]]:
    """`n` examples with distinct prompts, none in `exclude`; errors if the space is too small."""
    rows: list[dict[str, Any]] = []
    seen = set(exclude)
    max_draws = 50 * n + 1000
    for _ in range(max_draws):
        if len(rows) == n:
            break
        example = task.make_example(rng, **task_kwargs)
        if example["prompt"] not in seen:
            seen.add(example["prompt"])
            rows.append(example)
    if len(rows) < n:
        raise ValueError(
            f"task {task.name!r} with {task_kwargs} gave only {len(rows)} of {n} unique prompts in "
            f"{max_draws} draws; lower n_train/n_eval or widen the task kwargs"
        )
    return rows


def load_task(name: str, *, n_train: int, n_eval: int, seed: int, **task_kwargs: Any) -> DatasetDict:
    """Train and eval splits of `name`, deterministic in `seed`; eval prompts never occur in train.

    Each split is drawn from its own `random.Random` derived from (name, split, seed), so the eval
    split does not depend on `n_train` and a smaller `n_train` gives a prefix of a larger one.
    Prompts are unique within and across splits. Columns: prompt, answer and the task's fields.
    """
    if n_train < 0 or n_eval < 0:
        raise ValueError(f"n_train and n_eval must be >= 0, got {n_train}, {n_eval}")
    task = get_task(name)
    # Schema from a throwaway example: fixes column types even for empty splits and
    # validates task_kwargs before any real draw.
    features: Features = Dataset.from_list([task.make_example(random.Random(0), **task_kwargs)]).features
    eval_rows = _unique_examples(task, random.Random(f"{name}/eval/{seed}"), n_eval, set(), task_kwargs)
    held_out = {row["prompt"] for row in eval_rows}
    train_rows = _unique_examples(task, random.Random(f"{name}/train/{seed}"), n_train, held_out, task_kwargs)
    return DatasetDict(train=_to_dataset(train_rows, features), eval=_to_dataset(eval_rows, features))


def _to_dataset(rows: list[dict[str, Any]], features: Features) -> Dataset:
    """Column-wise build (`from_list` cannot build an empty split with a schema)."""
    return Dataset.from_dict({key: [row[key] for row in rows] for key in features}, features=features)


def score_completions(
    task: Task,
    completions: list[str],
    examples: Iterable[Mapping[str, Any]],
    *,
    partial_credit: float = 0.0,
) -> list[float]:
    """`task.reward` for each (completion, example) pair; the two must have equal length."""
    examples = list(examples)
    if len(completions) != len(examples):
        raise ValueError(f"{len(completions)} completions for {len(examples)} examples")
    return [task.reward(c, dict(ex), partial_credit=partial_credit) for c, ex in zip(completions, examples)]
