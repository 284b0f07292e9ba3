"""A study is its declaration (`moe_rl.studies.design`), launched by `experiments/study.py` and decided by one rule
(`moe_rl.studies.study_rule`): refusals at load, the launch plan, the rule by hand, and one tiny study end to end."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from helpers import ROOT, TINY, TRAIN_ENV, launcher, run_study, study_dry_run, train_in_process
from scipy import stats

from moe_rl.analysis.sequential import boundaries
from moe_rl.studies import study_claims, study_report, study_rule
from moe_rl.studies.design import POOL, load_study, study_files

STUDIES = ROOT / "experiments" / "conf" / "study"

BASE = {
    "name": "tiny",
    "question": "Does r2 change the gain?",
    "preset": "staleness",
    "overrides": [*TINY, "numerics=native", "steps=2", "eval_every=1"],
    "arms": {"none": {"overrides": ["replay=none"]}, "r2": {"overrides": ["replay=r2"]}},
    "levels": {"lo": {"overrides": ["optim.lr=1e-3"]}, "hi": {"overrides": ["optim.lr=2e-3"]}},
    "unit": {"members": "300..302", "seeds_per_start": 1},
    "outcome": "change",
    "contrasts": [{"name": "r2_minus_none_at_hi", "claim": "x", "cells": {"r2@hi": 1, "none@hi": -1}}],
    "design": {"mde": 0.05, "looks": [3], "sized_from": "a test"},
}


def _write(tmp_path: Path, **changes: object) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**BASE, **changes}))
    return path


def test_a_block_runs_its_own_replicates_and_the_other_cells_the_unit_s() -> None:
    """Run seed m + r * pool is replicate r of member m: a block's `replicates` name its cells' r (the union over the
    blocks that list a cell); a cell no block names replicates runs 0 .. seeds_per_start - 1."""
    raw = {
        **BASE,
        "unit": {"members": "0..2", "pool": 3, "seeds_per_start": 1},
        "runs": [
            {"arms": ["none"], "levels": ["lo"]},
            {"arms": ["none", "r2"], "levels": ["hi"], "replicates": [1, 2]},
        ],
    }
    study = load_study(_write(Path(tempfile.mkdtemp()), **raw))
    assert study.cells() == [("none", "lo"), ("none", "hi"), ("r2", "hi")]
    assert study.seeds(2, ("none", "lo")) == [0, 1] and study.seeds(2, ("r2", "hi")) == [3, 6, 4, 7]


def test_every_shipped_declaration_loads() -> None:
    for path in study_files(STUDIES):
        study = load_study(path)
        assert study.cells() and study.design.looks[-1] <= len(study.members)


@pytest.mark.parametrize("name", [p.stem for p in study_files(STUDIES)])
def test_every_cell_of_every_declaration_composes_and_validates(name: str) -> None:
    """Each cell as the launcher composes its runs (the preset, the pool, the cell's overrides) through Hydra, validated
    as a run validates it; a study declared as it ran composes to its own experiment and pool (or names its member by an
    override of its own)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from moe_rl.config import TrainConfig, to_train_config, validate

    ConfigStore.instance().store(name="base_config", node=TrainConfig)
    study = load_study(STUDIES / f"{name}.yaml")
    with initialize_config_dir(config_dir=str(STUDIES.parent), version_base="1.3"):
        for arm, level in study.cells():
            cfg = validate(to_train_config(compose("config", overrides=[*study.run_overrides(arm, level), "seed=7"])))
            if study.as_ran is not None and study.as_ran.member is not None:
                assert cfg.experiment == name, (arm, level)  # its member is an override of its own (cold_start.seed)
            elif study.declared:
                assert cfg.experiment == name and cfg.cold_start.pool == study.pool, (arm, level)
            else:
                assert cfg.cold_start.pool == POOL, (arm, level)


def test_a_broken_declaration_is_refused_in_one_line_naming_its_file_and_line(tmp_path) -> None:
    """A YAML error, a misspelt key at any depth: `path:line: ...`, with the nearest key where one is close."""
    path = _write(tmp_path)
    text = path.read_text()
    path.write_text(text.replace("outcome: change", "outcom: change"))
    line = 1 + path.read_text().splitlines().index("outcom: change")
    with pytest.raises(ValueError, match=rf"^{path}:{line}: unknown key 'outcom' \(did you mean 'outcome'\?\)$"):
        load_study(path)
    path.write_text(text.replace("  mde: 0.05", "  mdee: 0.05"))
    with pytest.raises(ValueError, match=r"tiny.yaml:\d+: unknown key 'design.mdee' \(did you mean 'mde'\?\)"):
        load_study(path)
    path.write_text(text + "arms: [\n")
    with pytest.raises(ValueError, match=rf"^{path}:\d+: not valid YAML: "):
        load_study(path)


def test_a_new_study_draws_new_pool_members(tmp_path) -> None:
    """Members another declaration in the folder draws are refused unless `unit.reuse` names that study with why; a
    study declared as it ran keeps the pool it ran."""
    _write(tmp_path)  # tiny: members 300..302
    twin = {**BASE, "name": "twin", "unit": {"members": "302..305"}}
    (tmp_path / "twin.yaml").write_text(yaml.safe_dump(twin))
    with pytest.raises(ValueError, match=r"share 1 members \(302..302\) with study tiny: .* \(e.g. from 306\)"):
        load_study(tmp_path / "twin.yaml")
    twin["unit"] = {"members": "302..305", "reuse": {"tiny": "the same warm-ups under another question"}}
    (tmp_path / "twin.yaml").write_text(yaml.safe_dump(twin))
    assert load_study(tmp_path / "twin.yaml").members == (302, 303, 304, 305)
    twin["unit"] = {"members": "302..305", "reuse": {"tiny": ""}}
    (tmp_path / "twin.yaml").write_text(yaml.safe_dump(twin))
    with pytest.raises(ValueError, match="unit.reuse must map each study whose members it shares to why"):
        load_study(tmp_path / "twin.yaml")


def test_a_cell_that_does_not_compose_is_refused_by_the_launcher(tmp_path) -> None:
    """An arm naming a config that does not exist is refused before anything runs, naming the file and the cell."""
    raw = yaml.safe_load((STUDIES / "routing_dominant.yaml").read_text())
    raw["arms"]["grpo_r2"]["overrides"] = ["arm=grpo_r2", "+rung=nosuch"]
    (tmp_path / "routing_dominant.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit) as refused:  # the launcher in this process: its exit message is its one line
        launcher().main(["routing_dominant", "--studies", str(tmp_path), "--dry-run"])
    assert str(refused.value) == (
        f"error: {tmp_path}/routing_dominant.yaml: cell grpo_r2@offpolicy does not compose: In 'config': Could not "
        "find 'rung/nosuch'"
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"design": {**BASE["design"], "looks": [2]}}, "next to no power"),
        ({"design": {**BASE["design"], "looks": [3, 4]}}, "needs 4 starts but unit.members draws 3"),
        ({"contrasts": [{"name": "c", "cells": {"r2@mid": 1, "none@hi": -1}}]}, r"\['r2@mid'\] name an arm or level"),
        ({"contrasts": [{"name": "c", "cells": {"r2@hi": 1, "none@hi": -0.5}}]}, "weights sum to 0.5"),
        ({"design": {**BASE["design"], "looks": [3, 3]}}, "must increase"),
        ({"contrasts": [{**BASE["contrasts"][0], "outcome": "reward"}]}, "outcome 'reward' is not one of"),
        ({"unit": {"members": "300..302", "admit": {"min_reward": 0.1}}}, r"unknown key 'unit.admit.min_reward'"),
        ({"unit": {"members": "300..302", "pool": 6}}, "unit.pool 6 must exceed every member id"),
        ({"runs": [{"arms": ["r3"], "levels": ["hi"]}]}, r"runs \['r3@hi'\] name an arm or level"),
        ({"axes": {"lr": ["lo", "mid"]}}, r"axes name levels it does not declare: \{'lr': \['mid'\]\}"),
        ({"readme": ["nope"]}, r"readme shows contrasts it does not declare: \['nope'\]"),
        ({"sections": ["moe_rl.studies.divergence_report.frontier_section"]}, "are not module:function"),
        ({"compiled": "yes"}, "compiled 'yes' must be true"),
        ({"unit": {"members": "300..302", "start": "seed"}}, "unit.start 'seed' must be 'cold start'"),
        ({"unit": {"members": "300..302", "admit": {"in_band": "yes"}}}, "in_band 'yes' must be true or false"),
        ({"not_run": [{"levels": ["hi"], "seeds": [1], "replicates": [0]}]}, r"unknown key 'not_run\[\].replicates'"),
        ({"not_run": [{"levels": "hi", "seeds": [300]}]}, "must have non-empty lists levels"),
        ({"not_run": [{"levels": ["hi"], "arms": [], "seeds": [300]}]}, "must have non-empty lists levels"),
        ({"not_run": [{"levels": ["hi"], "seeds": [300, 7]}]}, r"not_run seeds \[7\] of none@hi are not seeds it runs"),
        ({"not_run": [{"levels": ["mid"], "seeds": [1]}]}, r"runs \['none@mid', 'r2@mid'\] name an arm or level"),
        ({"arms": {**BASE["arms"], "r2": {"overrides": ["replay=r2", "compile=true"]}}}, "one for every run"),
    ],
)
def test_a_declaration_that_cannot_decide_is_refused_with_its_reason(tmp_path, changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        load_study(_write(tmp_path, **changes))


def test_a_study_is_one_numerics_domain(tmp_path) -> None:
    """`compiled: true` compiles every run of every cell; the default runs every one eager (no override at all, so
    the runs of a study declared as it ran keep their names)."""
    eager, compiled = load_study(_write(tmp_path)), load_study(_write(tmp_path, compiled=True))
    cells = compiled.cells()
    assert all(compiled.cell_overrides(*c) == [*eager.cell_overrides(*c), "compile=true"] for c in cells)
    assert not any(o.startswith("compile=") for c in eager.cells() for o in eager.cell_overrides(*c))


def test_the_launch_runs_each_cell_over_the_looks_members(tmp_path) -> None:
    _write(tmp_path)
    out = study_dry_run(tmp_path, "tiny")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("[")]
    assert [line.split("]")[0][1:] for line in lines] == ["none@hi", "r2@hi"]  # the cells a contrast reads
    assert all("seed=300,301,302" in line and f"cold_start.pool={POOL}" in line for line in lines)
    assert "replay=r2" in lines[1] and "optim.lr=2e-3" in lines[1]


