"""Cold start: supervised warm-up on task demonstrations until eval accuracy enters a band.

RL on a policy that never succeeds has no signal, and on one that always succeeds has nothing to
learn. Every arm and seed of a comparison starts from the same cold-start checkpoint (docs/design.md §4),
cached on disk under a hash of everything that determines it.

Matched starts: two models (say an MoE model and its dense control) can start alike on what RL sees,
not only on greedy accuracy. `cold_start.target` stops the warm-up at the first evaluation where
`cold_start.target_metric` reaches it: `greedy` held-out accuracy, or `sampled`, the mean reward of
temperature-1 samples on the held-out prompts (what GRPO's first rollouts score), whose entropy is
recorded beside it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from moe_rl.algos.optimizers import exact_foreach
from moe_rl.config import ColdStartConfig, ModelConfig, TaskConfig, TrainConfig
from moe_rl.loop.compiled import compiled_forward
from moe_rl.models import build_model, load_model
from moe_rl.rollout.evaluation import greedy_accuracy, sampled_reward_entropy, start_covariates
from moe_rl.run.atomic import write_atomic
from moe_rl.run.progress import eta_seconds, format_duration
from moe_rl.tasks import make_tokenizer
from moe_rl.tasks.dataset import DATASET_TASK, data_hash
from moe_rl.tasks.gym import GYM_TASK, gym_data_hash
from moe_rl.tasks.setup import RLTask, setup_task
from moe_rl.tasks.tokenizer import data_alphabet

log = logging.getLogger(__name__)
SAMPLED_N = 4  # temperature-1 samples per held-out prompt for cold_start.target_metric=sampled
TARGET_KEYS = {"greedy": "accuracy", "sampled": "sampled_reward"}  # each target metric's entry in the history
COVARIATES = "covariates.json"  # beside a cached cold start: what RL starts from (`start_covariates`)
COVARIATE_SAMPLES = 8  # temperature-1 samples per held-out prompt of the covariates (the default group size)


def checkpoint_fingerprint(path: str) -> str:
    """A local checkpoint's files (names, sizes, modification times), or the hub id itself."""
    root = Path(path).expanduser()
    if not root.is_dir():
        return f"hub:{path}"
    stats = sorted(
        (str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns) for f in root.rglob("*") if f.is_file()
    )
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


