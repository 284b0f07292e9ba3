"""The RL loop: replay equivalence at theta == theta_old, and short end-to-end runs per arm."""

from __future__ import annotations

import contextlib
import json
import math
import re

import pandas as pd
import pytest
import torch
from helpers import RUN_KEY_HEAD, loop_config, run_values

from moe_rl.config import TrainConfig, validate
from moe_rl.loop.passes import anchor_routes
from moe_rl.loop.step_metrics import aggregate
from moe_rl.metrics.names import defines
from moe_rl.rollout.generate import forward_logp
from moe_rl.routing import Routes, compare_routes
from moe_rl.routing.modes import mode_names, replay_mode
from moe_rl.train import Batch, Trainer, train


def test_first_minibatch_loss_is_identical_with_and_without_replay(tmp_path, cache) -> None:
    results = {}
    for replay in mode_names():
        trainer = Trainer(loop_config(tmp_path, cache, replay=replay))
        rollout, rewards, _ = trainer.rollout(step=1)
        anchor = anchor_routes(trainer.anchor, rollout, temperature=1.0)  # anchored: the cold start's (theta's)
        old = trainer.old_pass(rollout, anchor=anchor)
        from moe_rl.algos import group_advantages

        adv = group_advantages(rewards, group_size=trainer.cfg.rollout.group_size)
        replay_routes = replay_mode(replay).pick(old=old.routes, rollout=rollout.routes, anchor=anchor)
        rows = torch.arange(len(rollout))[:16]
        results[replay] = trainer.update(Batch(rollout, adv, old, replay_routes), rows)
    # theta == theta_old and fp32 rollouts: rollout, old and replayed routes coincide (and so do the
    # recorded and live combine weights of trr, and no replayed expert falls under the threshold), so
    # every replay mode computes bitwise the same loss and ratios. The ratios are 1 up to the last bit of the
    # log-probs: the old pass sees the whole batch and the update a mini-batch, and CPU kernels may sum
    # a row differently at another batch size or thread count.
    for replay in mode_names(replays=True, weights=False):
        for key in ("loss", "loss/policy", "ratio/token_var", "ratio/token_max", "optim/grad_norm"):
            assert results[replay][key] == results["none"][key], (replay, key)
        assert results[replay]["route/native_vs_replayed/flip_rate"] == 0.0
    # trr: the same loss and ratios bitwise; the router gets no gradient, so the norm is the rest's
    for replay in mode_names(weights=True):
        for key in ("loss", "loss/policy", "ratio/token_var", "ratio/token_max"):
            assert results[replay][key] == results["none"][key], (replay, key)
        assert 0 < results[replay]["optim/grad_norm"] < results["none"]["optim/grad_norm"]
    for replay in mode_names(threshold=True):
        assert results[replay]["route/replay_fallback_frac"] == 0.0
    assert not any("route/replay_fallback_frac" in results[replay] for replay in mode_names(threshold=False))
    assert results["none"]["ratio/token_max"] == pytest.approx(1.0, abs=1e-6)
    assert results["none"]["ratio/token_var"] < 1e-12
    assert results["none"]["route/old_vs_new/flip_rate"] == 0.0
    assert results["none"]["route/old_vs_new/shift/mean"] == pytest.approx(1.0, abs=1e-6)  # the router has not moved


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo, replay",
    [("grpo", "r2"), ("grpo", "none"), ("gspo", "none"), ("grpo", "r3"), ("sapo", "r3_threshold"), ("cispo", "trr")],
)
def test_short_run_per_arm(tmp_path, cache, algo: str, replay: str) -> None:
    cfg = loop_config(tmp_path, cache, algo=algo, replay=replay, steps=4, N=4, lr=3e-3)
    trainer = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    result = trainer.run()
    assert result["status"] in ("completed", "collapsed")
    frame = pd.read_parquet(tmp_path / f"{algo}_{replay}" / "metrics.parquet")
    assert list(frame.columns) == [
        *RUN_KEY_HEAD,
        "rollout_dtype",
        "num_layers",
        "num_moe_layers",
        "num_experts",
        "top_k",
        "step",
        "key",
        "value",
    ]
    assert set(frame["arm"]) == {f"{algo}+{replay}"} and sorted(frame["step"].unique()) == [0, 1, 2, 3, 4]
    assert sorted(k for k in frame["key"].unique() if not defines(k)) == []  # every logged key is in metric_names
    metrics = frame.pivot_table(index="step", columns="key", values="value")
    for key in (
        "reward/mean",
        "ratio/token_var",
        "ratio/seq_var",
        "ratio/ess",
        "kl/k3",
        "policy/entropy",
        "optim/grad_norm",
        "route/old_vs_new/flip_rate",
        "route/rollout_vs_old/flip_rate",
        "route/old_vs_new/flip_rate/layer_1",
        "route/old_vs_new/flip_rate/pos_0",
        "route/margin_mean",
        "time/rollout_s",
        "time/update_s",
        "ratio/clipfrac_low",
        "ratio/clipfrac_high",
        "route/old_vs_new/shift/mean",
        "route/old_vs_new/shift/p10",
        "route/old_vs_new/shift/layer_1",
        "route/old_vs_new/shift/mean/offpolicy",
        "ratio/split/routing_var",
        "ratio/split/weights_var",
        "ratio/split/cov",
        "ratio/split/routing_share/offpolicy",
        "ratio/split/flipped_mass/offpolicy",
        "rollout/k3_kl",
        "rollout/logp_gap_over_ln5",
        "route/load/entropy",
        "optim/router_drift",
        "optim/expert_step/rms",
    ):
        assert metrics.loc[1:, key].map(math.isfinite).all(), key
    # the two shares of the split add to 1, so the routing share of a real spread lies in [0, 1] only
    # when the covariance is not too negative; Var log r = Var rho + Var w + 2 Cov is never negative
    total = metrics["ratio/split/routing_var"] + metrics["ratio/split/weights_var"] + 2 * metrics["ratio/split/cov"]
    assert (total.loc[1:] >= -1e-12).all()
    assert "ratio/split/engine_var" not in metrics  # fp32 rollouts by the trained policy: no engine part
    assert ((metrics.loc[1:, "route/confidence"] > 0) & (metrics.loc[1:, "route/confidence"] <= 1 + 1e-6)).all()
    if replay != "none":  # prime-rl's replace rate is the slot share of used vs cached routes: 0 when replay works
        replaced = metrics.loc[1:, "route/replay_replace_rate"]
        if replay_mode(replay).threshold:  # except the slots the threshold hands back to the live router
            # the same share of slots, one counted in float32 (2^-24 relative per rounding), one in float64
            refilled = metrics.loc[1:, "route/replay_fallback_frac"].tolist()
            assert replaced.tolist() == pytest.approx(refilled, rel=2**-20, abs=0) and max(refilled) > 0
        else:
            assert (replaced == 0).all()
    assert ("route/r3_fallback_frac" in metrics) == replay_mode(replay).replays_rollout  # the rollout's routes
    if replay == "r3":  # the loop's own rollouts record every input position's route
        assert (metrics.loc[1:, "route/r3_fallback_frac"] == 0).all()
    # Router-shift ratio in (0, 1]; the flip-vs-margin counts of updates 2..N match their flip rate.
    assert (
        (metrics.loc[1:, "route/old_vs_new/shift/mean"] > 0) & (metrics.loc[1:, "route/old_vs_new/shift/mean"] <= 1)
    ).all()
    n = metrics.loc[1:, [c for c in metrics if c.startswith("route/flip_vs_margin/n/")]].sum(axis=1)
    flips = metrics.loc[1:, [c for c in metrics if c.startswith("route/flip_vs_margin/flips/")]].sum(axis=1)
    assert (flips <= n).all() and (n > 0).all()
    # Pooled counts vs the mean of per-update rates: equal up to the mini-batches' differing token counts.
    assert (flips / n).to_numpy() == pytest.approx(
        metrics.loc[1:, "route/old_vs_new/flip_rate/offpolicy"].to_numpy(), rel=0.05
    )
    assert metrics["task/accuracy"].dropna().index.tolist() == [0, 2, 4]
    changed = sum(not torch.equal(before[n], p) for n, p in trainer.policy.named_parameters())
    assert changed > 0
    # N = 4 mini-batches with a large learning rate: later updates see a moved router.
    assert metrics["route/old_vs_new/flip_rate"].max() > 0
    if replay != "none":
        # The routes the experts actually used in every update equal the cached ones (thresholded: but
        # where a replayed expert fell back to the live router, at most the fallback share of slots)
        used = metrics["route/used_vs_cached/flip_rate"].loc[1:]
        if replay_mode(replay).threshold:
            assert metrics["route/replay_fallback_frac"].loc[1:].between(0, 1).all()
            assert ((used == 0) | (metrics["route/replay_fallback_frac"].loc[1:] > 0)).all()
        else:
            assert (used == 0).all()
        assert metrics["route/native_vs_replayed/flip_rate"].max() > 0
    if replay == "r3":
        # Under R3 the old pass itself replays the rollout routes.
        assert (metrics["route/rollout_vs_old/flip_rate"].loc[1:] == 0).all()
    status = json.loads((tmp_path / f"{algo}_{replay}" / "status.json").read_text())
    assert status["steps_done"] == 4
    snapshot = Routes.load(tmp_path / f"{algo}_{replay}" / "routes" / "step_00002_old.safetensors")
    assert snapshot.shape[0] == 32 and snapshot.indices.dtype == torch.uint8


