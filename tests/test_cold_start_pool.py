"""The cold-start pool: a run's member from its seed, each member one cached cold start with its covariates, and
a pool of one that is today's run."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import ROOT, run_metrics, tiny_config

from moe_rl.config import ColdStartConfig, GymConfig, ModelConfig, TaskConfig, TrainConfig, config_hash, validate
from moe_rl.loop.cold_start import (
    COVARIATES,
    cold_start_key,
    expected_key,
    member_config,
    pool_member,
    warmup_task,
)
from moe_rl.loop.keys import run_keys
from moe_rl.models import build_model
from moe_rl.rollout.evaluation import greedy_accuracy, sampled_reward_entropy, start_covariates
from moe_rl.tasks import make_tokenizer
from moe_rl.tasks.setup import setup_task
from moe_rl.tasks.tokenizer import data_alphabet
from moe_rl.train import train

TASK = TaskConfig(n_train=64, n_eval=8)


def test_a_run_starts_from_member_seed_mod_pool() -> None:
    """Seeds 0..2K-1 give K members x 2 seeds; member m is the cold start at the pool's seed + m; a pool of one is
    the plain cold start of every seed."""
    pool = ColdStartConfig(pool=3, seed=10)
    assert [pool_member(pool, s) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [member_config(pool, s).seed for s in range(6)] == [10, 11, 12, 10, 11, 12]
    assert member_config(ColdStartConfig(), 7) == ColdStartConfig()


def test_a_member_is_the_cached_cold_start_of_its_seed() -> None:
    """Member m of a pool has the key of the plain cold start at seed + m (pool and member never enter a key), and
    a pool of one leaves every key and run identity where it was."""
    pool = ColdStartConfig(pool=6)
    assert cold_start_key(ModelConfig(), TASK, member_config(pool, 7)) == cold_start_key(
        ModelConfig(), TASK, ColdStartConfig(seed=1)
    )
    assert cold_start_key(ModelConfig(), TASK, pool) == cold_start_key(ModelConfig(), TASK, ColdStartConfig())
    assert config_hash(TrainConfig(cold_start=ColdStartConfig(pool=1))) == config_hash(TrainConfig())
    assert config_hash(TrainConfig(cold_start=ColdStartConfig(pool=6))) != config_hash(TrainConfig())


def test_a_bad_pool_is_refused(tmp_path) -> None:
    """A pool below 1 by validate; a pool of a checkpoint that starts as it is (no warm-up per member) before the
    run's folder is touched, naming the fix."""
    with pytest.raises(ValueError, match=r"cold_start.pool=0 must be >= 1"):
        validate(TrainConfig(cold_start=ColdStartConfig(pool=0)))
    model = ModelConfig(checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match=r"starts every run from the checkpoint itself \(use cold_start=sft\)"):
        expected_key(model, TASK, ColdStartConfig(pool=2))
    assert expected_key(model, TASK, ColdStartConfig(pool=2, mode="sft")) != expected_key(
        model, TASK, ColdStartConfig()
    )


def test_a_pooled_run_is_keyed_by_its_member_and_its_seed() -> None:
    model = build_model("qwen3_moe", vocab_size=len(make_tokenizer()))
    cfg = TrainConfig(out_dir="/tmp/x", seed=7, cold_start=ColdStartConfig(pool=6))
    keys = run_keys(cfg, model)
    assert (keys["cold_member"], keys["cold_seed"], keys["seed"]) == (1, 1, 7)
    plain = run_keys(TrainConfig(out_dir="/tmp/x", seed=7), model)
    assert "cold_member" not in plain and "cold_seed" not in plain  # a pool of one keeps today's columns
    ladder = run_keys(dataclasses.replace(cfg, rung="moe"), model)
    assert (ladder["rung"], ladder["cold_seed"], ladder["cold_member"]) == ("moe", 1, 1)


