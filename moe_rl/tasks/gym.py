"""reasoning-gym tasks (`task=gym task.gym.name=...`): procedural tasks drawn by the library's own generator
and scored by its own scorer, so a result does not rest on this package's tasks alone.

reasoning-gym (Apache-2.0, pure Python) is an optional extra: `pip install 'moe_rl[gym]'`. The prompt is the
task's question as the library writes it; the answer its reference answer; the reward
`dataset.score_answer(completion, entry)` (1.0 for an exact answer; some tasks give partial credit of their
own). A built model gets a character tokenizer over the data's own characters, as a dataset task does.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GYM_TASK = "gym"  # task.name of a reasoning-gym task (this module's task kind)
EXTRA = "pip install 'moe_rl[gym]'"
EXAMPLES = ("basic_arithmetic", "chain_sum", "number_sorting", "spell_backward")  # named in the unknown-task error


@dataclass
class GymConfig:
    """`task.gym`: which reasoning-gym task `task=gym` draws, and its own config."""

    name: str | None = None  # a reasoning-gym task (reasoning_gym.factory.DATASETS), e.g. number_sorting
    kwargs: dict[str, Any] = field(default_factory=dict)  # its own config's keys (docs: moe_rl/config_docs.py)

    def check(self, task: str) -> None:
        """With task=gym, the name is a task of the installed reasoning-gym (`check_gym_task`)."""
        if task == GYM_TASK:
            check_gym_task(self.name)


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError(f"task=gym needs reasoning-gym: {EXTRA}") from err
    return reasoning_gym


def check_gym_task(name: str | None) -> None:
    """Refuse no name or a name reasoning-gym does not register (ValueError), or a missing extra (ImportError)."""
    if not name:
        raise ValueError("task=gym needs task.gym.name (a reasoning-gym task, e.g. number_sorting)")
    registered = _reasoning_gym().factory.DATASETS
    if name not in registered:
        raise ValueError(
            f"task.gym.name={name!r} is not a reasoning-gym task; e.g. {', '.join(EXAMPLES)} "
            f"({len(registered)} in all: reasoning_gym.factory.DATASETS)"
        )


def _seed(name: str, split: str, seed: int) -> int:
    """A seed of each split's own, so the held-out split does not depend on `n_train` (as `load_task`)."""
    return int(hashlib.sha256(f"gym/{name}/{split}/{seed}".encode()).hexdigest()[:8], 16)


def _draw(name: str, size: int, seed: int, kwargs: dict[str, Any]) -> Any:
    try:
        return _reasoning_gym().create_dataset(name, size=size, seed=seed, **kwargs)
    except (TypeError, ValueError, AssertionError) as err:
        raise ValueError(f"task.gym.kwargs={kwargs} for {name!r}: {type(err).__name__}: {err}") from err


def load_gym_task(
    name: str, *, n_train: int, n_eval: int, seed: int, kwargs: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Callable[[str, dict[str, Any]], float]]:
    """(train, held-out, reward) of reasoning-gym task `name`. Examples are {"question", "prompt", "answer",
    "entry"} (`entry`: the library's own, which its scorer reads); held-out prompts never occur in train (nor
    twice in it), and each split is drawn from a seed of its own."""
    check_gym_task(name)
    held_out = _draw(name, n_eval, _seed(name, "eval", seed), kwargs)
    evals = [_example(entry) for entry in held_out]
    exclude = {e["prompt"] for e in evals}
    pool = _draw(name, n_train + n_eval, _seed(name, "train", seed), kwargs)
    train: list[dict[str, Any]] = []
    for entry in pool:
        example = _example(entry)
        if example["prompt"] not in exclude and len(train) < n_train:
            exclude.add(example["prompt"])
            train.append(example)
    if len(train) < n_train:
        raise ValueError(
            f"task.gym.name={name!r} with {kwargs} gave only {len(train)} of {n_train} train prompts distinct from "
            f"each other and the held-out ones in {n_train + n_eval} draws; lower task.n_train/n_eval or widen "
            "task.gym.kwargs"
        )

    def score(completion: str, example: dict[str, Any]) -> float:
        return float(held_out.score_answer(completion.strip(), example["entry"]))

    return train, evals, score


def _example(entry: dict[str, Any]) -> dict[str, Any]:
    question = entry["question"]
    return {"question": question, "prompt": question, "answer": str(entry["answer"]), "entry": entry}


def gym_data_hash() -> str:
    """What the drawn data depends on beyond the config: the library's version (cold-start caches key on it)."""
    return f"reasoning-gym=={importlib.metadata.version('reasoning-gym')}"
