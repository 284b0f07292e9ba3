"""Cold start: supervised warm-up on task demonstrations until eval accuracy enters a band.

RL on a policy that never succeeds has no signal, and on one that always succeeds has nothing to
learn. Every arm and seed of a comparison starts from the same cold-start checkpoint (DESIGN §4),
cached on disk under a hash of everything that determines it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from moe_rl.config import ColdStartConfig, ModelConfig, TaskConfig
from moe_rl.models import build_model, load_model
from moe_rl.rollout import generate
from moe_rl.tasks import get_task, load_task, make_tokenizer, score_completions

log = logging.getLogger(__name__)


def cold_start_key(model: ModelConfig, task: TaskConfig, cold: ColdStartConfig) -> str:
    """Hash of everything that determines the cold-start weights (not the RL seed or arm)."""
    import transformers

    spec = {
        "model": {k: v for k, v in asdict(model).items() if k != "experts_implementation"},
        "task": {k: v for k, v in asdict(task).items() if k not in ("partial_credit",)},
        "cold_start": {k: v for k, v in asdict(cold).items() if k != "cache_dir"},
        "vocab": make_tokenizer().get_vocab(),
        "versions": [torch.__version__, transformers.__version__],
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=list).encode()).hexdigest()[:16]


def evaluate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, examples: list[dict], task_name: str, *,
    max_new_tokens: int, batch_size: int = 256,
) -> float:
    """Greedy accuracy (fraction of exactly correct answers) on `examples`."""
    task = get_task(task_name)
    rewards: list[float] = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        out = generate(model, tokenizer, [e["prompt"] for e in chunk], greedy=True,
                       max_new_tokens=max_new_tokens, record_routes=False)
        rewards += score_completions(task, out.completions, chunk)
    return sum(r == 1.0 for r in rewards) / max(len(rewards), 1)


def _sft_batch(tokenizer: PreTrainedTokenizerFast, examples: list[dict]) -> dict[str, torch.Tensor]:
    texts = [e["prompt"] + e["answer"] for e in examples]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    eos = torch.full((len(texts), 1), tokenizer.eos_token_id)
    input_ids = torch.cat([enc["input_ids"], eos], 1)
    attention_mask = torch.cat([enc["attention_mask"], torch.ones_like(eos)], 1)
    labels = torch.full_like(input_ids, -100)
    for b, e in enumerate(examples):  # supervise answer + EOS only; rows are left-padded
        n = len(e["answer"]) + 1
        labels[b, -n:] = input_ids[b, -n:]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def train_cold_start(model_cfg: ModelConfig, task_cfg: TaskConfig, cold: ColdStartConfig) -> tuple[PreTrainedModel, dict]:
    """Supervised warm-up until greedy eval accuracy reaches the band's lower edge.

    Runs on one CPU thread whatever the caller's setting: float reductions depend on the thread
    count, and the cached weights must not depend on which run of a sweep trained them.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_cold_start(model_cfg, task_cfg, cold)
    finally:
        torch.set_num_threads(threads)


def _train_cold_start(model_cfg: ModelConfig, task_cfg: TaskConfig, cold: ColdStartConfig) -> tuple[PreTrainedModel, dict]:
    tokenizer = make_tokenizer()
    model = build_model(
        model_cfg.family, seed=cold.seed, experts_implementation=model_cfg.experts_implementation,
        vocab_size=len(tokenizer), num_layers=model_cfg.num_layers, num_experts=model_cfg.num_experts,
        top_k=model_cfg.top_k, hidden_size=model_cfg.hidden_size,
        **({"moe_intermediate_size": model_cfg.moe_intermediate_size} if model_cfg.moe_intermediate_size else {}),
    )
    data = load_task(task_cfg.name, n_train=task_cfg.n_train, n_eval=task_cfg.n_eval, seed=cold.seed, **task_cfg.kwargs)
    train, evals = data["train"].to_list(), data["eval"].to_list()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cold.lr, weight_decay=0.0)
    rng = random.Random(cold.seed)
    low, high = cold.band
    history, accuracy, step = [], 0.0, 0
    model.train()
    for step in range(1, cold.max_steps + 1):
        batch = {k: v.to(model.device) for k, v in _sft_batch(tokenizer, rng.sample(train, cold.batch_size)).items()}
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % cold.eval_every == 0:
            model.eval()
            accuracy = evaluate(model, tokenizer, evals, task_cfg.name, max_new_tokens=task_cfg.max_new_tokens)
            model.train()
            history.append({"step": step, "loss": loss.item(), "accuracy": accuracy})
            log.info("cold start step %d loss %.3f eval accuracy %.3f", step, loss.item(), accuracy)
            if accuracy >= low:
                break
    model.eval()
    info = {"steps": step, "accuracy": accuracy, "band": [low, high], "in_band": low <= accuracy <= high,
            "history": history}
    if not info["in_band"]:
        log.warning("cold start ended at accuracy %.3f outside the band %s", accuracy, cold.band)
    return model, info


def get_cold_start(model_cfg: ModelConfig, task_cfg: TaskConfig, cold: ColdStartConfig) -> tuple[PreTrainedModel, dict]:
    """The cached cold-start model (training it once, under a file lock shared by parallel runs)."""
    root = Path(cold.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    key = cold_start_key(model_cfg, task_cfg, cold)
    path = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "cold_start.json").is_file():
            if path.exists():
                shutil.rmtree(path)  # an interrupted earlier attempt
            model, info = train_cold_start(model_cfg, task_cfg, cold)
            tmp = root / f".{key}.tmp{os.getpid()}"
            model.save_pretrained(tmp)
            make_tokenizer().save_pretrained(tmp)
            (tmp / "cold_start.json").write_text(json.dumps({**info, "key": key}, indent=1))
            os.replace(tmp, path)
    info = json.loads((path / "cold_start.json").read_text())
    return load_model(path, experts_implementation=model_cfg.experts_implementation), {**info, "path": str(path)}
