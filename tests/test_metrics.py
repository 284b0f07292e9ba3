"""Ratio statistics against hand values and a slow loop; collapse detection on hand-built histories."""

from __future__ import annotations

import math
import random

import pytest
import torch
from helpers import planted_routes

from moe_rl.metrics.ratio_stats import RATIO_KEYS, CollapseEvent, detect_collapse, judge_collapse, ratio_stats

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
    (event,) = detect_collapse(h, definition="absolute")
    assert (event.step, event.trigger) == (35, "reward_drop")
    assert "0.4 < 0.5 * best 1" in event.detail
    # a stricter fraction fires earlier: (39 - s)/10 < 0.9 first at s = 31
    assert detect_collapse(h, definition="absolute", reward_drop_frac=0.9)[0].step == 31


def test_reward_drop_needs_best_above_floor():
    # the same relative drop from a best of 0.15 (below the 0.2 floor) is not a collapse
    h = {"reward/mean": _series([0.15] * 30 + [0.0] * 20)}
    assert detect_collapse(h, definition="absolute") == []
    assert detect_collapse(h, definition="absolute", reward_floor=0.1)[0].step == 35


def test_entropy_collapse_needs_a_material_fall_against_best_or_start():
    # relative definition: reward climbs 0.2 -> 1.0 (start = mean of the first 10 = 0.2) and falls to 0.4,
    # never below 0.5 * start = 0.1, so reward_below_start cannot fire; against its best 1.0 it has fallen
    # (0.4 < 0.5). Rolling reward at step s in 31..40 is (1.0 * (40 - s) + 0.4 * (s - 30)) / 10 < 0.5 first
    # at s = 39 (0.46; s = 38 gives 0.52). Entropy 0.01 from step 35 (window 1).
    h = _healthy(50)
    h["reward/mean"] = _series([0.2] * 10 + [1.0] * 21 + [0.4] * 19)
    h["policy/entropy"] = _series([0.5] * 35 + [0.01] * 15)
    (event,) = detect_collapse(h, definition="relative", entropy_window=1)
    assert (event.step, event.trigger) == (39, "entropy_collapse")
    assert "rolling reward 0.46 < 0.5 * best 1" in event.detail
    # the same fall at high entropy is no collapse under `relative` (its reward trigger reads the start)
    h["policy/entropy"] = _series([0.5] * 50)
    assert detect_collapse(h, definition="relative", entropy_window=1) == []
    # low entropy with a reward wobble (1.0 -> 0.9, not below 0.5 * best) is convergence
    h["reward/mean"] = _series([0.2] * 10 + [1.0] * 21 + [0.9] * 19)
    h["policy/entropy"] = _series([0.5] * 35 + [0.01] * 15)
    assert detect_collapse(h, definition="relative", entropy_window=1) == []


def test_entropy_collapse_averages_entropy_over_its_window():
    # entropy 0.01 from step 35 and reward collapsed (0.0) from step 20: with window 10 the mean of the last
    # 10 entropy records is (0.5 * (44 - s) + 0.01 * (s - 34)) / 10 < 0.05 first at s = 44 (0.059 at 43)
    h = _healthy(50)
    h["reward/mean"] = _series([1.0] * 20 + [0.0] * 30)
    h["policy/entropy"] = _series([0.5] * 35 + [0.01] * 15)
    event = next(e for e in detect_collapse(h, definition="absolute") if e.trigger == "entropy_collapse")
    assert event.step == 44
    assert detect_collapse(h, definition="absolute", entropy_window=1)[-1].step == 35


def test_entropy_collapse_reads_accuracy_with_patience():
    # flat reward, entropy 0.01 throughout; accuracy 0.4 at step 0, then 0.1, 0.1 (< 0.5 * 0.4) at 20, 30:
    # with patience 2 the entropy trigger fires at the first entropy record at or after step 30
    h = {
        "reward/mean": _series([0.5] * 40),
        "policy/entropy": _series([0.01] * 40),
        "task/accuracy": [(0, 0.4), (10, 0.4), (20, 0.1), (30, 0.1)],
    }
    (event,) = detect_collapse(h, definition="absolute", entropy_window=1)
    assert (event.step, event.trigger) == (30, "entropy_collapse")
    assert "accuracy 0.1 < 0.5 * step-0 accuracy 0.4" in event.detail
    assert detect_collapse(h, definition="absolute", entropy_window=1, accuracy_patience=1)[0].step == 20