def test_replayed_update_uses_cached_routes_after_the_policy_moved(tmp_path, cache) -> None:
    """After two large updates the native routes differ from R2's, yet the pass uses R2's."""
    trainer = Trainer(loop_config(tmp_path, cache, replay="r2", lr=3e-2))
    rollout, rewards, _ = trainer.rollout(step=1)
    old = trainer.old_pass(rollout)
    old_routes = old.routes
    adv = torch.randn(len(rollout))  # any non-zero signal moves the router
    rows = torch.arange(len(rollout))
    for _ in range(2):
        metrics = trainer.update(Batch(rollout, adv, old, old_routes), rows)
    assert metrics["route/native_vs_replayed/flip_rate"] > 0
    assert metrics["route/used_vs_cached/flip_rate"] == 0.0
    # and the recorded log-probs are those of the replayed routes, not the native ones
    from moe_rl.routing import RouteReplay

    with torch.no_grad():
        native_logp, _ = forward_logp(trainer.policy, rollout)
        with RouteReplay(trainer.policy, old_routes):
            replayed_logp, _ = forward_logp(trainer.policy, rollout)
    mask = rollout.response_mask
    assert not torch.equal(native_logp[mask], replayed_logp[mask])


def test_aggregate_is_over_the_whole_step() -> None:
    agg = aggregate(
        [
            {"loss": 1.0, "ratio/token_max": 1.5, "kl/k3": 0.0},
            {"loss": 3.0, "ratio/token_max": 1.2, "kl/k3": 0.2},
            {"loss": 2.0, "ratio/token_max": 1.1, "kl/k3": 0.4},
        ]
    )
    assert agg == pytest.approx({"loss": 2.0, "ratio/token_max": 1.5, "kl/k3": 0.2, "kl/k3/offpolicy": 0.3})
    # Flip-vs-margin counts are summed over the off-policy updates 2..N, never averaged.
    counts = aggregate(
        [
            {"route/flip_vs_margin/n/bin_0": 5.0},
            {"route/flip_vs_margin/n/bin_0": 7.0},
            {"route/flip_vs_margin/n/bin_0": 4.0},
        ]
    )
    assert counts == {"route/flip_vs_margin/n/bin_0": 11.0}
    # The split's shares are means weighted by their denominators: update 1 (no spread, weight 0, share NaN)
    # weighs nothing; over all: (0.2 * 1 + 0.5 * 3) / 4 = 0.425, off-policy the same; nothing weighted: undefined.
    share = "ratio/split/routing_share"
    shares = aggregate(
        [
            {share: math.nan, share + "@weight": 0.0},
            {share: 0.2, share + "@weight": 1.0},
            {share: 0.5, share + "@weight": 3.0},
        ]
    )
    assert shares == pytest.approx({share: 0.425, share + "/offpolicy": 0.425})
    assert aggregate([{share: math.nan, share + "@weight": 0.0}, {share: math.nan, share + "@weight": 0.0}]) == {}


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda c: setattr(c.algo, "name", "ppo"),
            r"algo.name='ppo' is not valid; valid: \['cispo', 'dppo_kl', 'dppo_tv', 'grpo', 'gspo', 'gspo_token', 'sapo', 'vespo'\]",
        ),
        (
            lambda c: setattr(c.algo, "tau_pos", 1.0),
            r"algo.tau_pos is not a parameter of algo.name='grpo'; its parameters: \['eps_high', 'eps_low'\]",
        ),
        (
            lambda c: (setattr(c.algo, "name", "sapo"), setattr(c.algo, "eps_low", 0.2)),
            r"algo.eps_low is not a parameter of algo.name='sapo'; its parameters: \['tau_neg', 'tau_pos'\]",
        ),
        (lambda c: (setattr(c.algo, "name", "sapo"), setattr(c.algo, "tau_neg", 0.0)), r"algo.tau_neg=0.0 must be > 0"),
        (lambda c: setattr(c.algo, "eps_low", 1.5), r"algo.eps_low=1.5 must lie in \[0, 1\]"),
        (
            lambda c: setattr(c.replay, "mode", "r4"),
            rf"replay.mode='r4' is not valid; valid: {re.escape(str(sorted(mode_names())))}",
        ),
        (lambda c: setattr(c.replay, "threshold", -0.1), r"replay.threshold=-0.1 must be >= 0"),
        (
            lambda c: (setattr(c.algo, "name", "gspo"), setattr(c.algo, "router_shift", True)),
            r"algo.router_shift rescales token ratios; algo.name='gspo' has none",
        ),
        (lambda c: setattr(c.algo, "router_shift_floor", 0.0), r"algo.router_shift_floor=0.0 must lie in \(0, 1\]"),
        (
            lambda c: setattr(c.rollout, "is_correction", "is"),
            r"rollout.is_correction='is' is not valid; valid: \['icepop', 'mis', 'none', 'tis'\]",
        ),
        (
            lambda c: (setattr(c.algo, "name", "gspo"), setattr(c.rollout, "is_correction", "tis")),
            r"a token-level rollout.is_correction needs is_level=sequence",
        ),
        (lambda c: setattr(c.rollout, "is_low", 1.5), r"need rollout.is_cap > 0 and is_low <= 1 <= is_high"),
        (lambda c: setattr(c.model, "family", "llama"), r"model.family='llama' is not valid"),
        (lambda c: setattr(c.task, "name", "chess"), r"task.name='chess' is not valid"),
        (
            lambda c: (setattr(c.algo, "eps_low", 0.3), setattr(c.algo, "eps_high", 0.1)),
            r"eps_high=0.1 < algo.eps_low=0.3",
        ),
        (lambda c: setattr(c.rollout, "group_size", 1), r"rollout.group_size=1 must be >= 2"),
        (lambda c: setattr(c.optim, "updates_per_rollout", 3), r"updates_per_rollout=3 must divide the rollout batch"),
        (lambda c: setattr(c.optim, "lr", -1e-4), r"optim.lr=-0.0001 must be > 0"),
        (
            lambda c: (setattr(c.algo, "name", "gspo"), setattr(c.algo, "eps_low", 0.2)),
            r"eps_high=0.0004 < algo.eps_low=0.2",
        ),
        (lambda c: setattr(c, "eval_every", 0), r"eval_every=0 must be >= 1"),
        (lambda c: setattr(c, "position_bucket", 0), r"position_bucket=0 must be >= 1"),
        (lambda c: setattr(c.metrics, "route_every", 0), r"metrics.route_every=0 must be an integer >= 1"),
        (lambda c: setattr(c.metrics, "route_every", 2.5), r"metrics.route_every=2.5 must be an integer >= 1"),
        (lambda c: setattr(c.metrics, "route_every", True), r"metrics.route_every=True must be an integer >= 1"),
        (lambda c: setattr(c.metrics, "split_rows", 0), r"metrics.split_rows=0 must be an integer >= 1 .* or null"),
        (lambda c: setattr(c.metrics, "split_rows", 0.5), r"metrics.split_rows=0.5 must be an integer >= 1"),
    ],
)
def test_invalid_configs_are_rejected_naming_the_key(change, match: str) -> None:
    cfg = TrainConfig()
    change(cfg)
    with pytest.raises(ValueError, match=match):
        validate(cfg)