def _runs(values: dict[str, list[float]], late: float = 0.5) -> pd.DataFrame:
    """One run per (cell, start) with `change` from `values[cell]` (start i at index i: member 300 + i, its seed)."""
    rows = [
        {"cell": cell, "start": f"s{i}", "seed": 300 + i, "change": v, "late_accuracy": late, "collapsed": False}
        for cell, vals in values.items()
        for i, v in enumerate(vals)
    ]
    return pd.DataFrame(rows).assign(kl_acting=np.nan, log_kl_acting=np.nan, run_dir="")


def test_seeds_a_cell_skipped_as_it_ran_are_neither_listed_nor_awaited(tmp_path) -> None:
    """`not_run` (a study declared as it ran): seed 4 of r2@hi was skipped (its member's warm-up ended out of band on
    the machine that ran it), so the launcher lists it not, and member 1 is complete without it; a block without
    arms covers every arm."""
    raw = {
        "unit": {"members": "0..2", "pool": 3, "seeds_per_start": 2},
        "not_run": [{"levels": ["hi"], "arms": ["r2"], "seeds": [4]}, {"levels": ["lo"], "seeds": [5]}],
    }
    study = load_study(_write(tmp_path, **raw))
    assert study.seeds(3, ("r2", "hi")) == [0, 3, 1, 2, 5] and study.seeds(3, ("none", "hi")) == [0, 3, 1, 4, 2, 5]
    assert study.not_run[("none", "lo")] == (5,) and study.not_run[("r2", "lo")] == (5,)
    runs = pd.DataFrame(
        [{"cell": "none@hi", "seed": s} for s in range(6)] + [{"cell": "r2@hi", "seed": s} for s in (0, 3, 1, 2)]
    )
    assert study_rule.complete_members(study, runs) == {0, 1}  # member 2 still waits for seed 5 of r2@hi