def test_entropy_collapse_aligns_steps_across_cadences():
    # reward logged every 2 steps (records j = 0..29 at steps 2j): 1.0 for j < 10, 0.2 from j = 10. The
    # rolling mean at j in 10..19 is (1.0 * (19 - j) + 0.2 * (j - 9)) / 10 < 0.5 * best 1.0 first at j = 16
    # (0.44; j = 15 gives 0.52). Entropy, logged every step, is below the floor from step 33; entropy at
    # step s reads the latest reward record at or before s (j = s // 2 = 16 at s = 33).
    h = {
        "reward/mean": [(2 * j, 1.0 if j < 10 else 0.2) for j in range(30)],
        "policy/entropy": _series([0.5] * 33 + [0.01] * 27),
    }
    events = detect_collapse(h, definition="absolute", entropy_window=1)
    assert [(e.step, e.trigger) for e in events] == [(32, "reward_drop"), (33, "entropy_collapse")]
    assert "rolling reward 0.44 < 0.5 * best 1" in events[1].detail


def test_events_one_per_trigger_sorted_by_step():
    # reward_drop at 35 (as above), loss NaN at 40 and 44, entropy below floor from 45 while reward falls
    h = _healthy(50)
    h["reward/mean"] = _series([1.0] * 30 + [0.0] * 20)
    h["policy/entropy"] = _series([0.5] * 45 + [0.01] * 5)
    h["loss"][40] = (40, float("nan"))
    h["loss"][44] = (44, float("nan"))
    events = detect_collapse(h, definition="absolute", entropy_window=1)
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
    assert detect_collapse(_hist(reward), definition="absolute", reward_window=5) == []  # absolute: best 0.12 < floor
    events = detect_collapse(_hist(reward), definition="relative", reward_window=5, baseline_window=10)
    # rolling mean of 5 at step 11+j: (0.12*(4-j) + 0.04*(1+j)) / 5 < 0.06 first when j = 3 (0.056)
    assert [(e.step, e.trigger) for e in events] == [(14, "reward_below_start")]
    assert "start 0.12" in events[0].detail


def test_relative_accuracy_trigger_needs_patience():
    acc = [(0, 0.4), (25, 0.18), (50, 0.25), (75, 0.19), (100, 0.1), (125, 0.15), (150, 0.12)]
    events = detect_collapse(_hist([0.3] * 20, acc), definition="relative")
    # 0.18 < 0.2 once (then back up); 0.19 and 0.1 two in a row -> fires at step 100, and stays below
    assert [(e.step, e.trigger) for e in events] == [(100, "accuracy_below_start")]
    one = detect_collapse(_hist([0.3] * 20, acc), definition="relative", accuracy_patience=1)
    assert [(e.step, e.trigger) for e in one] == [(25, "accuracy_below_start")]
    # back to 0.3 at the last evaluation: the dip is recovered, not a collapse, and keeps its step
    back = acc[:5] + [(125, 0.3)]
    judged = judge_collapse(_hist([0.3] * 20, back), definition="relative")
    assert judged.collapsed == []
    assert [(e.step, e.trigger) for e in judged.recovered] == [(100, "accuracy_below_start")]
    assert "recovered: final accuracy 0.3" in judged.recovered[0].detail
    assert detect_collapse(_hist([0.3] * 20, acc), definition="absolute") == []  # absolute ignores accuracy
    with pytest.raises(ValueError, match="definition"):
        detect_collapse({}, definition="nope")


def test_relative_keeps_nonfinite_and_entropy_triggers():
    h = _hist([0.3] * 12 + [0.1] * 12, entropy=0.01)
    h["loss"] = [(3, 0.1), (4, float("nan"))]
    triggers = {e.trigger for e in detect_collapse(h, definition="relative", entropy_window=5)}
    assert triggers == {"nonfinite", "reward_below_start", "entropy_collapse"}


