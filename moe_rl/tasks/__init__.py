"""Synthetic RL tasks with exact rewards, seeded datasets and a character-level tokenizer (docs/design.md §4).

The task definitions (`synthetic`, `expr`) are torch-free and load with the package; the splits and the
tokenizer (torch, transformers) load on first use of their names, so the analysis can read a run's
task identity (`explicit_task_kwargs`) without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from moe_rl.tasks.expr import parse_expression
from moe_rl.tasks.gym import GymConfig
from moe_rl.tasks.synthetic import (
    TASKS,
    AdditionTask,
    CountdownTask,
    ReversalTask,
    RunningSumTask,
    SortingTask,
    Task,
    check_new_tokens,
    explicit_task_kwargs,
    get_task,
    sized_new_tokens,
)

if TYPE_CHECKING:
    from moe_rl.tasks.splits import load_task, score_completions
    from moe_rl.tasks.tokenizer import ALPHABET, BOS_ID, EOS_ID, PAD_ID, UNK_ID, VOCAB, make_tokenizer

_LAZY = {
    "load_task": "splits",
    "score_completions": "splits",
    **dict.fromkeys(("ALPHABET", "BOS_ID", "EOS_ID", "PAD_ID", "UNK_ID", "VOCAB", "make_tokenizer"), "tokenizer"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"moe_rl.tasks.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ALPHABET",
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "TASKS",
    "UNK_ID",
    "VOCAB",
    "AdditionTask",
    "CountdownTask",
    "GymConfig",
    "ReversalTask",
    "RunningSumTask",
    "SortingTask",
    "Task",
    "check_new_tokens",
    "explicit_task_kwargs",
    "get_task",
    "load_task",
    "make_tokenizer",
    "parse_expression",
    "score_completions",
    "sized_new_tokens",
]
