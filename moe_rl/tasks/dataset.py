"""Dataset tasks: the user's own prompts and answers from a file (or a hub dataset) with a verifiable reward.

A new task kind is data plus a reward function, not a subclass per dataset: `task=dataset
task.path=problems.jsonl task.reward=numeric` reads the file, holds out a deterministic eval split,
renders prompts with the tokenizer's chat template when it has one, and scores completions with
the named reward or the user's `package.module:function` (`moe_rl.tasks.rewards`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_rl.tasks.rewards import Scorer, resolve_reward

log = logging.getLogger(__name__)

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
CHAT_TEMPLATE_MODES = ("auto", "true", "false")


@dataclass
class DatasetTask:
    """A dataset task's reward: `reward(completion, example)` as the synthetic tasks have it.

    `partial_credit` is accepted for the shared call signature and unused: the reward function
    decides what a partly right answer is worth.
    """

    reward_spec: str = "exact"
    name: str = "dataset"
    scorer: Scorer = field(init=False)

    def __post_init__(self) -> None:
        self.scorer = Scorer(resolve_reward(self.reward_spec), self.reward_spec)

    def reward(self, completion: str, example: dict[str, Any], *, partial_credit: float = 0.0) -> float:
        return self.scorer(completion, example)

    @property
    def errors(self) -> int:
        return self.scorer.errors


def _is_local(path: str) -> bool:
    """A path on disk (or meant as one) rather than a hub dataset name like `openai/gsm8k`."""
    return Path(path).exists() or Path(path).suffix.lower() in FORMATS or path.startswith((".", "/", "~"))


def read_rows(path: str, *, split: str = "train") -> tuple[list[dict[str, Any]], str]:
    """(rows, content hash) of a local jsonl/json/parquet/csv file, or of `split` of a hub dataset.

    The hash covers the file's bytes (or the hub dataset's fingerprint), so caches keyed on it
    change whenever the data does.
    """
    import datasets

    datasets.disable_progress_bars()
    if _is_local(path):
        file = Path(path)
        suffix = file.suffix.lower()
        if suffix not in FORMATS:
            raise ValueError(f"task.path={path!r}: unknown file type {suffix!r}; valid: {sorted(FORMATS)}")
        if not file.is_file():
            raise ValueError(f"task.path={path!r}: no such file")
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        try:
            data = datasets.load_dataset(FORMATS[suffix], data_files=str(file), split="train")
        except Exception as err:
            raise ValueError(
                f"task.path={path!r}: cannot read it as {suffix[1:]}: {type(err).__name__}: {err}"
            ) from err
        return data.to_list(), digest
    if os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE"):
        raise ValueError(
            f"task.path={path!r} is no local file and HF_HUB_OFFLINE is set, so the hub dataset {path!r} "
            "cannot be downloaded; give a local file or unset HF_HUB_OFFLINE"
        )
    try:
        data = datasets.load_dataset(path, split=split)
    except Exception as err:
        raise ValueError(f"task.path={path!r}: no local file, and loading split {split!r} of the hub dataset "
                         f"failed: {type(err).__name__}: {err}") from err
    return data.to_list(), f"hub:{path}:{split}:{data._fingerprint}"


def data_hash(path: str, split: str = "train") -> str:
    """The content hash `read_rows` gives, cheaply for local files (no parsing)."""
    if _is_local(path) and Path(path).is_file():
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return read_rows(path, split=split)[1]


def split_examples(
    rows: list[dict[str, Any]], *, path: str, prompt_field: str, answer_field: str, n_train: int, n_eval: int,
    seed: int,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) examples with `question` (the raw prompt) and `answer` plus every original field.

    Eval rows are the first `n_eval` of a permutation seeded by `seed`, train the next `n_train`:
    eval never depends on `n_train`, and never overlaps train.
    """
    if not rows:
        raise ValueError(f"task.path={path!r} has no rows")
    columns = sorted(rows[0])
    for key, name in (("task.prompt_field", prompt_field), ("task.answer_field", answer_field)):
        if name not in rows[0]:
            raise ValueError(f"{key}={name!r} is not a field of {path!r}; its fields: {columns}")
    if len(rows) < n_train + n_eval:
        raise ValueError(
            f"task.path={path!r} has {len(rows)} rows, fewer than task.n_train + task.n_eval = "
            f"{n_train} + {n_eval}; lower them or add data"
        )
    order = list(range(len(rows)))
    random.Random(f"dataset/{seed}").shuffle(order)
    examples = []
    for i in order[: n_eval + n_train]:
        row = rows[i]
        prompt, answer = row.get(prompt_field), row.get(answer_field)
        if not isinstance(prompt, str) or answer is None:
            raise ValueError(f"{path!r} row {i}: {prompt_field!r} must be text and {answer_field!r} present, got "
                             f"{type(prompt).__name__} and {type(answer).__name__}")
        examples.append({**row, "question": prompt, "prompt": prompt, "answer": str(answer)})
    return examples[n_eval:], examples[:n_eval]


def render_prompt(question: str, tokenizer: Any, *, system_prompt: str | None, chat_template: str) -> str:
    """The text the policy sees: the chat template applied (`auto`: when the tokenizer has one), else
    the system prompt and the question joined by a blank line."""
    mode = str(chat_template).lower()
    if mode not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"task.chat_template={chat_template!r} is not valid; valid: {list(CHAT_TEMPLATE_MODES)}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if mode == "true" and not has_template:
        raise ValueError("task.chat_template=true, but the tokenizer has no chat template")
    if mode == "false" or not has_template:
        return f"{system_prompt}\n\n{question}" if system_prompt else question
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": question}
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render_examples(examples: list[dict[str, Any]], tokenizer: Any, *, system_prompt: str | None,
                    chat_template: str) -> list[dict[str, Any]]:
    return [{**e, "prompt": render_prompt(e["question"], tokenizer, system_prompt=system_prompt,
                                          chat_template=chat_template)} for e in examples]
