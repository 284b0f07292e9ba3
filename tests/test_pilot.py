"""A pilot across starts (`pilot:` in a declaration, `moe_rl.studies.pilot`): declared without contrasts, its table
and the edge it reads by hand, its refusals, and its launch plan."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import yaml
from helpers import TINY, launcher
from scipy import stats

from moe_rl.studies.design import load_study
from moe_rl.studies.pilot import edge, pilot_table, starts_needed

PILOT = {
    "name": "tiny_pilot",
    "question": "Where does grpo+none lose 10-20 points?",
    "preset": "staleness",
    "overrides": [*TINY, "numerics=native", "steps=2", "eval_every=1"],
    "arms": {"none": {"overrides": ["replay=none"]}},
    "levels": {
        "lo": {"overrides": ["optim.lr=1e-3"]},
        "mid": {"overrides": ["optim.lr=2e-3"]},
        "hi": {"overrides": ["optim.lr=4e-3"]},
    },
    "unit": {"members": "900..903"},
    "pilot": {"reference": "none", "loss": [0.10, 0.20]},
    "design": {"looks": [4]},
}


def _write(folder, raw: dict):
    path = folder / f"{raw['name']}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _runs(losses: dict[str, list[float]], lrs: dict[str, float], floor: dict[str, int] | None = None) -> pd.DataFrame:
    rows = []
    for level, values in losses.items():
        for i, loss in enumerate(values):
            at_floor = i < (floor or {}).get(level, 0)
            rows.append(
                {
                    "arm": "none",
                    "level": level,
                    "lr": lrs[level],
                    "start": f"m{i}",
                    "change": -loss,
                    "late_accuracy": 0.0 if at_floor else 0.3,
                    "routing_share": 0.2,
                    "kl_acting": 1e-3,
                }
            )
    return pd.DataFrame(rows)


def test_a_pilot_is_declared_without_contrasts_and_reads_its_edge(tmp_path) -> None:
    """Losses 5, 15 and 30 points at lr 1e-3, 2e-3, 4e-3: the edge is `mid`; its SD over 4 starts sizes the study
    by the normal formula, (z_0.975 + z_0.8)^2 x 2 SD^2 / MDE^2."""
    study = load_study(_write(tmp_path, PILOT))
    assert study.pilot is not None and study.contrasts == () and study.design.mde == 0.05
    runs = _runs(
        {"lo": [0.04, 0.06, 0.05, 0.05], "mid": [0.10, 0.20, 0.15, 0.15], "hi": [0.3] * 4},
        {"lo": 1e-3, "mid": 2e-3, "hi": 4e-3},
    )
    table = pilot_table(runs)
    assert table["level"].tolist() == ["lo", "mid", "hi"] and table["loss"].round(12).tolist() == [0.05, 0.15, 0.3]
    sd = pd.Series([0.10, 0.20, 0.15, 0.15]).std()
    half = 100 * float(stats.t.isf(0.025, 3)) * sd / 2
    assert table.loc[1, "change (pp)"] == f"-15.0 [{-15.0 - half:+.1f}, {-15.0 + half:+.1f}]"
    n = math.ceil(((stats.norm.isf(0.025) + stats.norm.isf(0.2)) * 2**0.5 * sd / 0.05) ** 2)
    assert starts_needed(sd, 0.05, 0.8, 0.025) == n == 11  # SD 0.0408: (2.80 x 1.414 x 0.0408 / 0.05)^2 = 10.4
    text = edge(study, table)
    assert text.startswith("**Edge: mid (lr 0.002)**, where none loses 15.0 points with 0 of 4 runs at the floor")
    assert f"needs about {n} starts for 5 pp at 80% power" in text


def test_no_level_in_the_band_interpolates_in_log_lr_or_says_which_way(tmp_path) -> None:
    """Losses 5 and 35 points at lr 1e-3 and 4e-3: 15 points (the band's middle) lies a third of the way, in log
    lr, so lr 1e-3 x 4^(1/3); all below the band: raise the lr; the band's level mostly at the floor does not count."""
    study = load_study(_write(tmp_path, PILOT))
    lrs = {"lo": 1e-3, "hi": 4e-3}
    text = edge(study, pilot_table(_runs({"lo": [0.05] * 3, "hi": [0.35] * 3}, lrs)))
    assert f"at lr {1e-3 * 4 ** (1 / 3):.3g}, between lo and hi" in text
    assert "raise the lr" in edge(study, pilot_table(_runs({"lo": [0.01] * 3, "hi": [0.02] * 3}, lrs)))
    floored = pilot_table(_runs({"lo": [0.15] * 4, "hi": [0.5] * 4}, lrs, floor={"lo": 3}))
    assert edge(study, floored).startswith("**No level reaches")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"contrasts": [{"name": "c", "cells": {"none@hi": 1, "none@lo": -1}}]}, "a pilot decides nothing"),
        ({"pilot": {"reference": "r2"}}, "pilot.reference 'r2' is not one of its arms"),
        ({"pilot": {"reference": "none", "loss": [0.2, 0.1]}}, r"pilot.loss \[0.2, 0.1\] must be \[lo, hi\]"),
        ({"pilot": None}, "no contrasts: a study decides contrasts; a run of cells that decides nothing is a pilot"),
    ],
)
def test_a_malformed_pilot_is_refused(tmp_path, changes, message) -> None:
    raw = {**PILOT, **changes}
    if raw["pilot"] is None:
        del raw["pilot"]
        raw["design"] = {"mde": 0.05, "looks": [4], "sized_from": "a test"}
    with pytest.raises(ValueError, match=message):
        load_study(_write(tmp_path, raw))


def test_a_pilot_launches_its_cells_like_a_study(tmp_path, capsys) -> None:
    launcher().main(["tiny_pilot", "--studies", str(_write(tmp_path, PILOT).parent), "--dry-run"])
    out = capsys.readouterr().out
    cells = [line.split()[0] for line in out.splitlines() if line.startswith("[")]
    assert cells == ["[none@lo]", "[none@mid]", "[none@hi]"] and "seed=900,901,902,903" in out
