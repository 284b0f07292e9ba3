"""The staleness study as its declaration (experiments/conf/study/staleness.yaml): every point makes the same 192
updates, the base point is one cell shared by both axes, and each block runs its own replicates of the pool."""

from __future__ import annotations

from helpers import PRESETS

from moe_rl.studies.design import load_study

STUDY = load_study(PRESETS.parent / "study" / "staleness.yaml")


def test_every_point_makes_the_same_updates() -> None:
    for name, level in STUDY.levels.items():
        over = dict(o.split("=", 1) for o in level.overrides)
        S = int(over.get("rollout.staleness", 1))
        assert int(over.get("steps", 192)) * S == 192 and int(over.get("eval_every", 24)) * S == 24, name


def test_each_block_runs_its_own_replicates_and_the_base_point_serves_both_axes() -> None:
    assert STUDY.cell_replicates("sapo", "S8") == (0, 1, 2)  # the staleness axis and the long block
    assert STUDY.cell_replicates("sapo", "S24") == (1, 2)  # the long block alone: seeds 6..17
    assert STUDY.cell_replicates("cispo", "lag16") == (0,)  # the lag axis alone: seeds 0..5
    assert STUDY.cell_replicates("cispo", "base") == (0, 1, 2)  # one base cell for the lag axis and the long block
    assert sorted(STUDY.seeds(6, ("sapo", "S24"))) == list(range(6, 18))
    assert not STUDY.levels["base"].overrides