def test_collapse_config_hash_unchanged_by_new_defaults():
    from moe_rl.config import NOT_IDENTITY, TrainConfig, config_hash, identity_spec

    cfg = TrainConfig()
    cfg.collapse.definition = "absolute"  # what the shipped runs were labelled with
    before = config_hash(cfg)
    spec = identity_spec({k: v for k, v in cfg.to_dict().items() if k not in NOT_IDENTITY})
    # the keys of the relative definition stay out of a run's identity at the values the shipped run
    # folders had (hashed before they existed), so those keep theirs
    assert set(spec["collapse"]) == {
        "reward_window",
        "reward_drop_frac",
        "reward_floor",
        "entropy_floor",
        "entropy_window",
    }
    # the default label is the analysis' main definition, which changes a run's status: a new identity
    assert TrainConfig().collapse.definition == "relative"
    assert config_hash(TrainConfig()) != before


def test_loop_and_analysis_share_the_default_definition():
    import inspect

    from moe_rl.analysis.collapse_definitions import COLLAPSE_DEFINITIONS, MAIN_DEFINITION, definition_grid
    from moe_rl.config import CollapseConfig

    loop = vars(CollapseConfig())
    signature = {k: p.default for k, p in inspect.signature(judge_collapse).parameters.items() if k != "history"}
    assert loop == signature == COLLAPSE_DEFINITIONS[MAIN_DEFINITION]
    assert definition_grid()["relative:d0.5:p2"] == loop
    assert len(definition_grid()) == 3 * 2 * 5 * (
        4 + 1
    )  # entropy floors x windows x drop fractions x (patiences + absolute)


def _plant(reward: list[float], entropy: list[float], accuracy: list[tuple[int, float]]):
    return {
        "loss": _series([0.5] * len(reward)),
        "optim/grad_norm": _series([1.0] * len(reward)),
        "reward/mean": _series(reward),
        "policy/entropy": _series(entropy),
        "task/accuracy": accuracy,
    }


# reward rises 0.4 -> 0.8 over steps 0..19 (start level, mean of the first 10: 0.4 + 0.4 * 4.5 / 19 = 0.495)
_RISE = [0.4 + 0.4 * s / 19 for s in range(20)]


def test_converged_run_is_collapsed_under_no_definition_of_the_grid():
    from moe_rl.analysis.collapse_definitions import definition_grid

    # entropy 0.02 from step 20; reward plateaus at 0.8 with +-3% noise; accuracy 0.45 -> 0.75 (+30 points).
    # The lowest rolling reward of the plateau is 0.8 * (1 - 0.03) > 0.7 * 0.8 (the strictest fraction vs
    # the best) and > 0.7 * 0.495 (vs the start); accuracy never falls.
    rng = random.Random(0)
    reward = _RISE + [0.8 * (1 + rng.uniform(-0.03, 0.03)) for _ in range(100)]
    entropy = [0.5 - 0.024 * s for s in range(20)] + [0.02] * 100
    acc = [(0, 0.45), (25, 0.6), (50, 0.75), (75, 0.74), (100, 0.75)]
    h = _plant(reward, entropy, acc)
    # the wobble that the old rule (entropy low while the rolling reward is below its value 10 records
    # earlier) fired on is in the plant, on most plateau steps
    rolling = [math.fsum(reward[j - 9 : j + 1]) / 10 for j in range(9, len(reward))]
    assert sum(a < b for a, b in zip(rolling[30:], rolling[20:])) > 20
    for name, kwargs in definition_grid().items():
        assert detect_collapse(h, **kwargs) == [], name


def test_entropy_collapse_with_the_reward_halving_fires_under_every_definition():
    from moe_rl.analysis.collapse_definitions import definition_grid

    # entropy 0.01 from step 20; reward 0.8 until step 39, halves to 0.35 (steps 40..59), then 0.1
    # (steps 60..79); accuracy 0.45, 0.75, then 0.3, 0.05. Against the best 0.8: 0.35 < d * 0.8 for d >= 0.5
    # (within steps 40..59), 0.1 < 0.3 * 0.8 for every d (by step 69).
    reward = _RISE + [0.8] * 20 + [0.35] * 20 + [0.1] * 20
    entropy = [0.5] * 20 + [0.01] * 60
    acc = [(0, 0.45), (25, 0.75), (50, 0.3), (75, 0.05)]
    h = _plant(reward, entropy, acc)
    for name, kwargs in definition_grid().items():
        events = {e.trigger: e.step for e in detect_collapse(h, **kwargs)}
        assert "entropy_collapse" in events, name
        stage = 40 <= events["entropy_collapse"] < 60
        assert stage == (kwargs["reward_drop_frac"] >= 0.5), name
        assert events["entropy_collapse"] < 70, name