def test_start_covariates_of_a_built_model() -> None:
    """The histogram counts every prompt once and agrees with the mean sampled reward (no partial credit); greedy
    accuracy, sampled reward and entropy are those of their own functions on the same stream."""
    tokenizer = make_tokenizer()
    model = build_model("qwen3_moe", vocab_size=len(tokenizer)).eval()
    task = setup_task(TASK, 0).render(tokenizer)
    cov = start_covariates(model, tokenizer, task.eval, task, n=4, max_new_tokens=4, seed=0)
    assert sum(cov["pass_counts"]) == len(task.eval) and len(cov["pass_counts"]) == 5 and cov["samples"] == 4
    correct = sum(c * count for c, count in enumerate(cov["pass_counts"]))
    assert cov["sampled_reward"] == pytest.approx(correct / (4 * len(task.eval)))
    assert cov["greedy_accuracy"] == greedy_accuracy(model, tokenizer, task.eval, task, max_new_tokens=4)
    reward, entropy = sampled_reward_entropy(model, tokenizer, task.eval, task, n=4, max_new_tokens=4, seed=0)
    assert (cov["sampled_reward"], cov["sampled_entropy"]) == (reward, entropy)
    assert 0 < entropy <= torch.log(torch.tensor(float(len(tokenizer)))).item() + 1e-6


def test_a_pool_of_one_is_todays_run_and_a_member_carries_its_covariates(tmp_path, cache) -> None:
    """A pooled run of member 0 logs bitwise the run without a pool; a run of seed 3 in a pool of 2 starts from
    member 1 (the cold start of seed 1), whose covariates, computed once beside the cached checkpoint, are in its
    meta.json beside the member (its run keys); a second run of that member reads them, not recomputes them."""

    def run(name: str, *changes: str) -> dict:
        cfg = tiny_config(tmp_path / name, "steps=2", "eval_every=2", *changes, cache=cache)
        train(cfg)
        return json.loads((tmp_path / name / "meta.json").read_text())

    plain, member0 = run("plain"), run("member0", "cold_start.pool=2")
    columns = ["step", "key", "value"]
    assert run_metrics(tmp_path / "plain")[columns].equals(run_metrics(tmp_path / "member0")[columns])
    assert "cold_member" not in plain["run_keys"] and member0["run_keys"]["cold_member"] == 0
    assert member0["cold_start"]["key"] == plain["cold_start"]["key"]
    meta = run("member1", "cold_start.pool=2", "seed=3")
    cold = meta["cold_start"]
    assert (meta["run_keys"]["cold_member"], meta["run_keys"]["cold_seed"], meta["seed"]) == (1, 1, 3)
    seed1 = tiny_config(tmp_path / "x", "cold_start.seed=1", cache=cache)
    assert cold["key"] == expected_key(seed1.model, seed1.task, seed1.cold_start) != plain["cold_start"]["key"]
    stored = cache / cold["key"] / COVARIATES
    assert cold["covariates"] == json.loads(stored.read_text())
    assert set(cold["covariates"]) == {
        "greedy_accuracy",
        "sampled_reward",
        "sampled_entropy",
        "pass_counts",
        "samples",
    } | {"sft_steps"}
    assert cold["covariates"]["sft_steps"] == cold["steps"] > 0
    written = stored.stat().st_mtime_ns
    again = run("again", "cold_start.pool=2", "seed=5")["cold_start"]
    assert again["key"] == cold["key"] and again["covariates"] == cold["covariates"]
    assert stored.stat().st_mtime_ns == written
    assert again["unit"] == cold["unit"] != plain["cold_start"]["unit"]  # one member, one unit


def test_a_member_warmed_under_other_versions_or_numerics_is_a_twin_one_unit(monkeypatch) -> None:
    """The key (the cached weights) moves with the library versions and pinned numerics; the unit (the start the
    analyses count) does not, so a member warmed on two machines counts once; another member is another unit."""
    import transformers

    cfg = TrainConfig()
    args = (cfg.model, cfg.task, cfg.cold_start)
    key, unit = cold_start_key(*args), cold_start_key(*args, unit=True)
    assert cold_start_key(*args, numerics="avx2") != key and cold_start_key(*args, numerics="avx2", unit=True) == unit
    monkeypatch.setattr(transformers, "__version__", "0.0.0-twin")
    assert cold_start_key(*args) != key and cold_start_key(*args, unit=True) == unit
    other = dataclasses.replace(cfg.cold_start, seed=cfg.cold_start.seed + 1)
    assert cold_start_key(cfg.model, cfg.task, other, unit=True) != unit


