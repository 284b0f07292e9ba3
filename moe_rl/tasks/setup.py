"""One task interface for the loop: examples plus a reward, whether synthetic or the user's own data.

A task kind is data plus a reward function. `setup_task(task_cfg, seed)` reads or draws the train and
held-out examples and picks the reward; the loop, the cold start and evaluation then see only an
`RLTask`: its examples, `render` (the prompts as the policy sees them) and `score` (rewards, and how
many calls of the reward function raised).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol

from moe_rl.tasks.dataset import DATASET_TASK, read_rows, render_examples, split_examples
from moe_rl.tasks.gym import GYM_TASK, GymConfig, gym_data_hash, load_gym_task
from moe_rl.tasks.rewards import RewardFn, Scorer, resolve_reward
from moe_rl.tasks.splits import load_task
from moe_rl.tasks.synthetic import get_task


class TaskSpec(Protocol):
    """The task keys `setup_task` reads (`moe_rl.config.TaskConfig` has them, the `task.*` config group)."""

    name: str
    n_train: int | None
    n_eval: int
    partial_credit: float
    kwargs: dict[str, Any]
    path: str | None
    prompt_field: str
    answer_field: str
    system_prompt: str | None
    split: str
    chat_template: str
    reward: str
    gym: GymConfig


class Scores(NamedTuple):
    """Rewards of a batch of completions, and how many of them the reward function failed on (scored 0)."""

    rewards: list[float]
    errors: int


@dataclass(frozen=True)
class RLTask:
    """A task as every consumer sees it: train and held-out examples, a reward, prompt rendering.

    Examples are dicts with `prompt` and `answer` (and the task's or the file's other fields).
    `chat` is None for synthetic tasks (prompts are used as they are) and, for a dataset task,
    `(system_prompt, chat_template mode)` applied by `render`.
    """

    name: str
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    reward_fn: RewardFn
    reward_name: str
    data_hash: str | None = None
    chat: tuple[str | None, str] | None = None

    @functools.cached_property
    def scorer(self) -> Scorer:
        return Scorer(self.reward_fn, self.reward_name)

    def texts(self) -> list[str]:
        """Every prompt and answer (and the system prompt): what a character tokenizer must cover."""
        system = [self.chat[0] or ""] if self.chat else []
        return [t for e in self.train + self.eval for t in (e["prompt"], e["answer"])] + system

    def render(self, tokenizer: Any) -> RLTask:
        """The same task with prompts as the policy sees them (chat template, system prompt)."""
        if self.chat is None:
            return self
        system_prompt, mode = self.chat

        def rendered(examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return render_examples(examples, tokenizer, system_prompt=system_prompt, chat_template=mode)

        return replace(self, train=rendered(self.train), eval=rendered(self.eval))

    def score(self, completions: list[str], examples: list[dict[str, Any]]) -> Scores:
        """Reward of each (completion, example) pair; a call that raises scores 0 and is counted."""
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions for {len(examples)} examples")
        before = self.scorer.errors
        rewards = [self.scorer(c, e) for c, e in zip(completions, examples)]
        return Scores(rewards, self.scorer.errors - before)


def setup_task(task_cfg: TaskSpec, seed: int) -> RLTask:
    """The task `task_cfg` names: a synthetic task drawn with `seed`, the rows of `task.path` split into
    train and held-out examples by `seed` with the configured reward, or a reasoning-gym task drawn with
    `seed` and scored by its own scorer."""
    if task_cfg.name == DATASET_TASK:
        path = str(task_cfg.path)
        rows, digest = read_rows(path, split=task_cfg.split)
        train, evals = split_examples(
            rows,
            path=path,
            prompt_field=task_cfg.prompt_field,
            answer_field=task_cfg.answer_field,
            n_train=task_cfg.n_train,
            n_eval=task_cfg.n_eval,
            seed=seed,
        )
        return RLTask(
            DATASET_TASK,
            train,
            evals,
            resolve_reward(task_cfg.reward),
            task_cfg.reward,
            digest,
            chat=(task_cfg.system_prompt, str(task_cfg.chat_template)),
        )
    if task_cfg.name == GYM_TASK:
        assert task_cfg.gym.name and task_cfg.n_train is not None, "checked by moe_rl.config.validate"
        train, evals, score = load_gym_task(
            task_cfg.gym.name,
            n_train=task_cfg.n_train,
            n_eval=task_cfg.n_eval,
            seed=seed,
            kwargs=dict(task_cfg.gym.kwargs),
        )
        chat = (task_cfg.system_prompt, str(task_cfg.chat_template))
        return RLTask(GYM_TASK, train, evals, score, f"gym:{task_cfg.gym.name}", gym_data_hash(), chat=chat)
    task = get_task(task_cfg.name)
    assert task_cfg.n_train is not None, "task.n_train=null is for task=dataset (moe_rl.config.validate)"
    data = load_task(task_cfg.name, n_train=task_cfg.n_train, n_eval=task_cfg.n_eval, seed=seed, **task_cfg.kwargs)
    reward = functools.partial(task.reward, partial_credit=task_cfg.partial_credit)
    return RLTask(task.name, data["train"].to_list(), data["eval"].to_list(), reward, task.name)