def test_a_warm_up_out_of_its_band_is_not_admitted_where_the_study_asks(tmp_path) -> None:
    study = load_study(_write(tmp_path, unit={"members": "300..302", "admit": {"in_band": True}}))
    assert study.admission.admits(math.nan, math.nan, True) and not study.admission.admits(0.5, 0.1, False)
    assert load_study(_write(tmp_path)).admission.admits(math.nan, math.nan, False)  # no rule: every start


def test_a_run_mean_read_on_the_floor_is_untestable(tmp_path) -> None:
    """A run mean (here `routing_share`) of a cell whose runs mostly end at accuracy 0 is read over steps without a
    policy gradient: untestable, though the other cell is off the floor; the accuracy change of the same runs is
    read (one cell on the floor is what a collapse looks like)."""
    share = {"name": "share", "cells": {"r2@hi": 1, "none@hi": -1}, "outcome": "routing_share", "mde": 0.03}
    study = load_study(_write(tmp_path, contrasts=[share, BASE["contrasts"][0]]))
    runs = _runs({"none@hi": [0.0, 0.0, 0.0], "r2@hi": [0.10, 0.06, 0.11]})
    runs["routing_share"] = runs["change"]
    runs.loc[runs["cell"] == "none@hi", "late_accuracy"] = 0.0
    row = study_rule.decide(study, runs, study.contrasts[0])
    assert row["verdict"] == study_rule.UNTESTABLE and "100% of none@hi's runs end at accuracy 0" in row["reason"]
    assert study_rule.decide(study, runs, study.contrasts[1])["verdict"] == study_rule.REPRODUCED
    three = {**share, "name": "three", "cells": {"r2@hi": 1, "none@hi": -0.5, "none@lo": -0.5}}
    both = load_study(_write(tmp_path, contrasts=[three]))
    runs3 = pd.concat([runs, runs[runs["cell"] == "none@hi"].assign(cell="none@lo")], ignore_index=True)
    runs3.loc[(runs3["cell"] == "none@hi") & (runs3["seed"] == 300), "late_accuracy"] = 0.5  # 2 of 3 at 0
    assert "100% of none@lo's" in study_rule.decide(both, runs3, both.contrasts[0])["reason"]  # the worse is named
    runs["late_accuracy"] = np.where(runs["cell"] == "r2@hi", 1.0, 0.5)  # a ceiling: every sample right
    row = study_rule.decide(study, runs, study.contrasts[0])
    assert row["verdict"] == study_rule.UNTESTABLE and row["reason"].startswith("ceiling: 100% of r2@hi's runs")


def test_the_rule_by_hand_at_one_look(tmp_path) -> None:
    """Differences 0.10, 0.06, 0.11 over 3 starts: mean 0.09, se = sd / sqrt(3); one look spends 0.025, so the
    boundary is z 1.96 and the interval is mean +- t(0.975, 2) se; reproduced since t's p < 0.025."""
    study = load_study(_write(tmp_path))
    runs = _runs({"none@hi": [0.0, 0.0, 0.0], "r2@hi": [0.10, 0.06, 0.11]})
    row = study_rule.decide(study, runs, study.contrasts[0])
    d = np.array([0.10, 0.06, 0.11])
    se = d.std(ddof=1) / math.sqrt(3)
    assert row["estimate"] == pytest.approx(0.09) and row["boundary"] == pytest.approx(stats.norm.isf(0.025))
    assert row["lo"] == pytest.approx(0.09 - stats.t.isf(0.025, 2) * se)
    assert row["z"] == pytest.approx(stats.norm.isf(stats.t.sf(0.09 / se, 2)))
    assert row["verdict"] == study_rule.REPRODUCED and row["starts"] == 3


def test_the_rule_names_floors_references_and_what_it_could_detect(tmp_path) -> None:
    study = load_study(_write(tmp_path))
    floor = study_rule.decide(study, _runs({"none@hi": [0, 0, 0], "r2@hi": [0, 0, 0]}, late=0.0), study.contrasts[0])
    assert floor["verdict"] == study_rule.UNTESTABLE and floor["reason"].startswith("floor")
    small = study_rule.decide(study, _runs({"none@hi": [0, 0, 0], "r2@hi": [0.01, -0.01, 0.005]}), study.contrasts[0])
    assert (
        small["verdict"] == study_rule.NOT_REPRODUCED
        and "an effect of +0.05 in the claimed direction" in small["reason"]
    )
    wide = study_rule.decide(study, _runs({"none@hi": [0, 0, 0], "r2@hi": [0.3, -0.2, 0.1]}), study.contrasts[0])
    assert wide["verdict"] == study_rule.INCONCLUSIVE and f"{wide['detectable']:.3f}" in wide["reason"]
    ref = {"requires": {"none@hi": 1, "none@lo": -1}, "requires_below": -0.05}
    gated = load_study(_write(tmp_path, contrasts=[{**BASE["contrasts"][0], **ref}]))
    flat = _runs({"none@hi": [0, 0, 0], "none@lo": [0, 0, 0], "r2@hi": [0.1, 0.06, 0.11]})
    row = study_rule.decide(gated, flat, gated.contrasts[0])
    assert row["verdict"] == study_rule.UNTESTABLE and "does not degrade" in row["reason"]


