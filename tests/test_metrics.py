"""Ratio statistics against hand values and a slow loop; collapse detection on hand-built histories."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.metrics import RATIO_KEYS, CollapseEvent, detect_collapse, ratio_stats

LN = math.log


# ---------------------------------------------------------------- ratio_stats


def test_ratio_stats_by_hand():
    # old_logp = 0 so delta = logp. Valid deltas: seq 0 [ln 4, ln 1/4], seq 1 [ln 4, 0]; (1, 2) masked.
    # r = [4, 1/4, 4, 1]: sum 9.25, sum r^2 = 16 + 1/16 + 16 + 1 = 33.0625, N = 4
    # token_var = 33.0625/4 - (9.25/4)^2;  seq ratios exp(mean delta) = [exp(0), exp(ln4 / 2)] = [1, 2], var 0.25
    # ess = 9.25^2 / (4 * 33.0625);  |delta| > ln 2 for 3 of 4 tokens
    # k3 terms exp(-d) - 1 + d: [1/4 - 1 + ln4, 4 - 1 - ln4, 1/4 - 1 + ln4, 0] -> sum 1.5 + ln4
    logp = torch.tensor([[LN(4), LN(0.25), 0.0], [LN(4), 0.0, 50.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, False]])
    stats = ratio_stats(logp=logp, old_logp=torch.zeros(2, 3), mask=mask)
    assert set(stats) == set(RATIO_KEYS)
    assert all(isinstance(v, float) for v in stats.values())
    expected = {
        "ratio/token_var": 33.0625 / 4 - (9.25 / 4) ** 2,
        "ratio/token_max": 4.0,
        "ratio/seq_var": 0.25,
        "ratio/ess": 9.25**2 / (4 * 33.0625),
        "ratio/extreme_frac": 0.75,
        "kl/k3": (1.5 + LN(4)) / 4,
    }
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key


def _slow_ratio_stats(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    deltas, seq_ratios = [], []
    for i in range(logp.shape[0]):
        row = [float(logp[i, t]) - float(old_logp[i, t]) for t in range(logp.shape[1]) if mask[i, t]]
        deltas += row
        if row:
            seq_ratios.append(math.exp(sum(row) / len(row)))
    r = [math.exp(d) for d in deltas]
    n = len(r)
    mean_r = sum(r) / n
    mean_s = sum(seq_ratios) / len(seq_ratios)
    return {
        "ratio/token_var": sum((x - mean_r) ** 2 for x in r) / n,
        "ratio/token_max": max(r),
        "ratio/seq_var": sum((s - mean_s) ** 2 for s in seq_ratios) / len(seq_ratios),
        "ratio/ess": sum(r) ** 2 / (n * sum(x * x for x in r)),
        "ratio/extreme_frac": sum(abs(d) > math.log(2) for d in deltas) / n,
        "kl/k3": sum(math.exp(-d) - 1 + d for d in deltas) / n,
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ratio_stats_matches_slow_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    old_logp = -torch.rand(B, T, generator=g) * 4
    logp = old_logp + torch.randn(B, T, generator=g) * 0.6
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = 0, T  # one empty and one full row
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp[~mask] = float("nan")  # garbage at masked positions must not leak
    fast = ratio_stats(logp=logp, old_logp=old_logp, mask=mask)
    slow = _slow_ratio_stats(logp, old_logp, mask)
    for key in RATIO_KEYS:
        assert fast[key] == pytest.approx(slow[key], rel=1e-9, abs=1e-12), key
    assert 0 < fast["ratio/extreme_frac"] < 1


def test_ratio_stats_edge_cases():
    z = torch.zeros(2, 3)
    empty = ratio_stats(logp=z, old_logp=z, mask=torch.zeros(2, 3, dtype=torch.bool))
    assert set(empty) == set(RATIO_KEYS) and all(math.isnan(v) for v in empty.values())
    on_policy = ratio_stats(logp=z, old_logp=z, mask=torch.ones(2, 3, dtype=torch.bool))
    assert on_policy == {
        "ratio/token_var": 0.0,
        "ratio/token_max": 1.0,
        "ratio/seq_var": 0.0,
        "ratio/ess": 1.0,
        "ratio/extreme_frac": 0.0,
        "kl/k3": 0.0,
    }
    with pytest.raises(ValueError, match=r"mask shape \(2, 2\) != logp shape \(2, 3\)"):
        ratio_stats(logp=z, old_logp=z, mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"logp must be \(B, T\)"):
        ratio_stats(logp=torch.zeros(3), old_logp=torch.zeros(3), mask=torch.ones(3, dtype=torch.bool))


# ---------------------------------------------------------------- detect_collapse


def _series(values) -> list[tuple[int, float]]:
    return list(enumerate(values))


def _healthy(n: int = 60) -> dict[str, list[tuple[int, float]]]:
    # reward climbs 0.1 -> 0.9 by step 40 then stays flat; entropy decays and sits at 0.01 from step 48,
    # but the rolling reward is never below its value 10 records earlier (rising, then exactly flat)
    return {
        "loss": _series([0.5] * n),
        "optim/grad_norm": _series([1.0] * n),
        "reward/mean": _series([min(0.9, 0.1 + 0.02 * s) for s in range(n)]),
        "policy/entropy": _series([max(0.01, 1.0 - 0.02 * s) for s in range(n)]),
    }


def test_healthy_history_has_no_events():
    assert detect_collapse(_healthy()) == []
    assert detect_collapse({}) == []


def test_nonfinite_fires_at_first_bad_step_of_either_key():
    h = _healthy()
    h["loss"][17] = (17, float("nan"))
    h["optim/grad_norm"][12] = (12, float("inf"))
    h["optim/grad_norm"][30] = (30, float("nan"))
    assert detect_collapse(h) == [CollapseEvent(12, "nonfinite", "optim/grad_norm=inf")]


def test_reward_drop_fires_at_expected_step():
    # reward 1 for steps 0..29, then 0. Window 10: rolling mean at step s >= 30 is (39 - s) / 10,
    # best so far 1.0 > floor 0.2, threshold 0.5 * 1.0: (39 - s)/10 < 0.5 first at s = 35 (0.4; s = 34 gives 0.5)
    h = _healthy(50)
    h["reward/mean"] = _series([1.0] * 30 + [0.0] * 20)
    h["policy/entropy"] = _series([0.5] * 50)
    (event,) = detect_collapse(h)
    assert (event.step, event.trigger) == (35, "reward_drop")
    assert "0.4 < 0.5 * best 1" in event.detail
    # a stricter fraction fires earlier: (39 - s)/10 < 0.9 first at s = 31
    assert detect_collapse(h, reward_drop_frac=0.9)[0].step == 31


def test_reward_drop_needs_best_above_floor():
    # the same relative drop from a best of 0.15 (below the 0.2 floor) is not a collapse
    h = {"reward/mean": _series([0.15] * 30 + [0.0] * 20)}
    assert detect_collapse(h) == []
    assert detect_collapse(h, reward_floor=0.1)[0].step == 35


def test_entropy_collapse_fires_when_entropy_low_and_reward_falling():
    # reward 1.0 for steps 0..19, 0.6 after (rolling never below 0.5 * best, so no reward_drop);
    # entropy 0.5 until step 24, 0.01 from step 25. At step 25 rolling reward = (4 * 1 + 6 * 0.6)/10 = 0.76,
    # 10 records earlier (step 15) it was 1.0 -> falling -> fires at 25.
    h = _healthy(40)
    h["reward/mean"] = _series([1.0] * 20 + [0.6] * 20)
    h["policy/entropy"] = _series([0.5] * 25 + [0.01] * 15)
    (event,) = detect_collapse(h)
    assert (event.step, event.trigger) == (25, "entropy_collapse")
    # low entropy alone, with flat reward, is not a collapse
    h["reward/mean"] = _series([1.0] * 40)
    assert detect_collapse(h) == []


def test_entropy_collapse_aligns_steps_across_cadences():
    # reward logged every 2 steps (records k = 0..29 at steps 2k): 1.0 for k < 10, 0.6 from k = 10 (step 20).
    # entropy logged every step, below the floor from step 25. Entropy at step s uses the latest reward
    # record at or before s (index j = s // 2); it needs rolling means at j and j - 10, both defined only
    # when j - 10 >= 9 (window 10), i.e. j >= 19, step 38. There rolling(19) = 0.6 < rolling(9) = 1.0.
    h = {
        "reward/mean": [(2 * k, 1.0 if k < 10 else 0.6) for k in range(30)],
        "policy/entropy": _series([0.5] * 25 + [0.01] * 35),
    }
    (event,) = detect_collapse(h)
    assert (event.step, event.trigger) == (38, "entropy_collapse")
    assert "rolling reward 0.6 < 1" in event.detail


def test_events_one_per_trigger_sorted_by_step():
    # reward_drop at 35 (as above), loss NaN at 40 and 44, entropy below floor from 45 while reward falls
    h = _healthy(50)
    h["reward/mean"] = _series([1.0] * 30 + [0.0] * 20)
    h["policy/entropy"] = _series([0.5] * 45 + [0.01] * 5)
    h["loss"][40] = (40, float("nan"))
    h["loss"][44] = (44, float("nan"))
    events = detect_collapse(h)
    assert [(e.step, e.trigger) for e in events] == [(35, "reward_drop"), (40, "nonfinite"), (45, "entropy_collapse")]
    with pytest.raises(AttributeError):
        events[0].step = 0  # frozen


def test_detect_collapse_rejects_bad_windows():
    with pytest.raises(ValueError, match="windows must be >= 1"):
        detect_collapse({}, reward_window=0)


def _hist(reward, accuracy=(), entropy=None):
    h = {"reward/mean": [(i + 1, r) for i, r in enumerate(reward)]}
    if accuracy:
        h["task/accuracy"] = list(accuracy)
    if entropy is not None:
        h["policy/entropy"] = [(i + 1, entropy) for i in range(len(reward))]
    return h


def test_relative_reward_trigger_fires_below_floor_where_absolute_cannot():
    # a run that never passes the 0.2 floor: start level 0.12, falls to 0.04 from step 11 on
    reward = [0.12] * 10 + [0.04] * 10
    assert detect_collapse(_hist(reward), reward_window=5) == []  # absolute: best 0.12 < floor
    events = detect_collapse(_hist(reward), definition="relative", reward_window=5, baseline_window=10)
    # rolling mean of 5 at step 11+j: (0.12*(4-j) + 0.04*(1+j)) / 5 < 0.06 first when j = 3 (0.056)
    assert [(e.step, e.trigger) for e in events] == [(14, "reward_below_start")]
    assert "start 0.12" in events[0].detail


def test_relative_accuracy_trigger_needs_patience():
    acc = [(0, 0.4), (25, 0.18), (50, 0.25), (75, 0.19), (100, 0.1), (125, 0.3)]
    events = detect_collapse(_hist([0.3] * 20, acc), definition="relative")
    # 0.18 < 0.2 once (then back up); 0.19 and 0.1 two in a row -> fires at step 100
    assert [(e.step, e.trigger) for e in events] == [(100, "accuracy_below_start")]
    one = detect_collapse(_hist([0.3] * 20, acc), definition="relative", accuracy_patience=1)
    assert [(e.step, e.trigger) for e in one] == [(25, "accuracy_below_start")]
    assert detect_collapse(_hist([0.3] * 20, acc)) == []  # absolute ignores accuracy
    with pytest.raises(ValueError, match="definition"):
        detect_collapse({}, definition="nope")


def test_relative_keeps_nonfinite_and_entropy_triggers():
    h = _hist([0.3] * 12 + [0.2] * 12, entropy=0.01)
    h["loss"] = [(3, 0.1), (4, float("nan"))]
    triggers = {e.trigger for e in detect_collapse(h, definition="relative", entropy_window=5)}
    assert triggers == {"nonfinite", "entropy_collapse"}


def test_collapse_config_hash_unchanged_by_new_defaults():
    from moe_rl.config import NOT_IDENTITY, TrainConfig, config_hash, identity_spec

    cfg = TrainConfig()
    before = config_hash(cfg)
    spec = identity_spec({k: v for k, v in cfg.to_dict().items() if k not in NOT_IDENTITY})
    # the keys of the relative definition stay out of a run's identity at their defaults, so the
    # shipped run folders (hashed before they existed) keep theirs
    assert set(spec["collapse"]) == {
        "reward_window",
        "reward_drop_frac",
        "reward_floor",
        "entropy_floor",
        "entropy_window",
    }
    cfg.collapse.definition = "relative"
    assert config_hash(cfg) != before


def test_rollout_gap_stats_by_hand() -> None:
    from moe_rl.metrics import rollout_gap_stats

    # gaps on the 3 masked-in tokens: 0.1, 1.0 (> ln 2), 0.0; the masked-out token (gap 5) never counts
    rollout = torch.tensor([[-1.0, -2.0, -0.5, -9.0]])
    train = torch.tensor([[-1.1, -1.0, -0.5, -4.0]])
    mask = torch.tensor([[True, True, True, False]])
    out = rollout_gap_stats(rollout_logp=rollout, train_logp=train, mask=mask)
    assert out["rollout/logp_gap"] == pytest.approx(1.1 / 3, abs=1e-7)
    assert out["rollout/token_mult_prob_error"] == pytest.approx((math.exp(0.1) + math.e + 1.0) / 3, abs=1e-7)
    assert out["rollout/logp_gap_over_ln2"] == pytest.approx(1 / 3)
    empty = rollout_gap_stats(rollout_logp=rollout, train_logp=train, mask=torch.zeros_like(mask))
    assert empty == {"rollout/logp_gap": 0.0, "rollout/token_mult_prob_error": 1.0, "rollout/logp_gap_over_ln2": 0.0}
