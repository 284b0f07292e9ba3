"""Dataset tasks: the user's own prompts and answers from a file (or a hub dataset) with a verifiable reward.

A new task kind is data plus a reward function, not a subclass per dataset: `task=dataset
task.path=problems.jsonl task.reward=numeric` reads the file, holds out a deterministic eval split,
renders prompts with the tokenizer's chat template when it has one, and scores completions with
the named reward or the user's `package.module:function` (`moe_rl.tasks.rewards`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from pathlib import Path
from typing import Any

from moe_rl.tasks.rewards import TaskInputError

log = logging.getLogger(__name__)

DATASET_TASK = "dataset"  # task.name of the user's own data (this module's task kind)
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
CHAT_TEMPLATE_MODES = ("auto", "true", "false")


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
            raise TaskInputError(f"task.path={path!r}: unknown file type {suffix!r}; valid: {sorted(FORMATS)}")
        if not file.is_file():
            raise TaskInputError(f"task.path={path!r}: no such file")
        raw = file.read_bytes()
        if not raw.strip():
            raise TaskInputError(f"task.path={path!r} is empty")
        if suffix == ".jsonl":
            check_jsonl(raw, path)
        digest = hashlib.sha256(raw).hexdigest()
        try:
            data = datasets.load_dataset(FORMATS[suffix], data_files=str(file), split="train")
        except Exception as err:
            raise TaskInputError(
                f"task.path={path!r}: cannot read it as {suffix[1:]}: {type(err).__name__}: {err}"
            ) from err
        return data.to_list(), digest
    if os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE"):
        raise TaskInputError(
            f"task.path={path!r} is no local file and HF_HUB_OFFLINE is set, so the hub dataset {path!r} "
            "cannot be downloaded; give a local file or unset HF_HUB_OFFLINE"
        )
    try:
        data = datasets.load_dataset(path, split=split)
    except Exception as err:
        raise TaskInputError(
            f"task.path={path!r}: no local file, and loading split {split!r} of the hub dataset "
            f"failed: {type(err).__name__}: {err}"
        ) from err
    return data.to_list(), f"hub:{path}:{split}:{data._fingerprint}"


def check_jsonl(raw: bytes, path: str) -> None:
    """Raise one line naming the file, the line number and the JSON error of the first bad line of a
    jsonl file (blank lines are allowed), or saying that the file holds no row."""
    rows = 0
    for number, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise TaskInputError(
                f"task.path={path!r} line {number}: invalid JSON: {err.msg} (column {err.colno})"
            ) from None
        if not isinstance(row, dict):
            raise TaskInputError(
                f"task.path={path!r} line {number}: a row must be a JSON object, got {type(row).__name__}"
            )
        rows += 1
    if not rows:
        raise TaskInputError(f"task.path={path!r} is empty")


def data_hash(path: str, split: str = "train") -> str:
    """The content hash `read_rows` gives, cheaply for local files (no parsing)."""
    if _is_local(path) and Path(path).is_file():
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return read_rows(path, split=split)[1]


def split_examples(
    rows: list[dict[str, Any]],
    *,
    path: str,
    prompt_field: str,
    answer_field: str,
    n_train: int | None,
    n_eval: int,
    seed: int,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) examples with `question` (the raw prompt) and `answer` plus every original field.

    Eval rows are the first `n_eval` of a permutation seeded by `seed`, train the next `n_train`
    (None: all the rest): eval never depends on `n_train`, and never overlaps train.
    """
    if not rows:
        raise TaskInputError(f"task.path={path!r} has no rows")
    columns = sorted(rows[0])
    for key, name in (("task.prompt_field", prompt_field), ("task.answer_field", answer_field)):
        if name not in rows[0]:
            raise TaskInputError(f"{key}={name!r} is not a field of {path!r}; its fields: {columns}")
    wanted = len(rows) - n_eval if n_train is None else n_train
    if wanted < 1 or len(rows) < wanted + n_eval:
        raise TaskInputError(
            f"task.path={path!r} has {len(rows)} rows; holding out task.n_eval={n_eval} leaves "
            f"{len(rows) - n_eval} to train on, and task.n_train={n_train} needs {max(wanted, 1)}; lower them or add data"
        )
    n_train = wanted
    order = list(range(len(rows)))
    random.Random(f"dataset/{seed}").shuffle(order)
    examples = []
    for i in order[: n_eval + n_train]:
        row = rows[i]
        prompt, answer = row.get(prompt_field), row.get(answer_field)
        if not isinstance(prompt, str) or answer is None:
            raise TaskInputError(
                f"{path!r} row {i}: {prompt_field!r} must be text and {answer_field!r} present, got "
                f"{type(prompt).__name__} and {type(answer).__name__}"
            )
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


def render_examples(
    examples: list[dict[str, Any]], tokenizer: Any, *, system_prompt: str | None, chat_template: str
) -> list[dict[str, Any]]:
    return [
        {
            **e,
            "prompt": render_prompt(e["question"], tokenizer, system_prompt=system_prompt, chat_template=chat_template),
        }
        for e in examples
    ]