def test_two_looks_reject_only_past_the_spent_boundary(tmp_path) -> None:
    """At the first of looks (3, 6), O'Brien-Fleming-type spending asks for z >= boundaries([3, 6])[0] (~2.8): the
    same data that reproduce at a single look continue here."""
    study = load_study(_write(tmp_path, unit={"members": "300..305"}, design={**BASE["design"], "looks": [3, 6]}))
    row = study_rule.decide(study, _runs({"none@hi": [0.0, 0.0, 0.0], "r2@hi": [0.10, 0.06, 0.11]}), study.contrasts[0])
    assert row["boundary"] == pytest.approx(boundaries([3, 6])[0]) and row["z"] < row["boundary"]
    assert row["verdict"] == study_rule.INCONCLUSIVE and row["reason"].startswith("continue")


def test_no_difference_is_never_reproduced_and_a_repeated_pair_is_refused(tmp_path) -> None:
    study = load_study(_write(tmp_path))
    same = study_rule.decide(study, _runs({"none@hi": [0.1, 0.2, 0.3], "r2@hi": [0.1, 0.2, 0.3]}), study.contrasts[0])
    assert same["z"] == 0 and same["verdict"] == study_rule.NOT_REPRODUCED  # [0, 0] lies inside the margin
    twice = _runs({"none@hi": [0.0, 0.0, 0.0], "r2@hi": [0.1, 0.2, 0.3]})
    with pytest.raises(ValueError, match="repeat"):
        study_rule.decide(study, pd.concat([twice, twice.iloc[[0]]]), study.contrasts[0])


def test_a_crossing_at_an_early_look_stands_when_later_starts_arrive(tmp_path) -> None:
    """Looks at 3 and 6 starts: the first 3 (members 300-302) differ by exactly +0.2 (z +inf: crossed at look 1);
    3 later starts at -0.3 would pull the mean to -0.05, but the verdict is the first crossing's."""
    study = load_study(_write(tmp_path, unit={"members": "300..305"}, design={**BASE["design"], "looks": [3, 6]}))
    runs = _runs({"none@hi": [0.0] * 6, "r2@hi": [0.2, 0.2, 0.2, -0.3, -0.3, -0.3]})
    row = study_rule.decide(study, runs, study.contrasts[0])
    assert (row["verdict"], row["look"], row["look_starts"]) == (study_rule.REPRODUCED, 1, 3)
    assert row["estimate"] == pytest.approx(0.2) and row["starts"] == 6


def test_the_divergence_ratio_is_the_geometric_mean_over_starts_with_its_t_interval(tmp_path) -> None:
    """The realised KL ratio of r2 over none is exp of the mean per-start log-KL difference, and its interval exp of
    the 95% t interval of those differences (3 degrees of freedom, by hand); the estimate is not adjusted."""
    study = load_study(_write(tmp_path, unit={"members": "300..303"}, design={**BASE["design"], "looks": [4]}))
    d_log = np.array([-0.3, 0.1, 0.2, 0.4])
    runs = _runs({"none@hi": [0.0] * 4, "r2@hi": list(0.02 + 0.1 * d_log)})
    runs["log_kl_acting"] = np.where(runs["cell"] == "r2@hi", np.tile(d_log, 2), 0.0)
    row = study_rule.decide(study, runs, study.contrasts[0])
    half = 3.182446305284263 * d_log.std(ddof=1) / 2  # t(0.975, 3) x sd / sqrt(4)
    assert row["kl_ratio"] == pytest.approx(math.exp(d_log.mean()))
    assert (row["kl_lo"], row["kl_hi"]) == pytest.approx((math.exp(d_log.mean() - half), math.exp(d_log.mean() + half)))
    assert row["estimate"] == pytest.approx(0.02 + 0.1 * d_log.mean())


def test_arms_on_two_models_pair_by_pool_member(tmp_path) -> None:
    """A dense arm's member m is another warm-up than the MoE arm's member m (another start), with the member's
    prompts and seeds: the two pair as the block `member m`, and a repeated seed in one cell is refused."""
    study = load_study(_write(tmp_path))
    runs = _runs({"none@hi": [0.0, 0.0, 0.0], "r2@hi": [0.10, 0.06, 0.11]})
    runs.loc[runs["cell"] == "r2@hi", "start"] = ["d0", "d1", "d2"]
    pairs = study_rule.pair_values(runs, study.contrasts[0].weights, "change")
    assert list(pairs["start"]) == ["member 300", "member 301", "member 302"]
    assert pairs["value"].tolist() == pytest.approx([0.10, 0.06, 0.11])
    same = study_rule.pair_values(
        _runs({"none@hi": [0.0] * 3, "r2@hi": [0.1] * 3}), study.contrasts[0].weights, "change"
    )
    assert list(same["start"]) == ["s0", "s1", "s2"]  # one model: the cold start itself