def test_reward_collapse_at_high_entropy_fires_under_every_definition():
    from moe_rl.analysis.collapse_definitions import definition_grid

    # entropy 0.8 throughout; reward 0.8 then 0.05 from step 40: below 0.3 * best 0.8 and 0.3 * start 0.495;
    # accuracy 0.45, 0.75, then 0.4 and 0.35: below its start, never below 0.7 * 0.45 = 0.315 (so the
    # accuracy trigger never fires and the reward trigger is the one every definition names)
    reward = _RISE + [0.8] * 20 + [0.05] * 40
    h = _plant(reward, [0.8] * 80, [(0, 0.45), (25, 0.75), (50, 0.4), (75, 0.35)])
    for name, kwargs in definition_grid().items():
        events = detect_collapse(h, **kwargs)
        trigger = "reward_drop" if kwargs["definition"] == "absolute" else "reward_below_start"
        assert [e.trigger for e in events] == [trigger], name


def test_a_run_that_ends_above_its_cold_start_is_collapsed_under_no_definition():
    from moe_rl.analysis.collapse_definitions import definition_grid

    # the reward collapse above (0.8 -> 0.05 from step 40, at entropy 0.8 and at entropy 0.01), but the
    # last evaluation, 0.46, is above the step-0 one, 0.45: every trigger that fired moves to `recovered`
    reward = _RISE + [0.8] * 20 + [0.05] * 40
    acc = [(0, 0.45), (25, 0.75), (50, 0.4), (75, 0.46)]
    for entropy in ([0.8] * 80, [0.5] * 20 + [0.01] * 60):
        h = _plant(reward, entropy, acc)
        for name, kwargs in definition_grid().items():
            judged = judge_collapse(h, **kwargs)
            assert judged.collapsed == [], name
            assert judged.recovered and all("ended above its cold start" in e.detail for e in judged.recovered)
        # one point lower at the end (0.44 < 0.45) and the same history is a collapse again
        lower = {**h, "task/accuracy": [*acc[:-1], (75, 0.44)]}
        assert detect_collapse(lower) and detect_collapse(lower, definition="absolute")
    # the test reads the last evaluation only: none after step 0 leaves the reward's own test to decide
    h = _plant(reward, [0.8] * 80, [(0, 0.45)])
    assert [e.trigger for e in detect_collapse(h, definition="absolute")] == ["reward_drop"]


