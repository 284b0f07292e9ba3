"""kl/update_k3: each update's own step as a divergence, measured after the step on the update's tokens, moving
no other number; and the per-run summary the calibration reads."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from helpers import loop_config, run_metrics

from moe_rl.loop.step_metrics import update_kl_metrics
from moe_rl.loop.update_kl import kl_rows, scored_updates
from moe_rl.metrics.accumulator import Metrics
from moe_rl.metrics.names import KL_UPDATE_K3, KL_UPDATE_K3_ACTING, defines
from moe_rl.train import train


def test_update_kl_is_the_k3_of_the_step_on_valid_tokens_only() -> None:
    """d = after - before; k3 = exp(d) - 1 - d averaged over valid tokens; a pad whose d overflows never reaches
    the sum."""
    before = torch.tensor([[0.0, -1.0, -2.0], [-0.5, 0.0, 0.0]])
    after = torch.tensor([[0.1, -1.2, 500.0], [-0.5, 0.3, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    acc = Metrics()
    update_kl_metrics(acc, before, after, mask)
    d = [0.1, -0.2, 0.0, 0.3]
    expected = sum(math.exp(x) - 1 - x for x in d) / 4
    assert acc.finalize()[KL_UPDATE_K3] == pytest.approx(expected, rel=1e-6)
    assert defines(KL_UPDATE_K3)


def test_the_scored_rows_are_a_seeded_subsample_of_the_global_minibatch() -> None:
    """`keep` rows of each mini-batch, the same for a rerun and for any world size; every row with None; nothing
    with 0; the global RNG is untouched."""
    minibatches = torch.randperm(32, generator=torch.Generator().manual_seed(1)).chunk(2)  # global row ids
    state = torch.get_rng_state()
    picks = kl_rows(3, 0, 5, minibatches, 0, 32)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p is not None and len(p) == 3 for p in picks) and picks[0].tolist() != picks[1].tolist()
    assert [p.tolist() for p in picks] == [p.tolist() for p in kl_rows(3, 0, 5, minibatches, 0, 32)]
    assert [p.tolist() for p in kl_rows(None, 0, 5, minibatches, 0, 32)] == [list(range(16))] * 2
    assert kl_rows(0, 0, 5, minibatches, 0, 32) == [None, None]
    whole = [sorted(mb[p].tolist()) for mb, p in zip(minibatches, picks)]
    parts: list[list[int]] = [[], []]
    for first in (0, 16):  # two processes, each holding 16 rows: together they score the rows one process does
        for i, (mb, p) in enumerate(zip(minibatches, kl_rows(3, 0, 5, minibatches, first, 16))):
            parts[i] += mb[(mb >= first) & (mb < first + 16)][p].tolist()
    assert [sorted(p) for p in parts] == whole


@pytest.mark.parametrize("replay", ["none", "r2"])
def test_update_kl_is_logged_every_step_and_moves_no_other_number(tmp_path, cache, replay: str) -> None:
    """Every step logs kl/update_k3 > 0 (also at N = 1, where kl/k3 is 0); with `metrics.update_kl_rows=0` it is
    not logged and every other value is bitwise the same, so its passes change nothing the training computes; all
    rows give another estimate of the same quantity."""
    values = {}
    for name, rows in (("off", 0), ("default", 8), ("all", None)):
        cfg = loop_config(tmp_path, cache, replay=replay, steps=3, N=2, name=f"{replay}_{name}")
        cfg.metrics.update_kl_rows = rows
        train(cfg)
        values[name] = run_metrics(tmp_path / f"{replay}_{name}")[["step", "key", "value"]]
    off, on = values["off"], values["default"]
    kl = on[on["key"] == KL_UPDATE_K3]
    assert kl["step"].tolist() == [1, 2, 3] and (kl["value"] > 0).all()
    assert KL_UPDATE_K3 not in set(off["key"])
    pd.testing.assert_frame_equal(on[on["key"] != KL_UPDATE_K3].reset_index(drop=True), off)
    every = values["all"]
    assert not every.loc[every["key"] == KL_UPDATE_K3, "value"].equals(kl["value"])


def test_the_schedule_scores_the_early_window_then_one_update_of_the_route_steps() -> None:
    plan = {s: scored_updates(s, 20, 10, 4) for s in range(1, 61)}
    assert [s for s, p in plan.items() if any(p)] == [*range(1, 21), 30, 40, 50, 60]
    assert all(all(plan[s]) for s in range(1, 21))  # the window: every update
    assert [plan[s].index(True) for s in (30, 40, 50, 60)] == [3, 0, 1, 2] and all(sum(plan[s]) == 1 for s in (30, 60))
    assert [s for s in range(1, 6) if any(scored_updates(s, 0, 2, 2))] == [2, 4]
    assert all(all(scored_updates(s, None, 10, 3)) for s in range(1, 61))
    minibatches = torch.arange(32).chunk(2)
    both, second = kl_rows(3, 0, 5, minibatches, 0, 32), kl_rows(3, 0, 5, minibatches, 0, 32, [False, True])
    assert second[0] is None and second[1] is not None and torch.equal(second[1], both[1])  # the same draws


def test_a_scheduled_run_logs_the_window_bitwise_and_moves_no_other_number(tmp_path, cache) -> None:
    """Window 2, route instruments every 2nd step, 5 steps: kl/update_k3 on steps 1, 2 (every update, each value
    bitwise the one a run scoring every step logs there) and 4 (one of its updates); every other value bitwise the
    same."""
    values = {}
    for name, window in (("every", None), ("scheduled", 2)):
        cfg = loop_config(tmp_path, cache, steps=5, N=2, name=name)
        cfg.metrics.route_every, cfg.metrics.update_kl_window = 2, window
        train(cfg)
        values[name] = run_metrics(tmp_path / name)[["step", "key", "value"]]
    every, scheduled = values["every"], values["scheduled"]
    kl = scheduled[scheduled["key"] == KL_UPDATE_K3].reset_index(drop=True)
    assert kl["step"].tolist() == [1, 2, 4]
    every_kl = every[every["key"] == KL_UPDATE_K3]
    assert every_kl["step"].tolist() == [1, 2, 3, 4, 5]
    pd.testing.assert_frame_equal(kl[kl["step"] <= 2], every_kl[every_kl["step"] <= 2].reset_index(drop=True))
    others = [f[f["key"] != KL_UPDATE_K3].reset_index(drop=True) for f in (every, scheduled)]
    pd.testing.assert_frame_equal(*others)


def test_an_anchored_run_also_logs_its_kl_under_the_routes_it_acts_with(tmp_path, cache) -> None:
    """Anchored routing: kl/update_k3/acting (under the cold start's routes, which the policy samples and trains
    with) on every scored step, > 0, beside kl/update_k3 (under its router's own); its passes move no other number
    (the run with the instrument off logs the rest bitwise); a run of its own routes logs none."""
    values = {}
    for name, rows in (("off", 0), ("on", 8)):
        cfg = loop_config(tmp_path, cache, replay="anchored", steps=2, N=2, name=f"anchored_{name}")
        cfg.metrics.update_kl_rows = rows
        train(cfg)
        values[name] = run_metrics(tmp_path / f"anchored_{name}")[["step", "key", "value"]]
    on, off = values["on"], values["off"]
    acting = on[on["key"] == KL_UPDATE_K3_ACTING]
    assert acting["step"].tolist() == [1, 2] and (acting["value"] > 0).all() and defines(KL_UPDATE_K3_ACTING)
    native = on.loc[on["key"] == KL_UPDATE_K3, "value"].to_numpy()
    assert not (acting["value"].to_numpy() == native).all()  # the two routings' steps differ
    rest = on[~on["key"].isin([KL_UPDATE_K3, KL_UPDATE_K3_ACTING])].reset_index(drop=True)
    pd.testing.assert_frame_equal(rest, off)
    plain = loop_config(tmp_path, cache, steps=1, N=2, name="plain")
    train(plain)
    assert KL_UPDATE_K3_ACTING not in set(run_metrics(tmp_path / "plain")["key"])


def test_update_kl_is_nonzero_at_one_update_per_rollout(tmp_path, cache) -> None:
    cfg = loop_config(tmp_path, cache, steps=2, N=1, name="n1")
    train(cfg)
    frame = run_metrics(tmp_path / "n1")
    assert (frame.loc[frame["key"] == "kl/k3", "value"] == 0).all()
    assert (frame.loc[frame["key"] == KL_UPDATE_K3, "value"] > 0).all()