def test_a_contrast_reads_its_own_outcome_with_its_own_margin(tmp_path) -> None:
    """A contrast of `routing_share` (margin 0.01) beside the study's `change` (margin 0.05): its pairs are the share
    differences (+0.004, -0.002, +0.001: an effect of +0.01 excluded, not reproduced), where under the study's margin the same
    interval would also lie inside; a share difference of 0.02 at every start is reproduced, while `change` is 0."""
    share = {**BASE["contrasts"][0], "name": "share", "outcome": "routing_share", "mde": 0.01, "margin": 0.01}
    study = load_study(_write(tmp_path, contrasts=[BASE["contrasts"][0], share]))
    runs = _runs({"none@hi": [0.0] * 3, "r2@hi": [0.0] * 3})
    runs["routing_share"] = np.where(runs["cell"] == "r2@hi", np.tile([0.104, 0.098, 0.101], 2), 0.1)
    row = study_rule.decide(study, runs, study.contrasts[1])
    assert row["estimate"] == pytest.approx(0.001) and row["verdict"] == study_rule.NOT_REPRODUCED
    assert "an effect of +0.01 in the claimed direction excluded" in row["reason"]
    runs["routing_share"] = np.where(runs["cell"] == "r2@hi", 0.12, 0.1)
    assert study_rule.decide(study, runs, study.contrasts[1])["verdict"] == study_rule.REPRODUCED
    assert study_rule.decide(study, runs, study.contrasts[0])["estimate"] == 0
    assert study.other_outcomes() == ("routing_share",) and "of `routing_share`" in study_claims.rule_text(
        study, share_c := study.contrasts[1]
    )
    assert "an effect of 0.01" in study_claims.rule_text(study, share_c)
    assert "an effect of 0.05" in study_claims.rule_text(study, study.contrasts[0])


def test_a_difference_of_differences_pairs_each_member_across_levels(tmp_path) -> None:
    """(r2 - none)@hi - (r2 - none)@lo, where the two levels start from two warm-ups of each member (a length each):
    member m's value is the four runs' combination, the block its member."""
    ddd = {"name": "growth", "cells": {"r2@hi": 1, "none@hi": -1, "r2@lo": -1, "none@lo": 1}}
    study = load_study(_write(tmp_path, contrasts=[ddd]))
    runs = _runs({"none@hi": [0.0] * 3, "r2@hi": [0.1, 0.2, 0.3], "none@lo": [0.5] * 3, "r2@lo": [0.5, 0.6, 0.6]})
    runs.loc[runs["cell"].str.endswith("@lo"), "start"] += "-lo"
    pairs = study_rule.pair_values(runs, study.contrasts[0].weights, "change")
    assert list(pairs["start"]) == ["member 300", "member 301", "member 302"]
    assert pairs["value"].tolist() == pytest.approx([0.1, 0.1, 0.2])
    assert study_rule.decide(study, runs, study.contrasts[0])["unit"].startswith("pool members")
    plain = load_study(_write(tmp_path))  # r2@hi - none@hi: one level, one warm-up per member
    assert study_rule.decide(plain, runs, plain.contrasts[0])["unit"] == "cold starts"
    some = runs[~((runs["seed"] == 301) & runs["cell"].str.endswith("@lo"))]  # member 301 at one level only
    assert list(study_rule.pair_values(some, study.contrasts[0].weights, "change")["start"]) == [
        "member 300",
        "member 302",
    ]


def test_admission_reads_the_zero_variance_share_of_the_warm_ups_samples(tmp_path) -> None:
    """pass_counts[c]: prompts with c of n samples right; [6, 2, 0] (n = 2) has 6 of 8 prompts without variance
    (0.75); a study admitting at most 0.7 does not admit it, and a study that sets no bound admits every start."""
    assert study_rule.zero_variance_share([6, 2, 0]) == 0.75 and study_rule.zero_variance_share([2, 3, 1]) == 0.5
    assert math.isnan(study_rule.zero_variance_share(None))
    study = load_study(_write(tmp_path, unit={"members": "300..302", "admit": {"max_zero_variance": 0.7}}))
    assert study.admission.admits(0.1, 0.5) and not study.admission.admits(0.1, 0.75)
    assert not study.admission.admits(math.nan, math.nan)  # a bound is set and nothing was recorded
    assert load_study(_write(tmp_path)).admission.admits(math.nan, math.nan)  # no bound: every start


def test_a_look_with_too_few_admitted_starts_spends_nothing(tmp_path) -> None:
    """Looks at 3 and 6 starts; member 302 ran but was not admitted, so look 1 holds 2 starts (below 3) and is
    skipped: the contrast is decided at look 2 on 5 starts, as a single look (the whole alpha), and a pool whose
    every look stays below 3 starts ends inconclusive at its limit rather than waiting for a look that cannot come."""
    study = load_study(_write(tmp_path, unit={"members": "300..305"}, design={**BASE["design"], "looks": [3, 6]}))
    runs = _runs({"none@hi": [0.0] * 6, "r2@hi": [0.10, 0.06, 0.0, 0.11, 0.08, 0.09]})
    admitted = runs[runs["seed"] != 302]
    row = study_rule.decide(study, admitted, study.contrasts[0], ran=set(range(300, 306)))
    assert (row["look"], row["look_starts"], row["starts"]) == (2, 5, 5)
    assert row["boundary"] == pytest.approx(stats.norm.isf(0.025)) and row["verdict"] == study_rule.REPRODUCED
    few = study_rule.decide(study, admitted[admitted["seed"] < 302], study.contrasts[0], ran=set(range(300, 306)))
    assert few["verdict"] == study_rule.INCONCLUSIVE and few["reason"].startswith("pool limit reached with 2 starts")
    early = study_rule.decide(study, admitted[admitted["seed"] < 302], study.contrasts[0], ran={300, 301, 302})
    assert early["reason"].startswith("2 starts: before the first look")


def test_a_look_partly_run_is_not_read(tmp_path) -> None:
    """Looks at 3 and 6 starts: members 303 and 304 ran both cells but 305 only one, so look 2 is not reached and the
    contrast stays at look 1 (its 3 starts, against look 1's boundary of two), whatever the extra pairs say."""
    study = load_study(_write(tmp_path, unit={"members": "300..305"}, design={**BASE["design"], "looks": [3, 6]}))
    runs = _runs({"none@hi": [0.0] * 6, "r2@hi": [0.10, 0.06, 0.11, 0.2, 0.2, 0.2]})
    partial = runs[~((runs["cell"] == "r2@hi") & (runs["seed"] == 305))]
    assert study_rule.complete_members(study, partial) == {300, 301, 302, 303, 304}
    row = study_rule.decide(study, partial, study.contrasts[0])
    assert (row["look"], row["look_starts"], row["starts"]) == (1, 3, 5)
    assert row["boundary"] == pytest.approx(boundaries([3, 6])[0]) and row["reason"].startswith("continue")


