"""A declaration whose cells compose to one run config is refused on load, naming them, unless its `duplicates` names
them with the reason they run (`moe_rl.studies.design`); every shipped declaration loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import ROOT

from moe_rl.studies.design import _Composer, _declared_duplicates, _same_config, load_study, study_files

CONF = ROOT / "experiments" / "conf"
STUDIES = CONF / "study"


def _conf_copy(tmp_path: Path, name: str, **changes: object) -> Path:
    """The shipped declaration `name` with `changes`, in a config folder beside the shipped groups (symlinked)."""
    conf = tmp_path / "conf"
    (conf / "study").mkdir(parents=True)
    for entry in CONF.iterdir():
        if entry.name != "study":
            (conf / entry.name).symlink_to(entry)
    raw = {**yaml.safe_load((STUDIES / f"{name}.yaml").read_text()), **changes}
    path = conf / "study" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _with_arm(tmp_path: Path, arm: dict, **changes: object) -> Path:
    """router_defaults with a fourth arm `again` that one exploratory contrast reads against `moe`."""
    raw = yaml.safe_load((STUDIES / "router_defaults.yaml").read_text())
    contrast = {"name": "again_minus_moe", "claim": "exploratory", "cells": {"again@past": 1, "moe@past": -1}}
    return _conf_copy(
        tmp_path,
        "router_defaults",
        arms={**raw["arms"], "again": arm},
        contrasts=[*raw["contrasts"], contrast],
        **changes,
    )


def test_two_cells_composing_to_one_run_config_are_refused_in_one_line_naming_both(tmp_path: Path) -> None:
    # +rung=lr_matched sets the default model and its rung label (not part of what a run computes): +rung=moe's run
    path = _with_arm(tmp_path, {"overrides": ["+rung=lr_matched"]})
    with pytest.raises(ValueError) as refused:
        load_study(path)
    message = str(refused.value)
    assert "\n" not in message
    assert "cells moe@past and again@past compose to the same run config" in message and "duplicates" in message


def test_a_group_spelled_otherwise_is_the_same_config_and_a_real_change_is_not(tmp_path: Path) -> None:
    # the preset chooses arm grpo_none already; lr 4e-4 spelled 0.0004: the same run as moe@past
    same = _with_arm(tmp_path / "same", {"overrides": ["+rung=moe", "arm=grpo_none", "optim.lr=0.0004"]})
    with pytest.raises(ValueError, match="cells moe@past and again@past compose"):
        load_study(same)
    for changed in (["+rung=moe", "arm=is_none"], ["+rung=moe", "algo.aux_loss_coef=0.01"], ["+rung=dense"]):
        study = load_study(_with_arm(tmp_path / "_".join(changed), {"overrides": changed}))
        assert _same_config(study) == []


def test_a_declared_duplicate_loads_with_its_reason_and_a_stray_or_bare_one_is_refused(tmp_path: Path) -> None:
    arm = {"overrides": ["+rung=lr_matched"]}
    group = {"cells": ["moe@past", "again@past"], "reason": "a planted twin"}
    study = load_study(_with_arm(tmp_path / "ok", arm, duplicates=[group]))
    assert _declared_duplicates(study) == [((("moe", "past"), ("again", "past")), "a planted twin")]
    assert _same_config(study) == [[("moe", "past"), ("again", "past")]]
    stray = {"cells": ["moe@past", "aux@late"], "reason": "r"}
    with pytest.raises(ValueError, match=r"duplicates names cells it does not run: \['aux@late'\]"):
        load_study(_with_arm(tmp_path / "stray", arm, duplicates=[group, stray]))
    with pytest.raises(ValueError, match="must be {cells"):
        load_study(_with_arm(tmp_path / "bare", arm, duplicates=[{"cells": ["moe@past", "again@past"]}]))
    with pytest.raises(ValueError, match="cells moe@past and again@past compose"):  # a group must hold them all
        load_study(_with_arm(tmp_path / "other", arm, duplicates=[{"cells": ["moe@past", "aux@past"], "reason": "r"}]))


def test_outside_a_config_folder_the_overrides_alone_are_compared(tmp_path: Path) -> None:
    raw = yaml.safe_load((STUDIES / "staleness_erosion.yaml").read_text())
    raw.pop("duplicates")
    raw["arms"]["grpo_again"] = {"overrides": ["arm=dppo_tv_none", "arm=grpo_none"]}  # the later choice holds
    raw["contrasts"].append(
        {"name": "again", "claim": "exploratory", "cells": {"grpo_again@S24": 1, "grpo@S24": -1}},
    )
    path = tmp_path / "staleness_erosion.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ValueError, match="cells grpo@S24 and grpo_again@S24 compose to the same run config"):
        load_study(path)


def test_every_shipped_declaration_loads_and_runs_each_config_once_or_says_why() -> None:
    for path in study_files(STUDIES):
        study = load_study(path)
        assert _same_config(study) == [], f"{path.stem}: cells composing to one run config"
    # staleness_erosion's S = 1 cells compose to different configs that compute the same runs: declared, with why
    declared = _declared_duplicates(load_study(STUDIES / "staleness_erosion.yaml"))
    assert [cells for cells, _ in declared] == [
        (("grpo", "S1"), ("dppo_tv", "S1"), ("is", "S1")),
        (("cispo", "S1"), ("vespo", "S1")),
    ]
    assert all("ratio is exactly 1" in reason for _, reason in declared)


def test_the_composition_groups_cells_as_hydra_does() -> None:
    """Hydra's own composition of a few runs (the identity hash of each config) against the flattened one here."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from moe_rl.config import TrainConfig, config_hash, to_train_config

    runs = {
        "preset arm": ["+preset=causal", "cold_start.pool=1000000", "+rung=moe", "optim.lr=4.0e-4"],
        "arm spelled": ["+preset=causal", "cold_start.pool=1000000", "arm=grpo_none", "+rung=moe", "optim.lr=0.0004"],
        "rung label": ["+preset=causal", "cold_start.pool=1000000", "+rung=lr_matched", "optim.lr=4e-4"],
        "other arm": ["+preset=causal", "cold_start.pool=1000000", "arm=is_none", "+rung=moe", "optim.lr=4e-4"],
        "other lr": ["+preset=causal", "cold_start.pool=1000000", "+rung=moe", "optim.lr=5e-4"],
        "other pool": ["+preset=causal", "+rung=moe", "optim.lr=4e-4"],
        "staleness": ["+preset=staleness", "cold_start.pool=1000000", "arm=grpo_none", "rollout.staleness=1"],
        "staleness default arm": ["+preset=staleness", "cold_start.pool=1000000", "rollout.staleness=1"],
    }
    ConfigStore.instance().store(name="base_config", node=TrainConfig)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        hydra = {k: config_hash(to_train_config(compose("config", overrides=[*v, "seed=0"]))) for k, v in runs.items()}
    composer = _Composer(CONF)
    ours = {k: composer.identity(v) for k, v in runs.items()}
    for a in runs:
        for b in runs:
            assert (hydra[a] == hydra[b]) == (ours[a] == ours[b]), (a, b)
    assert (
        ours["preset arm"] == ours["arm spelled"] == ours["rung label"]
        and ours["staleness"] == ours["staleness default arm"]
    )


def test_a_cell_leaving_an_axis_of_its_presets_sweep_unset_is_refused_naming_it(tmp_path: Path) -> None:
    # the phase preset sweeps arm over three values: a cell that does not choose one would run all three as one arm
    raw = yaml.safe_load((STUDIES / "routing_dominant_mechanism.yaml").read_text())
    assert "arm=grpo_none" in raw["overrides"]
    load_study(_conf_copy(tmp_path / "ok", "routing_dominant_mechanism"))
    bare = [o for o in raw["overrides"] if not o.startswith("arm=")]
    with pytest.raises(ValueError) as refused:
        load_study(_conf_copy(tmp_path / "open", "routing_dominant_mechanism", overrides=bare))
    assert "cell moe@offpolicy leaves ['arm'] of preset phase's sweep unset" in str(refused.value)
    arms = {name: {**arm, "overrides": [*arm["overrides"], "arm=grpo_none"]} for name, arm in raw["arms"].items()}
    load_study(_conf_copy(tmp_path / "per_arm", "routing_dominant_mechanism", overrides=bare, arms=arms))