def test_rollout_gap_stats_by_hand() -> None:
    from moe_rl.metrics.ratio_stats import rollout_gap_stats

    # e = train - rollout on the 4 masked-in tokens: -0.1, 1.0 (> ln 2), 0.0, -2.0 (> ln 5 = 1.609);
    # the masked-out token (gap 5) never counts
    rollout = torch.tensor([[-1.0, -2.0, -0.5, -1.0, -9.0]])
    train = torch.tensor([[-1.1, -1.0, -0.5, -3.0, -4.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    out = rollout_gap_stats(rollout_logp=rollout, train_logp=train, mask=mask)
    e = [-0.1, 1.0, 0.0, -2.0]
    # float32 inputs: -1.1 is not exact (error ~2.4e-8), which 1e-7 bounds through these means
    assert out["rollout/logp_gap"] == pytest.approx(3.1 / 4, abs=1e-7)
    assert out["rollout/logp_abs_diff"] == out["rollout/logp_gap"]
    assert out["rollout/token_mult_prob_error"] == pytest.approx(sum(math.exp(abs(x)) for x in e) / 4, abs=1e-6)
    assert out["rollout/logp_gap_over_ln2"] == 2 / 4
    assert out["rollout/logp_gap_over_ln5"] == 1 / 4
    assert out["rollout/k3_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in e) / 4, abs=1e-7)
    assert out["rollout/logp_sq_diff"] == pytest.approx((0.01 + 1 + 0 + 4) / 4, abs=1e-7)
    mean = sum(e) / 4
    assert out["ratio/split/engine_var"] == pytest.approx(sum((x - mean) ** 2 for x in e) / 4, abs=1e-7)
    empty = rollout_gap_stats(rollout_logp=rollout, train_logp=train, mask=torch.zeros_like(mask))
    assert empty["rollout/token_mult_prob_error"] == 1.0
    assert {k: v for k, v in empty.items() if k != "rollout/token_mult_prob_error"} == dict.fromkeys(
        set(empty) - {"rollout/token_mult_prob_error"}, 0.0
    )


def test_ratio_split_by_hand() -> None:
    from moe_rl.metrics.ratio_stats import ratio_split, ratio_split_parts, ratio_split_tokens, ratio_split_weights

    # 4 valid tokens (the 5th is masked out and holds a huge value that must not count):
    #   rho = native - replayed = (0, 0.5, 0, -0.5), w = replayed - old = (0.2, 0.2, -0.2, 0.2)
    # mean rho 0, Var rho = (0.25 + 0.25) / 4 = 0.125; mean w 0.1, Var w = (0.01 * 3 + 0.09) / 4 = 0.03;
    # Cov = mean(rho * (w - 0.1)) = (0.5 * 0.1 + (-0.5) * 0.1) / 4 = 0; log r = (0.2, 0.7, -0.2, -0.3),
    # Var log r = 0.125 + 0.03 = 0.155, routing share 0.125 / 0.155.
    # Route changed at tokens 2 and 4: |log r| mass (0.7 + 0.3) / 1.4. Clipped: tokens 1 and 2 -> 1 of 2 flipped.
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0]])
    replayed = torch.tensor([[-0.8, -0.8, -1.2, -0.8, 50.0]])
    native = torch.tensor([[-0.8, -0.3, -1.2, -1.3, -90.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    flipped = torch.tensor([[False, True, False, True, True]])
    clipped = torch.tensor([[True, True, False, False, True]])
    out = ratio_split(
        native_logp=native, replayed_logp=replayed, old_logp=old, mask=mask, flipped=flipped, clipped=clipped
    )
    # inputs are float32 (0.8, 0.3, ... are not exact): 1e-7 bounds their float32 rounding through these moments
    assert out["ratio/split/routing_var"] == pytest.approx(0.125, abs=1e-7)
    assert out["ratio/split/weights_var"] == pytest.approx(0.03, abs=1e-7)
    assert out["ratio/split/cov"] == pytest.approx(0.0, abs=1e-7)
    assert out["ratio/split/routing_share"] == pytest.approx(0.125 / 0.155, abs=1e-6)
    assert out["ratio/split/flipped_mass"] == pytest.approx(1.0 / 1.4, abs=1e-7)
    assert out["clip/flipped_share"] == 0.5
    # per changed route: |rho| on tokens 2 and 4 (0.5 each) over their 2 changed routes
    assert out["ratio/split/flip_logp"] == pytest.approx(0.5, abs=1e-7)
    rho, w = ratio_split_tokens(native_logp=native, replayed_logp=replayed, old_logp=old, mask=mask)
    assert rho[0, 4] == 0.0 and w[0, 4] == 0.0  # masked out
    # the shares' denominators, by which a step weights its updates: 4 * Var log r, sum |log r|, clipped tokens
    parts = ratio_split_parts(
        native_logp=native, replayed_logp=replayed, old_logp=old, mask=mask, flipped=flipped, clipped=clipped
    )
    weights = ratio_split_weights(parts)
    assert weights["ratio/split/routing_share"] == pytest.approx(4 * 0.155, abs=1e-6)
    assert weights["ratio/split/flipped_mass"] == pytest.approx(1.4, abs=1e-6)
    assert weights["clip/flipped_share"] == 2.0
    assert weights["ratio/split/flip_logp"] == 2.0  # the changed routes
    # nothing clipped, no spread: undefined shares are NaN, never 0
    flat = ratio_split(
        native_logp=old, replayed_logp=old, old_logp=old, mask=mask, flipped=flipped, clipped=torch.zeros_like(mask)
    )
    assert flat["ratio/split/routing_var"] == 0.0
    assert all(
        math.isnan(flat[k]) for k in ("ratio/split/routing_share", "ratio/split/flipped_mass", "clip/flipped_share")
    )


def test_ratio_split_per_layer_by_hand() -> None:
    from moe_rl.metrics.ratio_stats import ratio_split, ratio_split_parts, ratio_split_weights

    # the tokens of the test above (|log r| = 0.2, 0.7, 0.2, 0.3 on the valid ones; clipped: 1 and 2), with
    # 2 MoE layers: token 2 changed route in layer 0 only, token 4 in both, token 3 in neither; the masked
    # token 5 changed in layer 1 and must not count. Layer 0: (0.7 + 0.3) / 1.4, clipped 1 of 2 (token 2);
    # layer 1: 0.3 / 1.4, clipped 0 of 2. Any layer: what the (B, T) form gives.
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0]])
    replayed = torch.tensor([[-0.8, -0.8, -1.2, -0.8, 50.0]])
    native = torch.tensor([[-0.8, -0.3, -1.2, -1.3, -90.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    per_layer = torch.tensor([[[False, False], [True, False], [False, False], [True, True], [False, True]]])
    clipped = torch.tensor([[True, True, False, False, True]])
    args = dict(native_logp=native, replayed_logp=replayed, old_logp=old, mask=mask, clipped=clipped)
    out = ratio_split(**args, flipped=per_layer)
    assert out["ratio/split/flipped_mass/layer_0"] == pytest.approx(1.0 / 1.4, abs=1e-7)
    assert out["ratio/split/flipped_mass/layer_1"] == pytest.approx(0.3 / 1.4, abs=1e-7)
    assert (out["clip/flipped_share/layer_0"], out["clip/flipped_share/layer_1"]) == (0.5, 0.0)
    # per changed route: |rho| = 0.5 on tokens 2 and 4 over 3 changed routes (token 4 changed in both layers);
    # given only "changed in some layer", the routes are the 2 tokens
    assert out["ratio/split/flip_logp"] == pytest.approx(1.0 / 3, abs=1e-7)
    anywhere = ratio_split(**args, flipped=per_layer.any(dim=-1))
    assert anywhere["ratio/split/flip_logp"] == pytest.approx(0.5, abs=1e-7)
    same = {k: v for k, v in out.items() if "/layer_" not in k and k != "ratio/split/flip_logp"}
    assert same == {k: v for k, v in anywhere.items() if k != "ratio/split/flip_logp"}
    assert not any("/layer_" in k for k in anywhere)
    # a step weighs each layer's share by the denominator of the share it refines
    weights = ratio_split_weights(ratio_split_parts(**args, flipped=per_layer))
    assert weights["ratio/split/flipped_mass/layer_1"] == weights["ratio/split/flipped_mass"]
    assert weights["clip/flipped_share/layer_0"] == weights["clip/flipped_share"] == 2.0
    assert weights["ratio/split/flip_logp"] == 3.0
    with pytest.raises(ValueError, match="flipped shape"):
        ratio_split(**args, flipped=per_layer[:, :3])


def test_routing_confidence_by_hand() -> None:
    from moe_rl.routing.compare import confidence_finalize, confidence_parts

    # 1 row, 3 positions (the last masked out), 2 MoE layers, top-2 of 4 experts
    scores = torch.tensor(
        [
            [
                [[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]],
                [[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]],
                [[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]],
            ]
        ]
    )
    routes = planted_routes([[[[0, 1], [2, 3]], [[2, 3], [0, 3]], [[1, 2], [1, 2]]]], [[True, True, False]], 4)
    # selected mass per valid (t, l): 0.8, 0.5, 0.7, 0.8 -> mean 2.8 / 4 = 0.7
    assert confidence_finalize(confidence_parts(scores, routes)) == pytest.approx(0.7, abs=1e-7)  # float32 scores
    none = planted_routes([[[[0, 1], [2, 3]], [[2, 3], [0, 3]], [[1, 2], [1, 2]]]], [[False, False, False]], 4)
    assert math.isnan(confidence_finalize(confidence_parts(scores, none)))


def test_r3_fallback_frac_by_hand() -> None:
    from moe_rl.routing.compare import fallback_finalize, fallback_parts

    # 2 rows x 3 positions; real input tokens: 5 (row 1's first is a left pad); replayed routes missing at
    # row 0 position 1 and row 1 position 2 (prefix-cached -1 positions), and at the pad (not counted)
    replayed = planted_routes([[[[0, 1]]] * 3] * 2, [[True, False, True], [False, True, False]], 4)
    valid = torch.tensor([[True, True, True], [False, True, True]])
    assert fallback_finalize(fallback_parts(replayed, valid)) == 2 / 5
    assert math.isnan(fallback_finalize(fallback_parts(replayed, torch.zeros_like(valid))))


def test_recovered_dip_is_collapsed_under_no_definition_of_the_grid():
    from moe_rl.analysis.collapse_definitions import definition_grid

    # reward 0.8 (steps 20..39), dips to 0.32 = 40% of the best (40..59), recovers to 0.76 = 95% (60..99);
    # entropy 0.01 from step 20; accuracy 0.45, 0.75, dips to 0.3 = 40% of its best at two evaluations,
    # ends at 0.72. Every trigger the dip fires is judged at the end: recovered.
    reward = _RISE + [0.8] * 20 + [0.32] * 20 + [0.76] * 40
    entropy = [0.5] * 20 + [0.01] * 80
    acc = [(0, 0.45), (25, 0.75), (50, 0.3), (55, 0.3), (75, 0.72), (99, 0.72)]
    h = _plant(reward, entropy, acc)
    fired = 0
    for name, kwargs in definition_grid().items():
        judged = judge_collapse(h, **kwargs)
        assert judged.collapsed == [] and detect_collapse(h, **kwargs) == [], name
        fired += bool(judged.recovered)
        assert all(40 <= e.step < 60 and "recovered:" in e.detail for e in judged.recovered), name
    assert fired >= 60  # the dip fires at every fraction >= 0.5 (0.32 < 0.5 * 0.8): it is seen, not a collapse
    # the first firing, by hand: rolling reward at step 40 + j is (0.8 * (9 - j) + 0.32 * (1 + j)) / 10,
    # below 0.5 * 0.8 first at j = 8; the main definition's entropy trigger reads that test
    main = judge_collapse(h)
    assert [(e.step, e.trigger) for e in main.recovered] == [(48, "entropy_collapse")]
    assert "final rolling reward 0.76 >= 0.5 * best 0.8" in main.recovered[0].detail
    absolute = judge_collapse(h, definition="absolute", entropy_window=1)
    assert [(e.step, e.trigger) for e in absolute.recovered] == [(48, "reward_drop"), (48, "entropy_collapse")]


def test_drop_that_stays_is_a_collapse_wherever_its_fractions_are_crossed():
    from moe_rl.analysis.collapse_definitions import definition_grid

    # entropy 0.8 throughout; reward 0.8 (steps 20..39) then 0.1 from step 40 to the end (0.125 of the best,
    # 0.2 of the start 0.495); accuracy 0.45, 0.75, then 0.2 at every later evaluation (0.44 of step 0's)
    reward = _RISE + [0.8] * 20 + [0.1] * 40
    acc = [(0, 0.45), (25, 0.75), (50, 0.2), (60, 0.2), (70, 0.2), (79, 0.2)]
    h = _plant(reward, [0.8] * 80, acc)
    # rolling reward at step 40 + j: (0.8 * (9 - j) + 0.1 * (1 + j)) / 10 = (7.3 - 0.7 j) / 10, first below
    #   absolute, d * best 0.8 (0.24, 0.32, 0.4, 0.48, 0.56): j = 8, 6, 5, 4, 3;
    #   relative, d * start 0.495 (0.1485, 0.198, 0.2475, 0.297, 0.3465): j = 9, 8, 7, 7, 6;
    # accuracy 0.2 < d * 0.45 for d >= 0.5 only (0.225); with patience p it fires at the p-th low evaluation
    absolute = {0.3: 48, 0.4: 46, 0.5: 45, 0.6: 44, 0.7: 43}
    relative = {0.3: 49, 0.4: 48, 0.5: 47, 0.6: 47, 0.7: 46}
    low_evals = [50, 60, 70, 79]
    for name, kwargs in definition_grid().items():
        events = detect_collapse(h, **kwargs)
        d = kwargs["reward_drop_frac"]
        steps = {e.trigger: e.step for e in events}
        if kwargs["definition"] == "absolute":
            assert steps == {"reward_drop": absolute[d]}, name
        else:
            want = {"reward_below_start": relative[d]}
            if d >= 0.5:
                want["accuracy_below_start"] = low_evals[kwargs["accuracy_patience"] - 1]
            assert steps == want, name
        assert judge_collapse(h, **kwargs).recovered == [], name
