"""Expert load and router statistics, by hand on planted routes and logits."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import planted_routes

from moe_rl.routing.expert_load import (
    expert_load,
    expert_step_finalize,
    expert_step_metrics,
    expert_step_parts,
    expert_step_rms,
    load_metrics,
    load_shift,
    router_drift,
    router_logit_metrics,
)
from moe_rl.routing.routes import Routes

# 3 positions (the last a pad), 2 layers, k = 2, E = 4. Layer 0: experts {0,1}, {0,2} -> load (2,1,1,0)/4;
# layer 1: {1,2}, {1,2} -> (0,2,2,0)/4. The pad routes to {3,3} and never counts.
PLANTED = planted_routes([[[[0, 1], [1, 2]], [[0, 2], [1, 2]], [[3, 3], [3, 3]]]], [[True, True, False]], 4)


def test_load_shares_by_hand() -> None:
    assert torch.equal(
        expert_load(PLANTED), torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.0, 0.5, 0.5, 0.0]], dtype=torch.float64)
    )


def test_load_metrics_by_hand() -> None:
    got = load_metrics(PLANTED)
    h0 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)) / math.log(4)  # 0.75
    h1 = -(2 * 0.5 * math.log(0.5)) / math.log(4)  # 0.5
    assert got["route/load/entropy/layer_0"] == pytest.approx(h0) and h0 == pytest.approx(0.75)
    assert got["route/load/entropy/layer_1"] == pytest.approx(h1) and h1 == pytest.approx(0.5)
    assert got["route/load/entropy"] == pytest.approx(0.625)
    assert got["route/load/max_share/layer_0"] == 0.5 and got["route/load/max_share"] == 0.5
    # dead: load under 1/(10 E) = 0.025: one expert in layer 0, two in layer 1
    assert got["route/load/dead_frac/layer_0"] == 0.25 and got["route/load/dead_frac/layer_1"] == 0.5
    balanced = planted_routes([[[[0, 1]], [[2, 3]]]], [[True, True]], 4)
    assert load_metrics(balanced)["route/load/entropy"] == pytest.approx(1.0)
    assert load_metrics(balanced)["route/load/dead_frac"] == 0.0


def test_load_shift_is_the_total_variation_distance() -> None:
    other = planted_routes(
        [[[[0, 1], [0, 1]], [[0, 1], [0, 1]], [[2, 2], [2, 2]]]], [[True, True, False]], 4
    )  # (.5,.5,0,0) twice
    got = load_shift(PLANTED, other)
    assert got["route/load/shift/layer_0"] == pytest.approx(0.25)  # |0| + |-.25| + |.25| + 0, halved
    assert got["route/load/shift/layer_1"] == pytest.approx(0.5)  # .5 + 0 + .5 + 0, halved
    assert load_shift(PLANTED, PLANTED)["route/load/shift"] == 0.0


def test_router_logit_rms_and_z_by_hand() -> None:
    logits = torch.zeros(1, 2, 1, 2)  # valid position 0: logits (0, 0); position 1 masked out
    logits[0, 1] = 100.0
    got = router_logit_metrics(logits, torch.tensor([[True, False]]))
    assert got["route/router/logit_rms"] == 0.0
    assert got["route/router/z"] == pytest.approx(math.log(2) ** 2)  # logsumexp(0, 0) = log 2
    logits[0, 0, 0] = torch.tensor([3.0, 4.0])
    got = router_logit_metrics(logits, torch.tensor([[True, False]]))
    assert got["route/router/logit_rms/layer_0"] == pytest.approx(math.sqrt(12.5))
    assert got["route/router/z"] == pytest.approx(math.log(math.exp(3) + math.exp(4)) ** 2)


def test_router_drift_and_expert_steps_by_hand() -> None:
    w0 = [torch.ones(4, 2)]  # ||W0|| = sqrt(8)
    assert router_drift([w0[0] + 1], w0)["optim/router_drift"] == pytest.approx(1.0)  # ||1|| / ||1|| over 8 cells
    before = [torch.zeros(4, 3)]
    after = [torch.tensor([[1.0, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4]])]  # step RMS 1, 2, 3, 4 by expert
    tokens = torch.tensor([[10, 1, 20, 2]])  # median 6: experts 1 and 3 are below it
    rms = expert_step_rms(before, after)
    assert rms.tolist() == [[1.0, 2.0, 3.0, 4.0]]
    got = expert_step_metrics(rms, tokens)
    assert got["optim/expert_step/rms"] == pytest.approx(2.5)
    assert got["optim/expert_step/low_over_high"] == pytest.approx(((2 + 4) / 2) / ((1 + 3) / 2))


def test_expert_steps_pool_over_processes_with_the_weights_counted_once() -> None:
    """Two processes' rows of one step: the tokens add, the step RMS (the same weights on both) counts once."""
    from moe_rl.metrics.partial import pool

    rms = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    a = planted_routes([[[[0, 2]], [[0, 2]]]], [[True, True]], 4)  # expert 0 and 2 twice on this process
    b = planted_routes([[[[0, 2]], [[1, 3]]]], [[True, False]], 4)  # once more each; the masked position is not counted
    pooled = expert_step_finalize(pool([expert_step_parts(rms, a, owner=True), expert_step_parts(rms, b, owner=False)]))
    assert pooled == expert_step_metrics(rms, torch.tensor([[3, 0, 3, 0]]))
    assert pooled["optim/expert_step/low_over_high"] == pytest.approx(((2 + 4) / 2) / ((1 + 3) / 2))


def test_the_loops_partial_sums_pool_to_the_whole_batch() -> None:
    """instrument_parts on two halves of a batch, added as processes add them, give the metrics of the whole:
    the load by hand (`load_metrics`), the shift against the rollout's routes, and the router statistics."""
    from moe_rl.metrics.partial import pool
    from moe_rl.routing.expert_load import instrument_finalize, instrument_parts

    torch.manual_seed(0)
    B, T, L, E = 4, 3, 2, 4
    ids = torch.stack([torch.randperm(E)[:2].sort().values for _ in range(B * T * L)]).view(B, T, L, 2)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 0] = False
    whole = Routes(indices=ids.to(torch.uint8), mask=mask, layer_map=(0, 1), num_experts=E)
    rollout = Routes(indices=ids.roll(1, dims=0).to(torch.uint8), mask=mask, layer_map=(0, 1), num_experts=E)
    logits = tuple(torch.randn(B * T, E) for _ in range(L))  # per layer, as transformers returns them

    def half(rows: slice):
        sub = Routes(indices=whole.indices[rows], mask=mask[rows], layer_map=(0, 1), num_experts=E)
        sub_rollout = Routes(indices=rollout.indices[rows], mask=mask[rows], layer_map=(0, 1), num_experts=E)
        sub_logits = tuple(g.view(B, T, E)[rows].reshape(-1, E) for g in logits)
        return instrument_parts(sub, sub_logits, sub_rollout)

    pooled = instrument_finalize(pool([half(slice(0, 2)), half(slice(2, 4))]))
    alone = instrument_finalize(instrument_parts(whole, logits, rollout))
    assert pooled.keys() == alone.keys() and all(pooled[k] == pytest.approx(alone[k], rel=1e-12) for k in alone)
    for key, value in {**load_metrics(whole), **load_shift(rollout, whole)}.items():
        assert alone[key] == pytest.approx(value, rel=1e-12), key
    stacked = torch.stack([g.view(B, T, E) for g in logits], dim=2)  # (B, T, L, E)
    for key, value in router_logit_metrics(stacked, mask).items():
        assert alone[key] == pytest.approx(value, rel=1e-12), key