def load_tokenizer(path: str | Path, info: dict | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a checkpoint or cold start, left-padded for generation.

    A character tokenizer is rebuilt from its alphabet (recorded in the cold start's info), so it
    keeps refusing characters outside it; a checkpoint without tokenizer files gets ours.
    """
    info = info or {}
    if info.get("tokenizer", "char") == "char" and info.get("alphabet") is not None:
        return make_tokenizer(alphabet=info["alphabet"])
    root = Path(path).expanduser()
    if root.is_dir() and not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return make_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(str(root) if root.is_dir() else str(path), local_files_only=root.is_dir())
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# Model keys that do not change the cold-start weights: the experts kernel, and the RL-phase router knobs
# (moe_rl.models.knobs), applied to the cold start's weights, so that every rung of an ablation starts alike.
NOT_COLD_START = ("experts_implementation", "router_frozen", "router_dtype")
# Tasks whose built model gets a character tokenizer over the data's own characters (the others: the fixed alphabet).
DATA_ALPHABET_TASKS = (DATASET_TASK, GYM_TASK)


def cold_start_key(
    model: ModelConfig,
    task: TaskConfig,
    cold: ColdStartConfig,
    data_hash: str | None = None,
    *,
    numerics: str = "native",
    unit: bool = False,
) -> str:
    """Hash of everything that determines the cold-start weights (not the RL seed or arm): model,
    task and cold-start config, the data's content hash, the starting checkpoint's files, the
    tokenizer vocabulary, the library versions and pinned numerics (a pinned run trains its own).
    `unit`: the same without the versions and numerics, the start as a unit of replication, which a member warmed
    on two machines or library versions (twins: other last bits, the same weights' recipe and data order) shares."""
    import transformers

    from moe_rl.config import identity_spec

    spec = identity_spec(
        {
            "model": {k: v for k, v in asdict(model).items() if k not in NOT_COLD_START},
            "task": {k: v for k, v in asdict(task).items() if k not in ("partial_credit",)},
            # the one warm-up `cold` names at its seed (a run's pool member: run_member)
            "cold_start": {k: v for k, v in asdict(cold).items() if k not in ("cache_dir", "pool")},
        }
    )
    spec["vocab"] = make_tokenizer().get_vocab()
    if not unit:
        spec["versions"] = [torch.__version__, transformers.__version__]
    if data_hash is not None:
        spec["data"] = data_hash
    if numerics != "native" and not unit:
        spec["numerics"] = numerics
    if cold_start_patience(cold, task):  # the stopping rule shapes the weights (absent where it never stops)
        spec["cold_start"]["patience"] = cold_start_patience(cold, task)
    if model.checkpoint:
        spec["checkpoint_files"] = checkpoint_fingerprint(model.checkpoint)
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=list).encode()).hexdigest()[:16]


def _sft_batch(tokenizer: PreTrainedTokenizerBase, examples: list[dict]) -> dict[str, torch.Tensor]:
    """Left-padded prompt + answer + EOS rows, supervising answer + EOS only. Prompt and answer are
    tokenized apart, so the supervised span is exact for any tokenizer."""
    prompts = tokenizer([e["prompt"] for e in examples], add_special_tokens=False)["input_ids"]
    answers = [
        a + [tokenizer.eos_token_id]
        for a in tokenizer([e["answer"] for e in examples], add_special_tokens=False)["input_ids"]
    ]
    T = max(len(p) + len(a) for p, a in zip(prompts, answers, strict=True))
    input_ids, attention_mask, labels = [], [], []
    for prompt, answer in zip(prompts, answers, strict=True):
        pad = T - len(prompt) - len(answer)
        input_ids.append([tokenizer.pad_token_id] * pad + prompt + answer)
        attention_mask.append([0] * pad + [1] * (T - pad))
        labels.append([-100] * (T - len(answer)) + answer)
    return {
        "input_ids": torch.tensor(input_ids, dtype=torch.long),
        "attention_mask": torch.tensor(attention_mask, dtype=torch.long),
        "labels": torch.tensor(labels, dtype=torch.long),
    }


def _start(
    model_cfg: ModelConfig, task_cfg: TaskConfig, cold: ColdStartConfig, texts: list[str]
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict]:
    """The model and tokenizer the warm-up starts from: the checkpoint's own, or a built tiny model
    with a character tokenizer (over the data's own characters for a dataset or gym task)."""
    dtype = getattr(torch, model_cfg.dtype)
    if model_cfg.checkpoint:
        model = load_model(model_cfg.checkpoint, experts_implementation=model_cfg.experts_implementation, dtype=dtype)
        return model, load_tokenizer(model_cfg.checkpoint), {"tokenizer": "checkpoint"}
    assert task_cfg.max_new_tokens is not None, "sized by TaskConfig"
    # positions for the longest text, its completion, bos and eos (256, the tiny models' own, unless they need more)
    longest = max(len(t) for t in texts) + task_cfg.max_new_tokens + 2
    overrides: dict = {"max_position_embeddings": max(256, 1 << (longest - 1).bit_length())}
    if task_cfg.name in DATA_ALPHABET_TASKS:
        tokenizer = make_tokenizer(alphabet=data_alphabet(texts))
    else:
        tokenizer = make_tokenizer()
    model = build_model(
        model_cfg.family,
        seed=cold.seed,
        experts_implementation=model_cfg.experts_implementation,
        dtype=dtype,
        vocab_size=len(tokenizer),
        num_layers=model_cfg.num_layers,
        num_experts=model_cfg.num_experts,
        top_k=model_cfg.top_k,
        hidden_size=model_cfg.hidden_size,
        **overrides,
        **({"moe_intermediate_size": model_cfg.moe_intermediate_size} if model_cfg.moe_intermediate_size else {}),
        **({"head_dim": model_cfg.head_dim} if model_cfg.head_dim else {}),
    )
    info = {"tokenizer": "char", "alphabet": tokenizer.alphabet} if task_cfg.name in DATA_ALPHABET_TASKS else {}
    return model, tokenizer, info


def train_cold_start(
    model_cfg: ModelConfig, task_cfg: TaskConfig, cold: ColdStartConfig, *, numerics: str = "native"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict]:
    """Supervised warm-up until greedy held-out accuracy reaches the band's lower edge or stops
    improving (`cold_start_stop`), at most `cold_start.max_steps` steps (none with `cold_start.mode=none`).

    Runs on one CPU thread whatever the caller's setting: float reductions depend on the thread
    count, and the cached weights must not depend on which run of a sweep trained them.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_cold_start(model_cfg, task_cfg, cold, numerics)
    finally:
        torch.set_num_threads(threads)


def _train_cold_start(
    model_cfg: ModelConfig, task_cfg: TaskConfig, cold: ColdStartConfig, numerics: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict]:
    task = setup_task(task_cfg, cold.seed)
    demos = warmup_task(task_cfg, cold, task)
    own = demos is not task  # a pool of the warm-up's own: its texts and positions count too
    model, tokenizer, tok_info = _start(model_cfg, task_cfg, cold, task.texts() + (demos.texts() if own else []))
    task = task.render(tokenizer)
    demos = demos.render(tokenizer) if own else task
    check_positions(model, tokenizer, task, task_cfg)
    if own:
        check_positions(model, tokenizer, demos, task_cfg)
    low, high = cold.band
    if cold.mode == "none":
        model.eval()
        return (
            model,
            tokenizer,
            {
                "steps": 0,
                "accuracy": None,
                "band": [low, high],
                "in_band": None,
                "history": [],
                "mode": "none",
                **tok_info,
            },
        )
    patience = cold_start_patience(cold, task_cfg)
    # `cold_start.compile`: the SFT step's forward and backward compiled, the greedy evaluations eager
    forward = compiled_forward(model, numerics=numerics) if cold.compile else model
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        params, lr=cold.lr, betas=(0.9, cold.beta2), weight_decay=0.0, foreach=exact_foreach(params)
    )
    # `cold_start.warmup_steps`: step k (from 1) at lr * min(1, k / warmup_steps)
    scheduler = (
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / cold.warmup_steps))
        if cold.warmup_steps
        else None
    )
    rng = random.Random(cold.seed)
    history: list[dict] = []
    accuracy, step, start, stop = 0.0, 0, time.perf_counter(), None
    model.train()
    for step in range(1, cold.max_steps + 1):
        sample = rng.sample(demos.train, min(cold.batch_size, len(demos.train)))
        batch = {k: v.to(model.device) for k, v in _sft_batch(tokenizer, sample).items()}
        loss = forward(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        if step % cold.eval_every == 0:
            model.eval()
            accuracy = greedy_accuracy(model, tokenizer, task.eval, task, max_new_tokens=task_cfg.max_new_tokens)
            entry = {"step": step, "loss": loss.item(), "accuracy": accuracy}
            if cold.target_metric == "sampled":
                entry["sampled_reward"], entry["sampled_entropy"] = sampled_reward_entropy(
                    model,
                    tokenizer,
                    task.eval,
                    task,
                    n=SAMPLED_N,
                    max_new_tokens=task_cfg.max_new_tokens,
                    seed=cold.seed,
                )
            model.train()
            history.append(entry)
            elapsed = time.perf_counter() - start
            log.info(
                "cold start step %d/%d loss %.3f held-out accuracy %.3f (band %s) %.2f steps/s ETA at most %s",
                step,
                cold.max_steps,
                loss.item(),
                accuracy,
                list(cold.band),
                step / elapsed,
                format_duration(eta_seconds(step, cold.max_steps, elapsed)),
            )
            if cold.target is not None:
                stop = "target" if entry[TARGET_KEYS[cold.target_metric]] >= cold.target else None
            else:
                stop = cold_start_stop([h["accuracy"] for h in history], low, patience)
            if stop:
                break
    model.eval()
    info = {
        "steps": step,
        "accuracy": accuracy,
        "band": [low, high],
        "in_band": low <= accuracy <= high,
        "stopped": stop or "max_steps",
        "history": history,
        **{k: history[-1][k] for k in ("sampled_reward", "sampled_entropy") if history and k in history[-1]},
        **tok_info,
    }
    if not info["in_band"]:
        log.warning(
            "cold start ended at held-out accuracy %.3f outside the band %s after %d steps (%s): RL may "
            "have no signal; see cold_start.band, cold_start.max_steps, task.n_train",
            accuracy,
            list(cold.band),
            step,
            info["stopped"],
        )
    return model, tokenizer, info


def warmup_task(task_cfg: TaskConfig, cold: ColdStartConfig, task: RLTask) -> RLTask:
    """The task the warm-up supervises on: `task` itself, or with `cold_start.n_train` the task drawn at that train
    size (its train split a pool of the warm-up's own, its held-out split `task`'s: checked)."""
    if cold.n_train is None:
        return task
    own = setup_task(replace(task_cfg, n_train=cold.n_train), cold.seed)
    if [e["prompt"] for e in own.eval] != [e["prompt"] for e in task.eval]:
        raise ValueError(
            f"cold_start.n_train={cold.n_train} draws task {task_cfg.name!r} with another held-out split than "
            f"task.n_train={task_cfg.n_train}; the warm-up's band is read on the run's held-out prompts, so this "
            "task cannot take a warm-up pool of its own (leave cold_start.n_train unset)"
        )
    return own


def pool_member(cold: ColdStartConfig, seed: int) -> int:
    """The member of the cold-start pool a run of RL seed `seed` starts from: `seed` mod `cold_start.pool` (seeds
    0..2K-1 give K starts x 2 seeds). The run keeps its own seed, so no two runs of an arm share a stream."""
    return seed % cold.pool


def member_config(cold: ColdStartConfig, seed: int) -> ColdStartConfig:
    """The cold start of that member: the warm-up at cold-start seed `cold.seed + member` (the pool's size never
    enters its key), so member m of a pool is the cached cold start of `cold_start.seed=cold.seed + m`."""
    return replace(cold, seed=cold.seed + pool_member(cold, seed))


def run_member(cfg: TrainConfig) -> ColdStartConfig:
    """The cold start a run of `cfg` starts from, its member of the pool (`member_config` at the run's seed): the one
    place a run's member is derived (the loop, its run keys, its run folder's check, a study's launcher)."""
    return member_config(cfg.cold_start, cfg.seed)


def _as_is(model_cfg: ModelConfig, cold: ColdStartConfig) -> bool:
    """Whether the run starts from `model.checkpoint` as it is (no warm-up); refused for a pool of starts."""
    if not (model_cfg.checkpoint and cold.mode in ("auto", "none")):
        return False
    if cold.pool > 1:
        raise ValueError(
            f"cold_start.pool={cold.pool} needs a warm-up per member, but model.checkpoint with "
            f"cold_start.mode={cold.mode} starts every run from the checkpoint itself (use cold_start=sft)"
        )
    return True


def check_positions(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: RLTask, task_cfg: TaskConfig
) -> None:
    """Refuse a task whose longest prompt and completion (`task.max_new_tokens`, bos and eos) exceed the model's
    positions: a checkpoint's are its own (a built model's are sized to fit)."""
    assert task_cfg.max_new_tokens is not None, "sized by TaskConfig"
    prompts = tokenizer([e["prompt"] for e in task.train + task.eval], add_special_tokens=False)["input_ids"]
    longest = max(map(len, prompts)) + task_cfg.max_new_tokens + 2
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and longest > limit:
        raise ValueError(
            f"task {task.name!r}: its longest prompt ({longest - task_cfg.max_new_tokens - 2} tokens) and "
            f"task.max_new_tokens={task_cfg.max_new_tokens} need {longest} positions, more than the model's "
            f"max_position_embeddings={limit}; use shorter answers (task.kwargs) or a model with more positions"
        )


def expected_key(
    model_cfg: ModelConfig, task_cfg: TaskConfig, cold: ColdStartConfig, *, numerics: str = "native"
) -> str:
    """The `key` that `get_cold_start` will record for this config, computed without loading anything."""
    if _as_is(model_cfg, cold):
        return f"checkpoint:{checkpoint_fingerprint(model_cfg.checkpoint)}"
    return cold_start_key(model_cfg, task_cfg, cold, data_hash_of(task_cfg), numerics=numerics)


def cold_start_patience(cold: ColdStartConfig, task_cfg: TaskConfig) -> int:
    """Evaluations without a new best held-out accuracy after which the warm-up stops (0: never).

    `cold_start.patience=null` (default) means 10 for a dataset or gym task, where accuracy can plateau
    below the band for good, and never for the synthetic tasks, whose warm-ups run to the band.
    """
    if cold.patience is not None:
        return cold.patience
    return 10 if task_cfg.name in (DATASET_TASK, GYM_TASK) else 0


def cold_start_stop(accuracies: list[float], low: float, patience: int) -> str | None:
    """Why the warm-up stops after these held-out accuracies (one per evaluation), or None to go on:
    `in_band` once the last reaches the band's lower edge, `plateau` once the best is `patience`
    evaluations old (`patience` 0: never)."""
    if accuracies and accuracies[-1] >= low:
        return "in_band"
    if patience and len(accuracies) > patience:
        best = max(range(len(accuracies)), key=lambda i: (accuracies[i], -i))  # first index of the best
        if len(accuracies) - 1 - best >= patience:
            return "plateau"
    return None


def get_cold_start(
    model_cfg: ModelConfig, task_cfg: TaskConfig, cold: ColdStartConfig, *, numerics: str = "native"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict]:
    """The starting policy and its tokenizer: a checkpoint as it is (`cold_start.mode` auto or none),
    else the cached warm-up (trained once, under a file lock shared by parallel runs)."""
    dtype = getattr(torch, model_cfg.dtype)
    if _as_is(model_cfg, cold):
        model = load_model(model_cfg.checkpoint, experts_implementation=model_cfg.experts_implementation, dtype=dtype)
        tokenizer = load_tokenizer(model_cfg.checkpoint)
        check_positions(model, tokenizer, setup_task(task_cfg, cold.seed).render(tokenizer), task_cfg)
        return (
            model,
            tokenizer,
            {
                "path": model_cfg.checkpoint,
                "key": f"checkpoint:{checkpoint_fingerprint(model_cfg.checkpoint)}",
            },
        )
    root = Path(cold.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    data_hash = data_hash_of(task_cfg)
    key = cold_start_key(model_cfg, task_cfg, cold, data_hash, numerics=numerics)
    path = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "cold_start.json").is_file():
            if path.exists():
                shutil.rmtree(path)  # an interrupted earlier attempt
            model, tokenizer, info = train_cold_start(model_cfg, task_cfg, cold, numerics=numerics)
            tmp = root / f".{key}.tmp{os.getpid()}"
            model.save_pretrained(tmp)
            if not (tmp / "config.json").is_file():  # e.g. a torch.distributed rank other than 0
                shutil.rmtree(tmp, ignore_errors=True)
                raise RuntimeError(f"save_pretrained wrote no checkpoint to {tmp}; nothing was cached")
            tokenizer.save_pretrained(tmp)
            (tmp / "cold_start.json").write_text(json.dumps({**info, "key": key, "data": data_hash}, indent=1))
            os.replace(tmp, path)
        info = json.loads((path / "cold_start.json").read_text())
        model = load_model(path, experts_implementation=model_cfg.experts_implementation, dtype=dtype)
        tokenizer = load_tokenizer(path, info)
        if not (path / COVARIATES).is_file():  # once per cold start (also for one cached before covariates were)
            covariates = {**cold_start_covariates(model, tokenizer, task_cfg, cold), "sft_steps": info["steps"]}
            write_atomic(path / COVARIATES, json.dumps(covariates, indent=1))
    covariates = json.loads((path / COVARIATES).read_text())
    unit = cold_start_key(model_cfg, task_cfg, cold, data_hash, numerics=numerics, unit=True)  # twins share it
    return model, tokenizer, {**info, "path": str(path), "unit": unit, "covariates": covariates}


def cold_start_covariates(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task_cfg: TaskConfig, cold: ColdStartConfig
) -> dict:
    """The start's covariates on its held-out split (`moe_rl.rollout.evaluation.start_covariates`), on one
    thread and from a stream seeded by the cold start's seed, so they do not depend on which run computed them."""
    task = setup_task(task_cfg, cold.seed).render(tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return start_covariates(
            model,
            tokenizer,
            task.eval,
            task,
            n=COVARIATE_SAMPLES,
            max_new_tokens=task_cfg.max_new_tokens,
            seed=cold.seed,
        )
    finally:
        torch.set_num_threads(threads)


def data_hash_of(task_cfg: TaskConfig) -> str | None:
    if task_cfg.name == GYM_TASK:
        return gym_data_hash()
    return data_hash(str(task_cfg.path), task_cfg.split) if task_cfg.name == DATASET_TASK else None


def cached_member(cfg: TrainConfig) -> dict | None:
    """The cached warm-up record (`cold_start.json`) of the pool member a run of `cfg` starts from, or None where
    that member is not trained yet (a study's launcher reads it to skip members whose warm-up ended out of band)."""
    cold = run_member(cfg)
    path = Path(cold.cache_dir) / expected_key(cfg.model, cfg.task, cold, numerics=cfg.numerics) / "cold_start.json"
    return json.loads(path.read_text()) if path.is_file() else None


def warm_member(cfg: TrainConfig) -> dict:
    """Train (or read) the pool member a run of `cfg` starts from as the run itself would (pinned numerics, its
    threads, the member's task seed): the same cache entry, bitwise the same weights. Returns its steps, accuracy,
    in_band, stopped and key."""
    from moe_rl.run.folder import pin_numerics

    pin_numerics(cfg.numerics)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cold = run_member(cfg)
    setup_task(cfg.task, cold.seed)
    _, _, info = get_cold_start(cfg.model, cfg.task, cold, numerics=cfg.numerics)
    return {k: info.get(k) for k in ("steps", "accuracy", "in_band", "stopped", "key")}
