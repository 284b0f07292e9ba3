"""The three staleness axes (moe_rl.loop.staleness): N splits a rollout, S grows it at a fixed mini-batch, a lag of k
samples each rollout with the policy of k steps before and weighs the ratio against it."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from helpers import LOOP, ROOT, launch, run_train, run_values, tiny_config, tiny_overrides, train_command

from moe_rl.algos.corrections import engine_weight
from moe_rl.config import TrainConfig, config_hash, validate
from moe_rl.loop.keys import run_keys
from moe_rl.loop.staleness import PolicyLag, behaviour_weight_kwargs
from moe_rl.train import Trainer, train

OUTCOMES = ("reward/mean", "reward/std", "rollout/response_len")  # what the sampled rollout alone decides


def _config(tmp_path, cache, name: str, *changes: str, steps: int = 3) -> TrainConfig:
    return tiny_config(tmp_path / name, *LOOP, f"steps={steps}", "replay.mode=r3", *changes, cache=cache)


def _states(trainer: Trainer) -> tuple[list[dict[str, torch.Tensor]], list, list]:
    """Record, on `trainer`, the policy's weights at the start of each step, each step's rollout and its Batch."""
    starts: list[dict[str, torch.Tensor]] = []
    rollouts, batches = [], []
    rollout, updates = trainer.rollout, trainer.updates

    def recorded_rollout(step: int):
        starts.append({k: v.detach().clone() for k, v in trainer.policy.state_dict().items()})
        sampled = rollout(step)
        rollouts.append(sampled.rollout)
        return sampled

    def recorded_updates(step: int, batch):
        batches.append(batch)
        return updates(step, batch)

    trainer.rollout, trainer.updates = recorded_rollout, recorded_updates  # type: ignore[method-assign]
    return starts, rollouts, batches


def test_lag_0_and_staleness_1_are_todays_run(tmp_path, cache) -> None:
    """The defaults: set explicitly, the run is bitwise the one that never names them, with the same identity (a
    shipped run's folder resumes) and run keys; a lag's first step samples what lag 0 samples."""
    plain = _config(tmp_path, cache, "plain")
    named = _config(tmp_path, cache, "named", "rollout.policy_lag=0", "rollout.staleness=1")
    lagged = _config(tmp_path, cache, "lagged", "rollout.policy_lag=1")
    recorded = {k: v for k, v in plain.to_dict().items()}
    recorded["rollout"] = {k: v for k, v in recorded["rollout"].items() if k not in ("staleness", "policy_lag")}
    assert config_hash(named) == config_hash(plain) != config_hash(lagged)
    from moe_rl.run.identity import identity_hash

    assert identity_hash(recorded) == config_hash(plain)  # a config.yaml from before the keys existed
    for cfg in (plain, named, lagged):
        train(cfg)
    values = {name: run_values(tmp_path / name) for name in ("plain", "named", "lagged")}
    pd.testing.assert_frame_equal(values["plain"], values["named"])
    first = {
        name: frame[(frame["step"] == 1) & frame["key"].isin(OUTCOMES)].reset_index(drop=True)
        for name, frame in values.items()
    }
    pd.testing.assert_frame_equal(first["plain"], first["lagged"])
    keys = pd.read_parquet(tmp_path / "lagged" / "metrics.parquet").columns
    assert "lag" in keys and "S" not in keys
    assert "lag" not in pd.read_parquet(tmp_path / "plain" / "metrics.parquet").columns


def test_staleness_grows_the_rollout_at_a_fixed_minibatch_bitwise(tmp_path, cache) -> None:
    """S = 2 at P prompts and N = 1 is bitwise the run of 2P prompts at N = 2: one rollout of S x P prompts, S x N
    updates of P x G / N sequences each, one pass. S = 3 at N = 2: 6 updates of the same 16 rows."""
    stale = _config(tmp_path, cache, "stale", "rollout.prompts_per_step=4", "optim.updates_per_rollout=1",
                    "rollout.staleness=2")  # fmt: skip
    split = _config(tmp_path, cache, "split", "rollout.prompts_per_step=8", "optim.updates_per_rollout=2")
    for cfg in (stale, split):
        train(cfg)
    pd.testing.assert_frame_equal(run_values(tmp_path / "stale"), run_values(tmp_path / "split"))
    cfg = _config(tmp_path, cache, "S3", "rollout.prompts_per_step=4", "optim.updates_per_rollout=2",
                  "rollout.staleness=3", steps=1)  # fmt: skip
    trainer = Trainer(cfg)
    rows: list[int] = []
    update = trainer.update

    def counted(batch, picked, **kwargs):
        rows.append(len(picked))
        return update(batch, picked, **kwargs)

    trainer.update = counted  # type: ignore[method-assign]
    _, rollouts, _ = _states(trainer)
    trainer.step(1)
    assert len(rollouts[0]) == 3 * 4 * 4 and rows == [4 * 4 // 2] * 6
    assert run_keys(cfg, trainer.policy)["S"] == 3


def test_a_lagged_rollout_is_sampled_by_the_policy_of_k_steps_before(tmp_path, cache) -> None:
    """Lag 2: the rollout of step t is the one the policy at the start of step max(t - 2, 1) samples (tokens,
    behaviour log-probs and the routes R3 replays, bitwise), not the live policy's; the updates weigh each token
    by the decoupled loss's pi_prox / pi_behav, pi_prox the old pass at the live weights."""
    lagged = Trainer(_config(tmp_path, cache, "lag2", "rollout.policy_lag=2", "optim.updates_per_rollout=1"))
    starts, rollouts, batches = _states(lagged)
    for step in range(1, 5):
        lagged.step(step)
    probe = Trainer(_config(tmp_path, cache, "probe"))
    for step in range(1, 5):
        behaviour = starts[max(step - 2, 1) - 1]  # the weights at the start of step max(t - k, 1)
        probe.policy.load_state_dict(behaviour)
        expected = probe.rollout(step).rollout
        got = rollouts[step - 1]
        assert torch.equal(got.sequences, expected.sequences), step
        assert torch.equal(got.rollout_logp, expected.rollout_logp), step
        assert got.routes is not None and expected.routes is not None
        assert torch.equal(got.routes.indices, expected.routes.indices), step
        batch = batches[step - 1]
        mask = got.response_mask
        rho = torch.where(mask, (batch.old.logp.double() - got.rollout_logp.double()).exp(), 0.0)
        assert batch.correction is not None and torch.equal(batch.correction.weight, rho.to(batch.old.logp.dtype))
        if step >= 2:  # the live policy has moved past the sampler
            probe.policy.load_state_dict(starts[step - 1])
            assert not torch.equal(probe.rollout(step).rollout.rollout_logp, got.rollout_logp), step
            assert (batch.old.logp - got.rollout_logp)[mask].abs().max() > 1e-3
    assert lagged.lag is not None and len(lagged.lag.versions) == 2  # k copies of the weights


def test_behaviour_weight_is_the_plain_ratio_per_token_or_per_sequence() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    behaviour = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -9.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    token = engine_weight(old_logp=old, rollout_logp=behaviour, mask=mask, **behaviour_weight_kwargs(token_loss=True))
    assert torch.allclose(
        token.weight, torch.tensor([[math.exp(0.5), math.exp(-1.0), 0.0], [math.exp(0.1), math.exp(6.0), 0.0]])
    )
    assert not token.truncated.any() and not token.masked.any()  # uncapped: exp(6) stays
    seq = engine_weight(old_logp=old, rollout_logp=behaviour, mask=mask, **behaviour_weight_kwargs(token_loss=False))
    assert torch.allclose(seq.weight[:, :2], torch.tensor([[math.exp(-0.5)] * 2, [math.exp(6.1)] * 2]))


def test_policy_lag_keeps_k_versions_and_hands_back_the_oldest() -> None:
    lag = PolicyLag(2)
    seen = []
    for version in range(6):  # the weights at the start of steps 1..6
        seen.append(int(lag.behaviour({"w": torch.tensor(float(version))})["w"]))
        assert len(lag.versions) == min(version + 1, 2)
    assert seen == [0, 0, 0, 1, 2, 3]
    again = PolicyLag(2)
    again.restore(lag.state(), "cpu")
    assert [int(v["w"]) for v in again.versions] == [4, 5]


def test_a_lagged_run_resumes_bitwise(tmp_path, cache, monkeypatch) -> None:
    """The lagged copies are state: a run stopped after its step-2 checkpoint and rerun logs what the uninterrupted
    run logs (its step 3 samples with step 1's weights, which only the checkpoint still holds)."""
    changes = ("rollout.policy_lag=2", "checkpoint_every=2", "optim.updates_per_rollout=1")
    train(_config(tmp_path, cache, "whole", *changes, steps=4))
    stopped = Trainer(_config(tmp_path, cache, "resumed", *changes, steps=4))
    step = stopped.step

    def interrupted(n: int):
        if n == 3:
            raise KeyboardInterrupt
        return step(n)

    stopped.step = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        stopped.run()
    train(_config(tmp_path, cache, "resumed", *changes, steps=4))
    pd.testing.assert_frame_equal(run_values(tmp_path / "resumed"), run_values(tmp_path / "whole"))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda c: setattr(c.rollout, "staleness", 0), r"rollout.staleness=0 must be >= 1"),
        (lambda c: setattr(c.rollout, "policy_lag", -1), r"rollout.policy_lag=-1 must be >= 0"),
        (
            lambda c: (setattr(c.rollout, "policy_lag", 2), setattr(c.rollout, "engine", "vllm")),
            r"rollout.policy_lag=2 samples with a lagged copy of the policy on rollout.engine=hf; rollout.engine=.vllm. holds",
        ),
    ],
)
def test_bad_staleness_values_are_refused_in_one_line(change, match: str) -> None:
    cfg = TrainConfig()
    change(cfg)
    with pytest.raises(ValueError, match=match) as err:
        validate(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("axis", ["rollout.policy_lag=2", "rollout.staleness=4"])
def test_each_axis_is_a_command_line_override(axis: str) -> None:
    """Each axis, as the command line spells it, composes (Hydra, as experiments/train.py composes it) into the run's
    config and validates. The runs themselves are this module's in-process tests; a command line with both axes, run to
    its end by the script's own entry point, is the one-process run of
    `test_a_lagged_stale_run_logs_on_two_ranks_what_it_logs_on_one`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from moe_rl.config import to_train_config

    ConfigStore.instance().store(name="base_config", node=TrainConfig)
    with initialize_config_dir(config_dir=str(ROOT / "experiments" / "conf"), version_base="1.3"):
        cfg = validate(to_train_config(compose("config", overrides=tiny_overrides("steps=2", "eval_every=2", axis))))
    key, _, value = axis.partition("=")
    assert getattr(cfg.rollout, key.removeprefix("rollout.")) == int(value) and cfg.steps == 2


@pytest.mark.slow
def test_a_lagged_stale_run_logs_on_two_ranks_what_it_logs_on_one(tmp_path, cache) -> None:
    """Lag 2 and S = 2 under torchrun (FSDP, 2 ranks, float64): every rank samples with the same lagged weights and
    its own rows of the grown rollout, so the run logs what one process logs: the rewards bitwise, continuous values
    within summation order (test_distributed's bounds); the move bins' totals equal (a move near a bin edge may
    change bins, as there)."""
    overrides = tiny_overrides("model.dtype=float64", "rollout.dtype=float64", "eval_every=3", "steps=3",
                               "rollout.policy_lag=2", "rollout.staleness=2", "replay.mode=r3")  # fmt: skip
    # one process: `python experiments/train.py` with these overrides, the script run in this process (`run_train`)
    one = run_train(*train_command(overrides, tmp_path / "one", cache)[2:])
    assert one.returncode == 0, one.stderr[-4000:]
    launch(train_command(overrides, tmp_path / "two", cache, nproc=2))
    # both axes from the command line: the plain run runs to its end
    assert sorted(run_values(tmp_path / "one")["step"].unique()) == [0, 1, 2, 3]
    both = run_values(tmp_path / "one").merge(run_values(tmp_path / "two"), on=["step", "key"], suffixes=("_1", "_2"))
    binned = both["key"].str.startswith("route/flip_vs_margin/")
    kind = both.loc[binned, "key"].str.replace(r"/bin_\d+$", "", regex=True)
    totals = both[binned].groupby([both.loc[binned, "step"], kind])[["value_1", "value_2"]].sum()
    assert len(totals) and (totals["value_1"] == totals["value_2"]).all()
    both = both[~binned]
    exact = both["key"].str.match(r"(reward/|task/accuracy|rollout/response_len)")
    assert exact.sum() >= 9
    pd.testing.assert_series_equal(both.loc[exact, "value_1"], both.loc[exact, "value_2"], check_names=False)
    close = both[~exact]
    assert ((close["value_1"] - close["value_2"]).abs() / (1 + close["value_1"].abs())).max() <= 1e-8
