"""The causal study: its arms and levels from the preset, the paired contrast by hand, the declared verdict rules."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import PRESETS

from moe_rl.algos.optimizers import load_aware_scale
from moe_rl.analysis.claims.rules import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, UNTESTABLE_HERE
from moe_rl.studies import causal
from moe_rl.studies import causal_claims as cc

RUNGS = PRESETS.parent / "rung"


def test_every_arm_is_a_rung_file_run_once_per_level_at_its_reference_lr() -> None:
    spec = causal.load_spec(PRESETS)
    assert len({s % causal.POOL for s in spec.seeds}) == causal.POOL and len(spec.seeds) == 2 * causal.POOL
    points = [(level, rung) for level, rungs, _ in causal.jobs(spec) for rung in rungs]
    assert len(points) == len(set(points))  # no (level, arm) twice
    for _, rungs, _lr in causal.jobs(spec):
        for rung in rungs:
            assert (RUNGS / f"{rung}.yaml").is_file()
    past = spec.levels["past"].lr
    assert spec.lr("nonexpert_lr_quarter", "past") == pytest.approx(0.25 * past["moe"])
    assert spec.lr("dense_total_mup", "past") == past["dense"]
    first = causal.jobs(spec)[0]
    assert first[0] == "past" and {"moe", "anchored", "load_aware", "anchored_load_aware"} <= set(first[1])
    for cid, (arm, against, level) in spec.claims.items():  # every declared contrast runs in the first block
        assert {arm, against} <= {a.rung for a in spec.blocks[0][1]} and level in spec.blocks[0][0], cid


def test_every_arm_composes_and_validates_at_every_level_with_its_own_model() -> None:
    """Each multirun's command-line overrides compose through Hydra; a run's level and lr read back from its config."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from moe_rl.config import TrainConfig, to_train_config, validate

    ConfigStore.instance().store(name="base_config", node=TrainConfig)

    spec = causal.load_spec(PRESETS)
    seen = {}
    with initialize_config_dir(config_dir=str(PRESETS.parent), version_base="1.3"):
        for level, rungs, lr in causal.jobs(spec):
            for rung in rungs:
                over = ["+preset=causal", f"+rung={rung}", f"optim.lr={lr:.6g}", "seed=7"]
                cfg = validate(to_train_config(compose("config", overrides=over)))
                assert cfg.rung == rung and cfg.experiment == "causal" and cfg.optim.updates_per_rollout == 8
                assert causal._level_of(spec, rung, cfg.optim.lr) == level
                seen[(rung, level)] = cfg
    assert seen[("anchored", "past")].replay.mode == "anchored"
    assert seen[("anchored_load_aware", "past")].optim.expert_step == "load_aware"
    assert seen[("nonexpert_lr_quarter", "past")].optim.expert_lr_scale == 4.0
    assert seen[("dense_total_mup", "past")].model.family == "qwen3_dense_total"


def test_a_dense_layer_is_one_expert_whose_load_aware_scale_is_one() -> None:
    """Claim 15's dense side: one expert per layer receives every token, n_e = mean n, so the step is AdamW's."""
    assert torch.equal(load_aware_scale(torch.tensor([[37.0], [5.0]])), torch.ones(2, 1, dtype=torch.float64))


def _runs(diffs: dict[int, list[float]]) -> pd.DataFrame:
    """moe and anchored at `past` per pool member (two seeds each): moe changes -0.1, anchored -0.1 + d."""
    rows = []
    for member, ds in diffs.items():
        for k, d in enumerate(ds):
            seed = member + causal.POOL * k
            for rung, change, kl in (("moe", -0.1, 0.01), ("anchored", -0.1 + d, 0.012)):
                rows.append(dict(rung=rung, level="past", member=member, seed=seed, change=change, kl_early=kl))
    return pd.DataFrame(rows)


def test_the_contrast_is_the_mean_of_start_means_with_the_kl_ratio() -> None:
    runs = _runs({m: [0.02 * m, 0.02 * m + 0.04] for m in range(6)})
    r = causal.contrast(runs, "anchored", "moe", "past")
    # start means 0.02 m + 0.02, m = 0..5: mean 0.07
    assert r["mean_diff"] == pytest.approx(0.07) and r["n_starts"] == 6 and r["n_seeds"] == 12
    assert r["kl_ratio"] == pytest.approx(1.2)
    assert r["p_value"] == pytest.approx(2 / 64)  # every start above 0: the most extreme of 2^6 sign patterns