def test_the_readme_table_of_a_declared_study(tmp_path) -> None:
    """A shipped contrasts.csv (two contrasts, two outcomes) as README.md prints it, x 100 in each outcome's units, an
    interval only where the look gave one (README.md's blocks: tests/test_divergence.py)."""

    (tmp_path / "s").mkdir()
    rows = [
        {"contrast": "a", "claim": "12", "outcome": "change", "starts": 8, "estimate": 0.021, "lo": -0.01, "hi": 0.052}
        | {"look": 1, "verdict": "inconclusive"},
        {"contrast": "b", "claim": "13", "outcome": "routing_share", "starts": 2, "estimate": -0.004, "lo": math.nan}
        | {"hi": math.nan, "look": 0, "verdict": "inconclusive"},
    ]
    pd.DataFrame(rows).to_csv(tmp_path / "s" / "contrasts.csv", index=False)
    table = study_report.readme_table("s", tmp_path)
    assert table is not None and table.splitlines()[2:] == [
        "| a | 12 | 8 | +2.1 pp [-1.0, +5.2] | 1 | inconclusive |",
        "| b | 13 | 2 | -0.4 points of share | 0 | inconclusive |",
    ]
    assert study_report.readme_table("none", tmp_path) is None
    shipped = study_report.readme_table("length_edge", ROOT / "results")
    assert shipped is not None


@pytest.mark.slow
def test_a_tiny_study_runs_decides_and_reports(tmp_path, cache, monkeypatch) -> None:
    """Two cells x 3 starts of a tiny model: every run lands in its cell's folder from its own new pool member, the
    look decides the contrast and the report's files are written; each run's `drift` is the run mean of its
    off-policy flip rate (2 updates per rollout, route instruments on every step). The launcher runs in this process
    (`run_study`), and so does each `experiments/train.py` multirun it launches (`train_in_process`: the command it
    builds, run by the script's own entry point in a launched run's environment; no interpreter to start)."""
    studies = tmp_path / "studies"
    studies.mkdir()
    overrides = [
        *BASE["overrides"],
        f"cold_start.cache_dir={cache}",
        "optim.updates_per_rollout=2",
        "metrics.route_every=1",
    ]
    _write(studies, overrides=overrides)
    for key, value in TRAIN_ENV.items():  # what the launched runs inherit
        monkeypatch.setenv(key, value)
    launched = train_in_process(monkeypatch, launcher())
    out = run_study("tiny", "--studies", str(studies), "--runs", str(tmp_path), "--jobs", "1")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert len(launched) == 2 and all("-m" in cmd for cmd in launched)  # one multirun per cell
    runs = pd.read_csv(tmp_path / "tiny" / "runs.csv")
    assert sorted(runs["cell"].unique()) == ["none@hi", "r2@hi"] and runs["start"].nunique() == 3
    contrasts = pd.read_csv(tmp_path / "tiny" / "contrasts.csv")
    assert contrasts["starts"].tolist() == [3] and contrasts["verdict"].iloc[0] in (
        study_rule.REPRODUCED,
        study_rule.NOT_REPRODUCED,
        study_rule.INCONCLUSIVE,
        study_rule.UNTESTABLE,
    )
    flips = [
        m.loc[m["key"] == "route/old_vs_new/flip_rate/offpolicy", "value"]
        for m in map(pd.read_parquet, sorted((tmp_path / "tiny" / "runs").glob("*/*/metrics.parquet")))
    ]
    assert [len(f) for f in flips] == [2] * 6 and sorted(runs["drift"]) == sorted(f.mean() for f in flips)
    assert (tmp_path / "tiny" / "forest.png").is_file() and "## Contrasts" in (
        tmp_path / "tiny" / "summary.md"
    ).read_text()


def _rule(**kw) -> tuple[str, str]:
    base = dict(untestable=None, reached=False, reached_reason="z", last=True, lo=-0.02, hi=0.03, margin=0.05)
    return study_rule.verdict(**{**base, "sign": 1.0, "open_reason": "open", **kw})


@pytest.mark.parametrize(
    ("kw", "word"),
    [
        ({"untestable": "floor", "reached": True}, study_rule.UNTESTABLE),  # a floor decides nothing, even a z
        ({"reached": True}, study_rule.REPRODUCED),
        ({}, study_rule.NOT_REPRODUCED),  # inside +-0.05 at the last look
        ({"last": False}, study_rule.INCONCLUSIVE),  # before it, the same interval decides nothing yet
        ({"lo": -0.2, "hi": -0.01}, study_rule.NOT_REPRODUCED),  # wholly against the claimed direction
        ({"lo": 0.01, "hi": 0.2, "sign": -1.0}, study_rule.NOT_REPRODUCED),  # the same for a claimed decrease
        ({"lo": -0.02, "hi": 0.09}, study_rule.INCONCLUSIVE),
        ({"lo": float("nan"), "hi": float("nan")}, study_rule.INCONCLUSIVE),  # no interval: never not reproduced
        ({"reached": True, "exploratory": True}, study_rule.DETECTED),
        ({"exploratory": True}, study_rule.NEGLIGIBLE),
        ({"lo": -0.2, "hi": -0.01, "exploratory": True}, study_rule.AGAINST),
    ],
)
def test_the_one_rule_orders_untestable_reached_not_reproduced_inconclusive(kw: dict, word: str) -> None:
    assert _rule(**kw)[0] == word