def test_the_pool_group_gives_every_study_six_starts() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from moe_rl.config import to_train_config

    ConfigStore.instance().store(name="base_config", node=TrainConfig)
    with initialize_config_dir(config_dir=str(ROOT / "experiments" / "conf"), version_base="1.3"):
        cfg = validate(to_train_config(compose("config", overrides=["cold_start=pool", "seed=7"])))
        matched = validate(to_train_config(compose("config", overrides=["cold_start=matched", "cold_start.pool=6"])))
    assert (cfg.cold_start.pool, cfg.cold_start.mode, pool_member(cfg.cold_start, cfg.seed)) == (6, "auto", 1)
    assert (matched.cold_start.pool, matched.cold_start.target_metric) == (6, "sampled")
    assert TrainConfig().cold_start.pool == 1  # a plain run: one start


def test_a_warmup_pool_of_its_own_keeps_the_held_out_split_and_the_default_key() -> None:
    """`cold_start.n_train` draws the warm-up a train pool of that size beside the task's own held-out prompts (a
    reasoning-gym task's too, rendered as the run renders it); unset, the warm-up supervises on the task itself and
    every key stays where it was."""
    task = setup_task(TASK, 3)
    own = warmup_task(TASK, ColdStartConfig(seed=3, n_train=200), task)
    assert len(own.train) == 200 and own.eval == task.eval
    gym = TaskConfig(name="gym", n_train=16, n_eval=8, gym=GymConfig(name="basic_arithmetic"))
    gym_task = setup_task(gym, 3)
    gym_own = warmup_task(gym, ColdStartConfig(seed=3, n_train=64), gym_task)
    tokenizer = make_tokenizer(alphabet=data_alphabet(gym_task.texts() + gym_own.texts()))
    rendered = gym_own.render(tokenizer)
    assert len(rendered.train) == 64 and rendered.eval == gym_task.render(tokenizer).eval
    assert len({e["prompt"] for e in own.train} - {e["prompt"] for e in task.train}) > 100
    assert warmup_task(TASK, ColdStartConfig(seed=3), task) is task
    plain = cold_start_key(ModelConfig(), TASK, ColdStartConfig())
    assert cold_start_key(ModelConfig(), TASK, ColdStartConfig(n_train=None)) == plain
    assert cold_start_key(ModelConfig(), TASK, ColdStartConfig(n_train=200)) != plain
    assert config_hash(TrainConfig(cold_start=ColdStartConfig(n_train=None))) == config_hash(TrainConfig())
    with pytest.raises(ValueError, match=r"cold_start.n_train=0 must be >= 1"):
        validate(TrainConfig(cold_start=ColdStartConfig(n_train=0)))


def test_the_warmup_samples_its_own_pool_and_refuses_another_held_out_split(monkeypatch) -> None:
    """Every demonstration the warm-up supervises on comes from its own pool (with most of them outside the task's
    64 train prompts); a task whose held-out split moves with its train size is refused, naming the key."""
    from moe_rl.loop import cold_start

    seen: list[str] = []
    real_batch = cold_start._sft_batch

    def batch(tokenizer, examples):
        seen.extend(e["prompt"] for e in examples)
        return real_batch(tokenizer, examples)

    monkeypatch.setattr(cold_start, "_sft_batch", batch)
    cold = ColdStartConfig(n_train=400, max_steps=3, eval_every=3, batch_size=32)
    cold_start.train_cold_start(ModelConfig(), TASK, cold)
    task = setup_task(TASK, 0)
    own = warmup_task(TASK, cold, task)
    assert len(seen) == 96 and set(seen) <= {e["prompt"] for e in own.train}
    assert sum(p not in {e["prompt"] for e in task.train} for p in seen) > 48
    moved = dataclasses.replace(task, eval=task.eval[1:])
    with pytest.raises(ValueError, match=r"another held-out split .* \(leave cold_start.n_train unset\)"):
        warmup_task(TASK, cold, moved)