def test_compare_routes_is_used_on_masked_positions_only() -> None:
    a = Routes.from_topk(torch.tensor([[[[0, 1]], [[2, 3]]]]), torch.tensor([[True, False]]), [0], 8)
    b = Routes.from_topk(torch.tensor([[[[0, 1]], [[4, 5]]]]), None, [0], 8)
    assert compare_routes(a, b)["flip_rate"] == 0.0


def test_train_function_writes_run_directory(tmp_path, cache, monkeypatch) -> None:
    import moe_rl.train as loop

    calls = {"validate": 0, "refuse_foreign_dir": 0}
    for name in calls:
        original = getattr(loop, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(loop, name, counted)
    cfg = loop_config(tmp_path, cache, steps=2, name="plain")
    result = train(cfg)
    assert calls == {"validate": 1, "refuse_foreign_dir": 1}  # once per launch
    assert result["status"] in ("completed", "collapsed")
    run = tmp_path / "plain"
    meta = json.loads((run / "meta.json").read_text())
    assert meta["seed"] == 0 and meta["run_keys"]["arm"] == "grpo+none" and "torch" in meta["versions"]
    assert "algo:" in (run / "config.yaml").read_text()


def test_router_shift_and_engine_correction_on_policy(tmp_path, cache) -> None:
    # At theta == theta_old the router has not moved (gamma = 1 on every token), so RSPO's factor is 1
    # and the first update's loss is plain GRPO's, bitwise. The fp32 sampler's log-probs equal the old
    # pass's up to rounding (|delta| < 1e-4 here), so the tis weight is 1 within that and truncates nothing.
    def first_update(name: str, change) -> tuple[Trainer, dict[str, float]]:
        cfg = loop_config(tmp_path, cache, name=name)
        change(cfg)
        trainer = Trainer(cfg)
        rollout, rewards, _ = trainer.rollout(step=1)
        old = trainer.old_pass(rollout)
        from moe_rl.algos import group_advantages
        from moe_rl.algos.corrections import engine_weight

        adv = group_advantages(rewards, group_size=cfg.rollout.group_size)
        correction = None
        if cfg.rollout.is_correction != "none":
            correction = engine_weight(
                old_logp=old.logp, rollout_logp=rollout.rollout_logp, mask=rollout.response_mask, correction="tis"
            )
            assert (correction.weight[rollout.response_mask.bool()] - 1).abs().max() < 1e-4
        rows = torch.arange(len(rollout))[:16]
        return trainer, trainer.update(Batch(rollout, adv, old, None, correction), rows)

    _, plain = first_update("plain", lambda c: None)
    _, rspo = first_update("rspo", lambda c: setattr(c.algo, "router_shift", True))
    assert rspo["loss"] == plain["loss"] and rspo["optim/grad_norm"] == plain["optim/grad_norm"]
    assert (
        rspo["ratio/router_shift_scale"] == pytest.approx(1.0, abs=1e-6) and rspo["ratio/router_shift_floor_frac"] == 0
    )
    assert "ratio/router_shift_scale" not in plain
    trainer, tis = first_update("tis", lambda c: setattr(c.rollout, "is_correction", "tis"))
    assert tis["loss"] == pytest.approx(plain["loss"], rel=1e-4, abs=1e-6)
    metrics = trainer.step(2)  # the step logs the correction's effect
    assert metrics["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["rollout/is_truncated_frac"] == 0.0 and metrics["rollout/is_masked_frac"] == 0.0
    assert all(defines(k) for k in metrics)


def _first_update(trainer: Trainer, replay: str, plant=None):
    """The old pass and update 1 (theta == theta_old) of step 1 on rows 0..15, with the ratio split."""
    from moe_rl.algos import group_advantages

    rollout, rewards, _ = trainer.rollout(step=1)
    old = trainer.old_pass(rollout)
    adv = group_advantages(rewards, group_size=trainer.cfg.rollout.group_size)
    replay_routes = replay_mode(replay).pick(old=old.routes, rollout=rollout.routes)
    if plant is not None:
        replay_routes = plant(replay_routes, rollout)
    rows = torch.arange(len(rollout))[:16]
    trainer.policy.train()
    metrics = trainer.update(Batch(rollout, adv, old, replay_routes), rows, split=True)
    return metrics, rollout, rows, old.logp, old.routes, replay_routes


def test_ratio_split_routing_part_is_exactly_0_on_update_1_under_r2(tmp_path, cache) -> None:
    # theta == theta_old: the router's own routes are the old pass's, which R2 replays, so the native and
    # the replayed pass route alike and the routing part is exactly 0
    metrics, rollout, rows, old_logp, *_ = _first_update(Trainer(loop_config(tmp_path, cache, replay="r2")), "r2")
    assert metrics["ratio/split/routing_var"] == 0.0
    assert metrics["ratio/split/cov"] == 0.0
    # The weights part is 0 up to float32 rounding: the update's forward (grad mode) and the no-grad old pass
    # may take other kernel paths (they do under ATEN_CPU_CAPABILITY=avx2), so |log r| <= ~2^-20 max |logp|
    # per token. The share is then undefined (Var log r = 0) or 0, and its weight n Var log r is at most
    # n (2^-20 max |logp|)^2: update 1 weighs (almost) nothing in the step's mean.
    share, weight = metrics["ratio/split/routing_share"], metrics["ratio/split/routing_share@weight"]
    mask = rollout.response_mask[rows].bool()
    n, top = int(mask.sum()), old_logp[rows][mask].abs().max().item()
    assert (math.isnan(share) or share == 0.0) and 0.0 <= weight <= n * (2**-20 * top) ** 2


def test_ratio_split_planted_route_changes_are_the_only_routing_part(tmp_path, cache) -> None:
    """Replay other experts at chosen tokens in the last MoE layer (its output reaches only its own position's
    logits): on update 1 the routing part is non-zero at exactly those tokens, and the logged split matches."""
    from moe_rl.metrics.ratio_stats import ratio_split_tokens
    from moe_rl.routing import RouteReplay

    chosen = [(0, 0), (3, 2), (9, 1)]  # (row, completion token)

    def plant(routes: Routes, rollout) -> Routes:
        indices = routes.indices.clone()
        for row, j in chosen:
            t = rollout.prompt_len - 1 + j  # the input position that predicts completion token j
            assert rollout.response_mask[row, t]
            taken = set(indices[row, t, -1].tolist())
            other = [e for e in range(routes.num_experts) if e not in taken][: routes.top_k]
            indices[row, t, -1] = torch.tensor(other, dtype=indices.dtype)
        return Routes(indices=indices, mask=routes.mask, layer_map=routes.layer_map, num_experts=routes.num_experts)

    trainer = Trainer(loop_config(tmp_path, cache, replay="r2"))
    metrics, rollout, rows, old_logp, old_routes, planted = _first_update(trainer, "r2", plant)
    # the update has moved its weights: the per-token parts at the weights it saw come from a fresh trainer
    fresh = Trainer(loop_config(tmp_path, cache, replay="r2", name="fresh"))
    fresh.policy.train()
    mask = rollout.response_mask[rows]
    native_logp, _ = fresh.other_routing_logp(rollout, rows, planted[rows], old_routes[rows])
    with torch.no_grad(), RouteReplay(fresh.policy, planted[rows]):
        replayed_logp, _ = forward_logp(fresh.policy, rollout, rows)
    rho, w = ratio_split_tokens(
        native_logp=native_logp, replayed_logp=replayed_logp, old_logp=old_logp[rows], mask=mask
    )
    expected = torch.zeros_like(mask)
    for row, j in chosen:
        expected[row, rollout.prompt_len - 1 + j] = True
    assert torch.equal(rho != 0, expected)
    # native == old routes at theta_old, so log r = rho + w = 0 and w = -rho: Var w = Var rho = -Cov > 0, up to
    # float32 rounding of the log-probs (the update's grad-mode forward may take other kernels than the no-grad
    # passes: |log r| <= ~2^-20 max |logp| per token), which moves Var w and Cov by at most ~2 |log r| / |rho|
    # relative, below 1e-5 for route changes of 0.01 nats or more
    assert metrics["ratio/split/routing_var"] > 0 and rho[expected].abs().min() > 0.01
    assert metrics["ratio/split/weights_var"] == pytest.approx(metrics["ratio/split/routing_var"], rel=1e-5)
    assert metrics["ratio/split/cov"] == pytest.approx(-metrics["ratio/split/routing_var"], rel=1e-5)


def test_ratio_split_parts_add_up_to_the_logged_log_ratio(tmp_path, cache) -> None:
    """replay=none, update 2 (off-policy): rho + w equals the loss's log-ratio logp - old_logp per token, to
    float64 rounding (3 roundings of values below max |logp|); under R2 the logged log-ratio is w itself."""
    from moe_rl.metrics.ratio_stats import ratio_split_tokens
    from moe_rl.routing import RouteReplay

    for replay in ("none", "r2"):
        trainer = Trainer(loop_config(tmp_path, cache, replay=replay, name=f"sum_{replay}", lr=3e-2))
        metrics, rollout, rows, old_logp, old_routes, replay_routes = _first_update(trainer, replay)
        rows = torch.arange(len(rollout))[16:]
        mask = rollout.response_mask[rows]
        with torch.no_grad():  # the logged pass of update 2, before its optimizer step
            with RouteReplay(trainer.policy, replay_routes[rows]) if replay == "r2" else contextlib.nullcontext():
                logp, _ = forward_logp(trainer.policy, rollout, rows)
        other, _ = trainer.other_routing_logp(
            rollout, rows, None if replay == "none" else replay_routes[rows], old_routes[rows]
        )
        native, replayed = (logp, other) if replay == "none" else (other, logp)
        rho, w = ratio_split_tokens(native_logp=native, replayed_logp=replayed, old_logp=old_logp[rows], mask=mask)
        delta = (logp.double() - old_logp[rows].double())[mask]
        bound = (
            3
            * 2.0**-53
            * 2
            * max(
                logp[mask].abs().max().item(), old_logp[rows][mask].abs().max().item(), other[mask].abs().max().item()
            )
        )
        logged = delta if replay == "none" else (native.double() - old_logp[rows].double())[mask]
        assert (rho[mask] + w[mask] - logged).abs().max().item() <= bound, replay
        assert rho[mask].abs().max() > 0  # lr 3e-2: the router moved, so the check is not 0 == 0
        if replay == "r2":
            assert torch.equal(w[mask], delta)  # the loss's ratio under R2 is the weights part alone


def test_the_split_pass_changes_nothing_the_update_computes(tmp_path, cache) -> None:
    """split=True adds one no-grad forward: the loss, the gradient and the weights after it are bitwise those
    of split=False."""
    out = {}
    for split in (False, True):
        trainer = Trainer(loop_config(tmp_path, cache, replay="r2", name=f"split_{split}", lr=3e-2))
        rollout, rewards, _ = trainer.rollout(step=1)
        old = trainer.old_pass(rollout)
        adv = torch.randn(len(rollout), generator=torch.Generator().manual_seed(0))
        trainer.policy.train()
        for rows in torch.arange(len(rollout)).chunk(2):
            metrics = trainer.update(Batch(rollout, adv, old, old.routes), rows, split=split)
        out[split] = metrics, {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    (plain, before), (with_split, after) = out[False], out[True]
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert {k: v for k, v in with_split.items() if k in plain} == plain
    assert set(with_split) - set(plain) >= {"ratio/split/routing_var", "ratio/split/weights_var", "ratio/split/cov"}


def test_a_low_precision_rollout_logs_the_engine_part_and_the_mismatch_metrics(tmp_path, cache) -> None:
    """bfloat16 rollouts: the rollout policy is not the trained one, so the engine part is logged; the
    mismatch metrics are those of `rollout_gap_stats` on the logged step (here checked for consistency:
    mean e^2 >= Var e, and mean |e| > 0)."""
    cfg = loop_config(tmp_path, cache, steps=1, name="bf16")
    cfg.rollout.dtype = "bfloat16"
    Trainer(cfg).run()
    frame = pd.read_parquet(tmp_path / "bf16" / "metrics.parquet")
    m = frame[frame["step"] == 1].set_index("key")["value"]
    assert m["rollout/logp_abs_diff"] == m["rollout/logp_gap"] > 0
    assert m["rollout/logp_sq_diff"] >= m["ratio/split/engine_var"] > 0
    assert m["rollout/k3_kl"] > 0 and 0 <= m["rollout/logp_gap_over_ln5"] <= m["rollout/logp_gap_over_ln2"] <= 1


@pytest.mark.parametrize("recovers", [True, False])
def test_loop_labels_a_recovered_dip_completed_and_a_lasting_drop_collapsed(tmp_path, cache, recovers) -> None:
    # the loop's metrics planted: reward 0.8 (steps 1..20), 0.2 (21..35), then back to 0.8 or staying at 0.2;
    # accuracy 0.5 at every evaluation. Relative: the rolling reward falls below 0.5 * start 0.8 at step 27
    # ((0.8 * 3 + 0.2 * 7) / 10 = 0.38); the loop's label is the one the analysis recomputes at the end.
    from moe_rl.analysis.collapse_definitions import collapse_definitions_markdown, collapse_events, definition_grid
    from moe_rl.analysis.load import load_results

    cfg = loop_config(tmp_path, cache, steps=60, name="recovers" if recovers else "stays")
    cfg.eval_every = 20
    trainer = Trainer(cfg)

    def reward(step: int) -> float:
        return 0.2 if 21 <= step <= 35 or (step > 35 and not recovers) else 0.8

    trainer.step = lambda step: {
        "loss": 0.5,
        "optim/grad_norm": 1.0,
        "reward/mean": reward(step),
        "policy/entropy": 0.8,
    }
    trainer.evaluate = lambda: {"task/accuracy": 0.5}
    result = trainer.run()
    status = json.loads((trainer.writer.dir / "status.json").read_text())
    if recovers:
        assert result["status"] == status["status"] == "completed"
        assert status["collapse_events"] == []
        (dip,) = status["recovered_events"]
        assert (dip["step"], dip["trigger"]) == (27, "reward_below_start")
        assert "recovered: final rolling reward 0.8 >= 0.5 * start 0.8" in dip["detail"]
    else:
        assert result["status"] == status["status"] == "collapsed"
        assert [(e["step"], e["trigger"]) for e in status["collapse_events"]] == [(27, "reward_below_start")]
        assert "recovered_events" not in status
    # the analysis recomputes the same label from metrics.parquet, under the main definition and the grid
    frame = load_results(trainer.writer.dir)
    events = collapse_events(frame)
    assert events.set_index("definition").loc["relative", "collapsed"] == (not recovers)
    grid = collapse_events(frame, definition_grid())
    assert not grid["collapsed"].any() if recovers else grid["collapsed"].all()
    text = collapse_definitions_markdown({"loop": frame})
    assert ("recovered dip reward_below_start@27 (not a collapse)" in text) == recovers


def _route_instrument(key: str) -> bool:
    """A key the route instruments log (`metrics.route_every`); the engine part of the split is the step's own."""
    return key.startswith(("route/", "ratio/split/", "clip/flipped_share")) and not key.startswith(
        "ratio/split/engine_var"
    )


def test_route_instruments_run_every_kth_step_and_move_no_other_number(tmp_path, cache) -> None:
    """`metrics.route_every=2`, `metrics.split_rows=3`: the route instruments and the ratio split on steps 2 and
    4 only, the split on 3 of each update's 16 rows; every other value bitwise that of the run with every
    instrument on every step and row, so skipping them, subsampling and its generator change nothing the
    training computes. A rerun draws the same subsample (the run's seed and the step fix it)."""
    values, status = {}, {}
    for name, every, rows, steps in (("all", 1, None, 4), ("lean", 2, 3, 4), ("again", 2, 3, 2)):
        cfg = loop_config(tmp_path, cache, replay="r2", steps=steps, name=name)
        cfg.metrics.route_every, cfg.metrics.split_rows = every, rows
        status[name] = train(cfg)["status"]
        values[name] = run_values(tmp_path / name)
    assert status["all"] == status["lean"]  # the collapse checks read outcome metrics only
    full, lean = values["all"], values["lean"]
    for step in range(1, 5):
        here = set(lean.loc[lean["step"] == step, "key"])
        routes = {k for k in here if _route_instrument(k)}
        assert bool(routes) == (step % 2 == 0), step
        every_step = {k for k in full.loc[full["step"] == step, "key"] if _route_instrument(k)}
        assert routes <= every_step and (step % 2 or {k for k in every_step if k.startswith("route/")} <= routes)
        assert ("ratio/split/routing_var" in here) == (step % 2 == 0)
    merged = full.merge(lean, on=["step", "key"], how="inner", suffixes=("_all", "_lean"))
    assert set(merged["key"]) >= {"loss", "reward/mean", "optim/grad_norm", "policy/entropy", "ratio/token_var"}
    split = merged["key"].str.startswith(("ratio/split/", "clip/flipped_share"))
    same = (merged["value_all"] == merged["value_lean"]) | (merged["value_all"].isna() & merged["value_lean"].isna())
    assert same[~split].all(), merged[~split & ~same]
    assert not same[merged["key"] == "ratio/split/weights_var"].all()  # 3 of 16 rows: another estimate
    assert set(full["key"]) - set(lean["key"]) == set()  # every key still logged, on its own steps
    again = values["again"]
    first_two = lean[lean["step"] <= 2].reset_index(drop=True)
    pd.testing.assert_frame_equal(again.reset_index(drop=True), first_two)


def test_split_subsample_is_a_seeded_stream_of_its_own() -> None:
    """The split's rows: deterministic given the run's seed and the step, distinct seeds and steps draw other
    rows, the global RNG is untouched, and any world size scores the same rows of the global mini-batch."""
    from moe_rl.loop.step_metrics import local_positions, split_seed, split_subsample

    def draws(seed: int, step: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(split_seed(seed, step))
        picks = [split_subsample(16, 5, generator) for _ in range(4)]
        assert all(p is not None for p in picks)
        return [p for p in picks if p is not None]

    state = torch.get_rng_state()
    picks = draws(0, 3)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(picks, draws(0, 3)))
    assert all(len(p) == 5 and bool((p.diff() > 0).all()) and 0 <= p.min() and p.max() < 16 for p in picks)
    assert len({tuple(p.tolist()) for p in picks}) > 1  # each update of a step its own rows
    assert picks[0].tolist() != draws(1, 3)[0].tolist() and picks[0].tolist() != draws(0, 4)[0].tolist()
    generator = torch.Generator().manual_seed(0)
    assert split_subsample(16, None, generator) is None and split_subsample(16, 16, generator) is None
    assert torch.equal(generator.get_state(), torch.Generator().manual_seed(0).get_state())  # nothing drawn
    minibatch = torch.randperm(32, generator=torch.Generator().manual_seed(1))[:16]  # global row ids
    for world in (1, 2, 4):
        count = 32 // world
        scored = []
        for rank in range(world):
            first = rank * count
            mine = minibatch[(minibatch >= first) & (minibatch < first + count)]  # local_rows' order
            scored += mine[local_positions(minibatch, picks[0], first, count)].tolist()
        assert sorted(scored) == sorted(minibatch[picks[0]].tolist()), world


def test_lean_defaults_and_the_shipped_runs_identity() -> None:
    """The defaults run the route instruments every 10th step, the split on 24 rows; every instrument on every step and
    row (what the shipped runs logged, and the experiment files pin) keeps the shipped runs' identity."""
    from moe_rl.config import config_hash, identity_spec

    cfg = TrainConfig()
    assert (cfg.metrics.route_every, cfg.metrics.split_rows) == (10, 24)
    shipped = TrainConfig()
    shipped.metrics.route_every, shipped.metrics.split_rows = 1, None
    recorded = {k: v for k, v in shipped.to_dict().items() if k != "metrics"}  # a config.yaml from before
    assert identity_spec(shipped.to_dict()) == identity_spec(recorded)
    assert config_hash(cfg) != config_hash(shipped)
    # a shipped run's recorded config reruns with every instrument on every step and row (moe_rl.reproduce)
    from helpers import ROOT

    from moe_rl.reproduce import recorded_config

    rerun = recorded_config(ROOT / "results" / "compare" / "runs" / "algo=grpo,replay=none,seed=0" / "config.yaml")
    assert (rerun.metrics.route_every, rerun.metrics.split_rows) == (1, None)