@pytest.mark.parametrize(
    ("stopped", "final", "stops", "verdicts"),
    [
        ([True, True], False, True, None),  # every contrast stopped (efficacy, exclusion or futility): stop early
        ([True, False], False, False, None),  # a reference flat at look 1 may degrade later: that contrast goes on
        ([False, False], True, True, None),  # the last look decides whatever it reads
        # stopped by its rule alone, but unmatched (no verdict): the next look reads it on more starts
        ([True, True], False, False, [study_rule.UNMATCHED, study_rule.NEGLIGIBLE]),
        ([True, True], True, True, [study_rule.UNMATCHED, study_rule.NEGLIGIBLE]),  # at the last look it stays so
    ],
)
def test_a_study_stops_early_only_where_every_contrast_stopped(
    stopped: list[bool], final: bool, stops: bool, verdicts: list[str] | None
) -> None:
    verdict = verdicts or study_rule.INCONCLUSIVE
    table = pd.DataFrame({"verdict": verdict, "reason": "", "final": final, "stopped": stopped})
    result = study_rule.StudyResult(pd.DataFrame(), pd.DataFrame(), table, pd.DataFrame(), [], "")
    assert study_rule.decided(result) is stops


def test_holm_steps_down_over_repeated_p_values_by_hand() -> None:
    """At 0.025 over three: 0.004 <= 0.025/3 passes, 0.012 <= 0.025/2 passes, 0.03 > 0.025 fails; with 0.009 first
    instead, 0.009 > 0.025/3 stops the step-down at once."""
    assert study_rule.holm({"a": 0.012, "b": 0.004, "c": 0.03}, 0.025) == {"a": True, "b": True, "c": False}
    assert study_rule.holm({"a": 0.012, "b": 0.009, "c": 0.001}, 0.025) == {"a": True, "b": True, "c": True}
    assert study_rule.holm({"a": 0.012, "b": 0.009}, 0.025) == {"a": True, "b": True}
    assert study_rule.holm({"a": 0.013, "b": 0.014}, 0.025) == {"a": False, "b": False}


def _verdicts(rows: list[dict]) -> pd.DataFrame:
    base = {
        "claim": "1",
        "verdict": study_rule.REPRODUCED,
        "reason": "z 2.50 >= boundary 1.99 at look 3",
        "final": True,
    }
    base |= {"stopped": True, "p_repeated": 0.01, "estimate": 0.03, "margin": 0.05, "kl_ratio": 1.0}
    return pd.DataFrame([{**base, "kl_lo": 0.9, "kl_hi": 1.1, **r} for r in rows])


def test_a_crossing_that_fails_holm_within_its_study_reads_inconclusive(tmp_path) -> None:
    """Two claims, repeated p 0.0137 and 0.5 (router_defaults' claim 9 beside claim 8): 0.0137 > 0.025 / 2, so the
    contrast that reached its own boundary fails Holm and reads inconclusive; an exploratory contrast is outside
    the family."""
    study = load_study(_write(tmp_path))
    v = _verdicts(
        [
            {"contrast": "a", "p_repeated": 0.0137},
            {"contrast": "b", "claim": "2", "verdict": study_rule.NOT_REPRODUCED, "reason": "x", "p_repeated": 0.5},
            {"contrast": "c", "claim": "exploratory", "verdict": study_rule.DETECTED, "p_repeated": 0.001},
        ]
    )
    out = study_rule.correct(study, v).set_index("contrast")
    assert out.loc["a", "verdict"] == study_rule.INCONCLUSIVE and out.loc["a", "holm"] == "fails"
    assert "not Holm's across the study's 2 claims" in out.loc["a", "reason"]
    assert out.loc["b", "verdict"] == study_rule.NOT_REPRODUCED and out.loc["c", "verdict"] == study_rule.DETECTED


def test_a_matched_contrast_outside_its_tolerance_or_beside_a_failed_placebo_reads_unmatched(tmp_path) -> None:
    """match.tolerance 1.05: a ratio of 0.916 (claim 15's) is outside [0.952, 1.05], 1.02 inside; a placebo reading
    +7 pp against a 5 pp margin makes every matched contrast unmatched, whatever its ratio."""
    contrasts = [
        {"name": n, "claim": c, "cells": {"r2@hi": 1, "none@hi": -1}} for n, c in (("a", "1"), ("b", "2"), ("p", "x"))
    ]
    study = load_study(_write(tmp_path, contrasts=contrasts, match={"tolerance": 1.05, "placebo": "p"}))
    rows = [
        {"contrast": "a", "kl_ratio": 0.916},
        {"contrast": "b", "claim": "2", "kl_ratio": 1.02, "p_repeated": 0.001},
    ]
    ok = study_rule.correct(study, _verdicts([*rows, {"contrast": "p", "claim": "x", "estimate": 0.01}]))
    ok = ok.set_index("contrast")
    assert ok.loc["a", "verdict"] == study_rule.UNMATCHED and "0.916" in ok.loc["a", "reason"]
    assert ok.loc["b", "verdict"] == study_rule.REPRODUCED
    off = study_rule.correct(study, _verdicts([*rows, {"contrast": "p", "claim": "x", "estimate": 0.07}]))
    off = off.set_index("contrast")
    assert off.loc["b", "verdict"] == study_rule.UNMATCHED and "the placebo (p) reads +7.0 pp" in off.loc["b", "reason"]
    assert off.loc["p", "verdict"] == study_rule.REPRODUCED  # the placebo itself is read, not judged