def test_the_warmup_adam_beta2_is_its_own_key_and_reaches_the_optimizer(monkeypatch) -> None:
    """`cold_start.beta2` at torch's default (0.999) is every shipped warm-up, key and run identity unchanged; another
    value is another start, and the SFT steps' AdamW runs with betas (0.9, beta2); outside [0, 1) it is refused."""
    from moe_rl.loop import cold_start

    plain = cold_start_key(ModelConfig(), TASK, ColdStartConfig())
    assert cold_start_key(ModelConfig(), TASK, ColdStartConfig(beta2=0.999)) == plain
    assert cold_start_key(ModelConfig(), TASK, ColdStartConfig(beta2=0.95)) != plain
    assert config_hash(TrainConfig(cold_start=ColdStartConfig(beta2=0.999))) == config_hash(TrainConfig())
    betas: list[tuple[float, float]] = []
    real = torch.optim.AdamW

    class Recorded(real):  # type: ignore[misc, valid-type]
        def __init__(self, params, **kwargs):
            betas.append(kwargs["betas"])
            super().__init__(params, **kwargs)

    monkeypatch.setattr(cold_start.torch.optim, "AdamW", Recorded)
    cold_start.train_cold_start(ModelConfig(), TASK, ColdStartConfig(beta2=0.95, max_steps=1, eval_every=1))
    assert betas == [(0.9, 0.95)]
    with pytest.raises(ValueError, match=r"cold_start.beta2=1.0 must lie in \[0, 1\)"):
        validate(TrainConfig(cold_start=ColdStartConfig(beta2=1.0)))


def test_the_warmup_lr_ramp_is_its_own_key_and_sets_each_steps_lr(monkeypatch) -> None:
    """`cold_start.warmup_steps` at 0 is every shipped warm-up (constant lr, key and run identity unchanged); 4 is
    another start whose SFT steps 1..6 take lr x 1/4, 2/4, 3/4, 1, 1, 1 (by hand: 7.5e-4, 1.5e-3, 2.25e-3, 3e-3 at
    lr 3e-3); a negative count is refused."""
    from moe_rl.loop import cold_start

    plain = cold_start_key(ModelConfig(), TASK, ColdStartConfig())
    assert cold_start_key(ModelConfig(), TASK, ColdStartConfig(warmup_steps=0)) == plain
    assert cold_start_key(ModelConfig(), TASK, ColdStartConfig(warmup_steps=4)) != plain
    assert config_hash(TrainConfig(cold_start=ColdStartConfig(warmup_steps=0))) == config_hash(TrainConfig())
    lrs: list[float] = []
    real = torch.optim.AdamW

    class Recorded(real):  # type: ignore[misc, valid-type]
        def step(self, closure=None):
            lrs.append(self.param_groups[0]["lr"])
            return super().step(closure)

    monkeypatch.setattr(cold_start.torch.optim, "AdamW", Recorded)
    cold = ColdStartConfig(lr=3e-3, warmup_steps=4, max_steps=6, eval_every=6)
    cold_start.train_cold_start(ModelConfig(), TASK, cold)
    assert lrs == pytest.approx([7.5e-4, 1.5e-3, 2.25e-3, 3e-3, 3e-3, 3e-3], rel=1e-15)
    lrs.clear()
    cold_start.train_cold_start(ModelConfig(), TASK, ColdStartConfig(lr=3e-3, max_steps=3, eval_every=3))
    assert lrs == [3e-3] * 3
    with pytest.raises(ValueError, match=r"cold_start.warmup_steps"):
        validate(TrainConfig(cold_start=ColdStartConfig(warmup_steps=-1)))


def test_the_sft_batch_left_pads_and_supervises_answer_and_eos_only() -> None:
    """Two demonstrations of unequal length, by hand: prompt + answer + EOS right-aligned, pad (0) on the left, the
    mask over the real tokens, labels -100 except the answer and its EOS (char ids: 1 -> 5, 2 -> 6, 3 -> 7,
    5 -> 9, + -> 14; EOS 2)."""
    from moe_rl.loop.cold_start import _sft_batch

    batch = _sft_batch(make_tokenizer(), [{"prompt": "1+1", "answer": "2"}, {"prompt": "12+3", "answer": "15"}])
    assert batch["input_ids"].tolist() == [[0, 0, 5, 14, 5, 6, 2], [5, 6, 14, 7, 5, 9, 2]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 1], [1] * 7]
    assert batch["labels"].tolist() == [[-100] * 5 + [6, 2], [-100] * 4 + [5, 9, 2]]
    assert {t.dtype for t in batch.values()} == {torch.long}
