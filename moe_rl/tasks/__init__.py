"""Synthetic RL tasks with exact rewards, seeded datasets and a character-level tokenizer (docs/design.md §4)."""

from moe_rl.tasks.expr import parse_expression
from moe_rl.tasks.splits import load_task, score_completions
from moe_rl.tasks.synthetic import (
    TASKS,
    AdditionTask,
    CountdownTask,
    ReversalTask,
    SortingTask,
    Task,
    explicit_task_kwargs,
    get_task,
)
from moe_rl.tasks.tokenizer import ALPHABET, BOS_ID, EOS_ID, PAD_ID, UNK_ID, VOCAB, make_tokenizer

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
    "ReversalTask",
    "SortingTask",
    "Task",
    "explicit_task_kwargs",
    "get_task",
    "load_task",
    "make_tokenizer",
    "parse_expression",
    "score_completions",
]