def test_a_relative_margin_is_a_share_of_the_references_own_loss(tmp_path) -> None:
    """The reference loses 6 pp at every start; r2 - none averages +1 pp over 6 starts (SD 2.3 pp: one-sided upper
    bound +3.4 pp). Against the absolute 5 pp margin the claimed effect is excluded (not reproduced); against a
    third of the loss (2 pp) it is not (inconclusive), and the absolute margin is still reported."""
    contrast = {**BASE["contrasts"][0], "requires": {"none@hi": 1}, "requires_below": -0.05}
    raw = {"unit": {"members": "300..305"}, "contrasts": [contrast]}
    runs = _runs({"none@hi": [-0.06] * 6, "r2@hi": [-0.02, -0.075, -0.04, -0.07, -0.03, -0.065]})
    absolute = load_study(_write(tmp_path, **raw, design={**BASE["design"], "looks": [6]}))
    relative = load_study(_write(tmp_path, **raw, design={**BASE["design"], "looks": [6], "margin_relative": 1 / 3}))
    a = study_rule.decide(absolute, runs, absolute.contrasts[0])
    r = study_rule.decide(relative, runs, relative.contrasts[0])
    assert a["verdict"] == study_rule.NOT_REPRODUCED and a["margin"] == pytest.approx(0.05)
    assert r["margin"] == pytest.approx(0.02) and r["margin_absolute"] == pytest.approx(0.05)
    assert r["verdict"] == study_rule.INCONCLUSIVE


def _read_tiny_matched_study(tmp_path, monkeypatch) -> None:
    """A matched study `tiny` in tmp_path/study whose analysis (patched) reads claim 2 and its placebo at look 1."""
    raw = {
        **BASE,
        "arms": {**BASE["arms"], "placebo": {"overrides": ["replay=none", "optim.weight_decay=0.01"]}},
        "contrasts": [
            {"name": "r2_minus_none", "claim": "2", "cells": {"r2@hi": 1, "none@hi": -1}},
            {"name": "placebo_minus_none", "claim": "exploratory", "cells": {"placebo@hi": 1, "none@hi": -1}},
        ],
        "match": {"placebo": "placebo_minus_none", "tolerance": 1.05},
    }
    folder = tmp_path / "study"
    folder.mkdir()
    (folder / "tiny.yaml").write_text(yaml.safe_dump(raw))
    row = {"starts": 8, "outcome": "change", "look": 1, "verdict": "inconclusive", "reason": "open"}
    verdicts = pd.DataFrame(
        [
            {**row, "contrast": "r2_minus_none", "claim": "2", "estimate": 0.031, "lo": -0.02, "hi": 0.08}
            | {"read_on": "qwen3_moe E=64; routing's share 45%", "kl_ratio": 0.97, "kl_lo": 0.9, "kl_hi": 1.04},
            {**row, "contrast": "placebo_minus_none", "claim": "exploratory", "estimate": -0.004, "lo": -0.03}
            | {"hi": 0.02, "read_on": "", "kl_ratio": float("nan"), "kl_lo": float("nan"), "kl_hi": float("nan")},
        ]
    )
    result = study_rule.StudyResult(pd.DataFrame(), pd.DataFrame(), verdicts, pd.DataFrame(), [], "")
    monkeypatch.setattr(study_claims, "analyse", lambda study, runs: result)


def test_a_claims_section_shows_where_each_verdict_was_read_and_the_placebo(tmp_path, monkeypatch) -> None:
    """CLAIMS.md's section of a declared study: each claim's row with the routing share it was read at and its
    realised divergence ratio (matched or not), and the placebo's reading beside them."""
    _read_tiny_matched_study(tmp_path, monkeypatch)
    lines = study_claims.claims_section("tiny", "Claim 2 on a rung", ("2",))(tmp_path, tmp_path / "preset")
    table = [line for line in lines if line.startswith("| 2 ")]
    assert table == [
        "| 2 | r2_minus_none | 8 | +3.1 pp [-2.0, +8.0] | 1 | **inconclusive** | open | qwen3_moe E=64; routing's share "
        "45% | 0.97 [0.90, 1.04], matched within [0.952, 1.05] |"
    ]
    assert lines[-2] == (
        "The placebo `placebo_minus_none` (the reference against itself at another lr, matched back like any arm) "
        "reads -0.4 pp [-3.0, +2.0]: inconclusive (open)."
    )


def test_a_rung_reading_is_the_claims_cell_of_the_claim_table_and_the_registry_names_its_studies(
    tmp_path, monkeypatch
) -> None:
    """A study whose section names a rung gives each of its claims one cell of the claim table's rung column: the
    verdict, difference [repeated CI], starts, look, where it was read and the divergence ratio, then the reason; a
    claim of another contrast or the placebo gets none. The registry's rung studies are the three on the ladder's
    routing-dominant rung."""
    from moe_rl import studies

    _read_tiny_matched_study(tmp_path, monkeypatch)
    cells = study_claims.rung_readings("tiny", ("2",))(tmp_path, tmp_path / "preset")
    assert cells == {
        2: "inconclusive: +3.1 pp [-2.0, +8.0], 8 starts, look 1 (tiny: r2_minus_none; qwen3_moe E=64; routing's "
        "share 45%; divergence ratio 0.97 [0.90, 1.04], matched within [0.952, 1.05]); open"
    }
    assert study_claims.rung_readings("tiny", ("9",))(tmp_path, tmp_path / "preset") == {}
    rungs = {s.folder: s.rung for s in studies.registry(ROOT / "experiments" / "conf" / "preset") if s.rung}
    names = ("routing_dominant", "routing_dominant_mechanism", "routing_dominant_anchoring")
    assert rungs == {n: "64 experts, top-2, 4 layers" for n in names}


def test_the_divergence_note_says_whether_a_matched_contrast_landed_inside_its_tolerance() -> None:
    from moe_rl.studies.study_claims import divergence_text

    study = load_study(STUDIES / "dense_matched.yaml")  # tolerance 1.05: [0.952, 1.05]
    row = pd.Series({"kl_ratio": 0.937, "kl_lo": 0.83, "kl_hi": 1.06})
    assert divergence_text(study, row, "dense_total_mup_minus_moe") == (
        "0.94 [0.83, 1.06], outside its declared match [0.952, 1.05]"
    )
    row["kl_ratio"] = 0.96
    assert divergence_text(study, row, "dense_total_mup_minus_moe").endswith(", matched within [0.952, 1.05]")