def test_one_sided_p_halves_the_symmetric_two_sided_one() -> None:
    assert cc.one_sided(2 / 64, 0.07) == pytest.approx(1 / 64)
    assert cc.one_sided(2 / 64, -0.07) == pytest.approx(1 - 1 / 64)
    assert math.isnan(cc.one_sided(math.nan, 0.1))


def _rec(**kw) -> dict:
    base = dict(level="past", descriptive=None, moe_change=-0.2, lo=0.01, hi=0.1, p_one=1 / 64, p_holm=3 / 64)
    return {**base, **kw}


@pytest.mark.parametrize(
    ("rec", "verdict"),
    [
        (_rec(), REPRODUCED),
        (_rec(p_holm=0.09), INCONCLUSIVE),  # the interval above 0 but Holm's p not below 5%
        (_rec(lo=-0.12, hi=-0.01, p_holm=1.0), NOT_REPRODUCED),  # the arm hurts
        (_rec(lo=-0.03, hi=0.04, p_holm=0.5), NOT_REPRODUCED),  # inside +-5 pp
        (_rec(lo=-0.03, hi=0.09, p_holm=0.5), INCONCLUSIVE),
        (_rec(moe_change=-0.02), UNTESTABLE_HERE),  # moe does not degrade: nothing to stabilise
        (_rec(descriptive="descriptive: 4 independent starts (an interval needs 5)"), INCONCLUSIVE),
    ],
)
def test_declared_verdict_rules(rec: dict, verdict: str) -> None:
    assert cc._verdict(rec)[0] == verdict


def test_claims_are_holm_adjusted_over_the_decided_three(monkeypatch) -> None:
    spec = causal.load_spec(PRESETS)
    rng = np.random.default_rng(0)
    rows = []
    for rung, shift in (("moe", 0.0), ("anchored", 0.05), ("load_aware", 0.0), ("dense_total_mup", -0.05)):
        for m in range(6):
            for k in range(2):
                rows.append(
                    dict(rung=rung, level="past", member=m, seed=m + 6 * k, kl_early=0.01,
                         change=-0.2 + shift + 0.01 * rng.standard_normal() + (0.01 if rung != "moe" else 0.0))
                )  # fmt: skip
    monkeypatch.setattr(cc, "_runs", lambda root, presets: (spec, pd.DataFrame(rows)))
    cc.decisions.cache_clear()
    try:
        found = cc.decisions("r", "p")
    finally:
        cc.decisions.cache_clear()
    assert found is not None
    assert found[14]["p_one"] == pytest.approx(1 / 64) and found[14]["p_holm"] == pytest.approx(3 / 64)
    assert found[14]["verdict"] == REPRODUCED and found[7]["verdict"] == NOT_REPRODUCED
    assert all(float(r["p_holm"]) >= float(r["p_one"]) for r in found.values())


def test_arms_from_disjoint_starts_get_a_permutation_p_over_starts() -> None:
    """Two models' arms (each its own pool of 6 starts, 2 seeds each): the starts are permuted between them, every
    split of 12 start means enumerated (the 6 highest all on one side: p = 2 / C(12, 6)); arms sharing their starts
    pair on them instead and get no such p, nor does an arm with fewer than 5 starts."""

    def arm(name: str, model: str, shift: float, starts: int = 6) -> pd.DataFrame:
        rows = [(name, f"{model}{m}", seed, shift + 0.01 * m) for m in range(starts) for seed in (m, m + 6)]
        return pd.DataFrame(rows, columns=["rung", "start", "seed", "change"])

    moe, dense = arm("moe", "m", 0.0), arm("dense", "d", 0.5)
    assert causal.between_models_p(dense, moe) == pytest.approx(2 / math.comb(12, 6))
    assert math.isnan(causal.between_models_p(arm("anchored", "m", 0.5), moe))  # one model: shared starts
    assert math.isnan(causal.between_models_p(arm("dense", "d", 0.5, starts=4), moe))  # below 5 starts
