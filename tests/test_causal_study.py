"""The causal study as its declaration (experiments/conf/study/causal.yaml): each cell composes to its arm's model at
its reference's lr, and the pool of 6 pairs seeds m and m + 6 (its runs: tests/test_as_run.py)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import PRESETS, ROOT

from moe_rl.algos.optimizers import load_aware_scale
from moe_rl.studies.design import load_study
from moe_rl.studies.study_rule import pair_members, pair_values

STUDY = load_study(PRESETS.parent / "study" / "causal.yaml")
RUNGS = PRESETS.parent / "rung"


def test_every_arm_is_a_rung_file_at_its_reference_lr() -> None:
    assert STUDY.member_pool == 6 and STUDY.seeds(6) == [m + 6 * r for m in range(6) for r in range(2)]
    for arm in STUDY.arms.values():
        rung = next(o for o in arm.overrides if o.startswith("+rung=")).split("=", 1)[1]
        assert (RUNGS / f"{rung}.yaml").is_file()
    past = dict(o.split("=", 1) for o in STUDY.cell_overrides("nonexpert_lr_quarter", "past"))
    assert float(past["optim.lr"]) == pytest.approx(0.25 * 4e-4)
    assert "optim.lr=0.00055" in STUDY.cell_overrides("dense_total_mup", "past")


def test_every_cell_composes_and_validates_with_its_own_model() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from moe_rl.config import TrainConfig, to_train_config, validate

    ConfigStore.instance().store(name="base_config", node=TrainConfig)
    seen = {}
    with initialize_config_dir(config_dir=str(PRESETS.parent), version_base="1.3"):
        for arm, level in STUDY.cells():
            over = [f"+preset={STUDY.preset}", *STUDY.cell_overrides(arm, level), "seed=7"]
            cfg = validate(to_train_config(compose("config", overrides=over)))
            assert cfg.experiment == "causal" and cfg.optim.updates_per_rollout == 8 and cfg.cold_start.pool == 6
            seen[(arm, level)] = cfg
    assert seen[("anchored", "past")].replay.mode == "anchored"
    assert seen[("anchored_load_aware", "past")].optim.expert_step == "load_aware"
    assert seen[("nonexpert_lr_quarter", "past")].optim.expert_lr_scale == 4.0
    assert seen[("dense_total_mup", "past")].model.family == "qwen3_dense_total"


def test_a_dense_layer_is_one_expert_whose_load_aware_scale_is_one() -> None:
    """Claim 15's dense side: one expert per layer receives every token, n_e = mean n, so the step is AdamW's."""
    assert torch.equal(load_aware_scale(torch.tensor([[37.0], [5.0]])), torch.ones(2, 1, dtype=torch.float64))


def test_a_pool_of_six_pairs_seed_m_and_m_plus_6_and_blocks_two_models_by_member() -> None:
    """moe and dense ran from their own warm-ups of member m (starts "m<m>" and "d<m>"): their pairs block on the
    member, seed m + 6 in member m's block; within one model, on the cold start itself."""
    rows = [
        (cell, f"{model}{m}", m + 6 * r, 0.1 * m + (0.5 if cell == "dense@past" else 0.0))
        for cell, model in (("moe@past", "m"), ("dense@past", "d"), ("anchored@past", "m"))
        for m in range(6)
        for r in range(2)
    ]
    runs = pd.DataFrame(rows, columns=["cell", "start", "seed", "change"])
    across = pair_values(runs, {("dense", "past"): 1.0, ("moe", "past"): -1.0}, "change", pool=6)
    assert set(across["start"]) == {f"member {m}" for m in range(6)} and across["value"].tolist() == pytest.approx(
        [0.5] * 12
    )
    assert list(pair_members(across, 6)) == [int(s) % 6 for s in across["seed"]]
    within = pair_values(runs, {("anchored", "past"): 1.0, ("moe", "past"): -1.0}, "change", pool=6)
    assert set(within["start"]) == {f"m{m}" for m in range(6)}


def test_the_declaration_is_the_only_design_left() -> None:
    """The preset keeps the run configuration; the design lives in the declaration alone."""
    import yaml

    preset = yaml.safe_load((PRESETS / "causal.yaml").read_text())
    assert "analysis" not in preset and not Path(ROOT / "experiments" / "causal.py").exists()
