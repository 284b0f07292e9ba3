"""The divergence frontier: the crossing of an isotonic fit, its bootstrap over starts, the lr^2 N test, the study."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from helpers import PRESETS, ROOT

from moe_rl.analysis.clustered import bootstrap, start_draws
from moe_rl.analysis.dose import crossing, isotonic_fit, law_exponent
from moe_rl.analysis.pages import readme_block, write_readme_block
from moe_rl.studies import divergence as dv
from moe_rl.studies import divergence_report as dr
from moe_rl.studies import frontier as fr_

KL = [1e-3, 1e-2, 1e-1]
CHANGE = [0.0, -0.04, -0.10]
CROSS = 1e-2 * 10 ** (1 / 6)  # between 1e-2 (-4 pp) and 1e-1 (-10 pp): 1/6 of the way in log KL


def test_the_crossing_interpolates_in_log_kl_between_the_runs_either_side() -> None:
    assert crossing(KL, CHANGE, -0.05) == pytest.approx(CROSS, rel=1e-12)


def test_runs_at_one_kl_enter_the_fit_as_their_mean_whatever_their_order() -> None:
    kl, change = [1.0, 1.0, 2.0, 2.0, 4.0, 4.0], [0.0, -0.1, 0.0, -0.1, -0.2, -0.2]
    x, fit = isotonic_fit(np.log(kl), np.array(change))
    assert np.allclose(np.exp(x), [1, 2, 4]) and np.allclose(fit, [-0.05, -0.05, -0.2])
    order = [5, 0, 3, 1, 4, 2]
    assert crossing(kl, change, -0.06) == crossing([kl[i] for i in order], [change[i] for i in order], -0.06)


def test_the_fit_is_non_increasing_and_pools_a_rise() -> None:
    """A rise (-10 pp then 0) is pooled to its mean: the fit is [0, -5, -5, -20] pp and crosses -6 pp 1/15 of the way
    from 3 to 4 (log scale)."""
    x, fit = isotonic_fit(np.log([1.0, 2.0, 3.0, 4.0]), np.array([0.0, -0.1, 0.0, -0.2]))
    assert np.allclose(fit, [0.0, -0.05, -0.05, -0.2]) and np.allclose(np.exp(x), [1, 2, 3, 4])
    assert crossing([4.0, 1.0, 3.0, 2.0], [-0.2, 0.0, 0.0, -0.1], -0.06) == pytest.approx(3 * (4 / 3) ** (1 / 15))


def test_a_crossing_outside_the_kls_seen_is_censored() -> None:
    assert crossing(KL, [0.1, 0.0, -0.01], -0.05) == math.inf  # never below: past the largest KL
    assert crossing(KL, [-0.06, -0.1, -0.2], -0.05) == 0.0  # below from the first run
    assert math.isnan(crossing([0.0, math.nan], [0.0, 0.0], -0.05))  # no run with a KL > 0


def test_start_draws_resample_starts_then_seeds_within_each() -> None:
    units = pd.DataFrame({"start": ["a", "a", "b", "b", "c", "c"], "seed": [0, 6, 1, 7, 2, 8]})
    draws = start_draws(units, n_resamples=300, seed=3)
    own = {"a": {0, 6}, "b": {1, 7}, "c": {2, 8}}
    assert all(len(r) == 6 and all(seed in own[start] for start, seed in r) for r in draws)
    starts = [sorted({s for s, _ in r}) for r in draws]
    assert any(len(s) < 3 for s in starts)  # starts are drawn with replacement
    assert draws == start_draws(units, n_resamples=300, seed=3)  # one seed, one set of draws


def test_bootstrap_of_a_constant_has_no_width_and_counts_nans() -> None:
    runs = pd.DataFrame({"start": list("aabbcc"), "seed": [0, 0, 1, 1, 2, 2], "v": [2.0] * 6})
    draws = start_draws(runs[["start", "seed"]], n_resamples=200)
    assert bootstrap(runs, lambda r: float(r["v"].mean()), draws) == (2.0, 2.0, 2.0, 0.0)
    est, lo, hi, share = bootstrap(runs, lambda r: math.nan, draws)
    assert math.isnan(est) and math.isnan(lo) and share == 1.0


def test_the_law_exponent_is_recovered_exactly_from_planted_runs() -> None:
    """log KL = row + 2 log lr + 1 log N: b / c = 2 (lr^2 N); with c doubled it reads 1 (lr N)."""
    rows = [(r, lr, n) for r in ("a", "b") for lr in (1e-4, 2e-4, 4e-4) for n in (2, 8)]
    frame = pd.DataFrame(rows, columns=["row", "lr", "N"])
    offset = frame["row"].map({"a": 0.0, "b": 1.5})
    frame["log_kl"] = offset + 2 * np.log(frame["lr"]) + np.log(frame["N"])
    assert law_exponent(frame) == pytest.approx(2.0)
    frame["log_kl"] = offset + 2 * np.log(frame["lr"]) + 2 * np.log(frame["N"])
    assert law_exponent(frame) == pytest.approx(1.0)
    assert math.isnan(law_exponent(frame[frame["N"] == 2]))  # N does not vary: no exponent


def planted(rows: dict[str, float], starts: int = 6, n: int = 8) -> pd.DataFrame:
    """Per row a KL multiplier: every start runs the three lrs with KL x multiplier and the changes of CHANGE."""
    out = []
    for name, mult in rows.items():
        for s in range(starts):
            for lr, kl, change in zip((7e-5, 1.4e-4, 2.8e-4), KL, CHANGE, strict=True):
                out.append(
                    {"row": name, "family": "qwen3_moe", "arm_file": name, "lr": lr, "N": n, "seed": s,
                     "start": f"s{s}", "kl_early": kl * mult, "change": change, "collapsed": False}
                )  # fmt: skip
    return pd.DataFrame(out)


def _spec(rows: tuple[str, ...]) -> dv.Spec:
    return dv.Spec(
        tuple(("qwen3_moe", r) for r in rows), (7e-5, 1.4e-4, 2.8e-4), {}, 8, tuple(range(6)), 2, (), (), -0.05
    )


def test_the_table_gives_each_row_its_crossing_and_headroom_paired_on_starts() -> None:
    """Runs at an undeclared lr (a grid amended after a look) stay out of the fit."""
    runs = planted({"grpo_none": 1.0, "sapo_none": 2.0})
    off_grid = runs.iloc[:6].assign(lr=3.5e-5, change=-0.5, kl_early=1e-5)  # would put the crossing below the grid
    runs = pd.concat([runs, off_grid], ignore_index=True)
    spec = _spec(("grpo_none", "sapo_none"))
    draws = {"qwen3_moe": start_draws(runs[["start", "seed"]], n_resamples=200)}
    table = dv.frontier_table(runs, spec, draws).set_index("row")
    assert table.loc["grpo_none", "crossing"] == pytest.approx(CROSS)
    assert table.loc["sapo_none", "crossing"] == pytest.approx(2 * CROSS)
    # every start gives the same curve: each draw's ratio is 2 exactly, so the paired interval has no width
    assert table.loc["sapo_none", ["headroom", "headroom_lo", "headroom_hi"]].tolist() == pytest.approx([2.0] * 3)
    assert table.loc["grpo_none", "starts"] == 6 and table.loc["grpo_none", "seeds"] == 1
    assert table.loc["grpo_none", "descriptive"] == ""
    few = dv.frontier_table(planted({"grpo_none": 1.0}, starts=4), _spec(("grpo_none",))).iloc[0]
    assert few["descriptive"].startswith("descriptive: 4") and math.isnan(few["crossing_lo"])
    assert "not run yet" in dr.format_table(dv.frontier_table(runs, _spec(("grpo_none", "vespo_none")), draws), spec)


def test_matched_pairs_compare_equal_lr2n_and_equal_lrn_points() -> None:
    """grpo+none at (2.8e-4, N 2) and (1.4e-4, N 8) share lr^2 N; (5.6e-4, N 2) and (1.4e-4, N 8) share lr N."""
    out = []
    for s in range(5):
        for lr, n, change, kl in ((2.8e-4, 2, 0.10, 0.01), (5.6e-4, 2, -0.20, 0.04), (1.4e-4, 8, 0.09, 0.01)):
            out.append(
                {"arm_file": "grpo_none", "family": "qwen3_moe", "lr": lr, "N": n, "seed": s, "start": f"s{s}",
                 "change": change + 0.01 * s, "kl_early": kl}
            )  # fmt: skip
    spec = dv.Spec((("qwen3_moe", "grpo_none"),), (1.4e-4,), {}, 8, (), 2, ("grpo_none",), (2.8e-4, 5.6e-4), -0.05)
    pairs = dv.matched_pairs(pd.DataFrame(out), spec).set_index("equal")
    assert pairs.loc["lr^2 N", "change_diff"] == pytest.approx(0.01) and pairs.loc["lr^2 N", "starts"] == 5
    assert pairs.loc["lr N", "change_diff"] == pytest.approx(-0.29) and pairs.loc["lr N", "kl_ratio"] == pytest.approx(
        4
    )


def test_the_declaration_gives_the_frontier_its_rows_grid_and_law() -> None:
    """The frontier's spec read from experiments/conf/study/divergence.yaml: the MoE rows first (GRPO the reference),
    the dense control at its own lrs, the N = 2 block at twice the MoE lrs (equal lr^2 N one octave down), and the
    runs of the amended grid (x0.5) kept out of the fits."""
    from moe_rl.studies.design import load_study

    study = load_study(PRESETS.parent / "study" / "divergence.yaml")
    spec = dv.spec_of(study)
    assert spec.rows[0] == dv.REFERENCE and spec.rows[-1] == ("qwen3_dense", "grpo_none") and len(spec.rows) == 9
    assert spec.lrs == (1.4e-4, 2.8e-4, 5.6e-4) and spec.lrs_by_family == {"qwen3_dense": (2.8e-4, 5.6e-4, 1.12e-3)}
    assert (spec.N, spec.law_N, spec.law_rows) == (8, 2, ("grpo_none",)) and spec.law_lrs == (2.8e-4, 5.6e-4, 1.12e-3)
    assert all(a**2 * 2 == pytest.approx(b**2 * 8) for a, b in zip(spec.law_lrs, spec.lrs, strict=True))
    table = pd.DataFrame(
        {"arm": ["grpo", "grpo", "grpo_N2", "dense_grpo"], "level": ["x1", "x0.5", "x1", "x4"], "kl_acting": 0.01}
    )
    runs = dv.runs_of(study, table)
    assert runs[["family", "arm_file", "N"]].values.tolist()[2:] == [
        ["qwen3_moe", "grpo_none", 2],
        ["qwen3_dense", "grpo_none", 8],
    ]
    assert runs["lr"].tolist() == pytest.approx([1.4e-4, 7e-5, 2.8e-4, 1.12e-3])
    assert list(dv.declared(runs, spec).index) == [0, 2, 3]  # the x0.5 run stays out


def test_the_frontier_keeps_runs_of_one_config_from_two_starts() -> None:
    one = {"family": "qwen3_moe", "arm_file": "grpo_none", "lr": 3e-4, "N": 8, "seed": 0}
    frames = [pd.DataFrame([{**one, "start": "a"}]), pd.DataFrame([{**one, "start": "b"}, {**one, "start": "a"}])]
    assert sorted(fr_.combine(frames)["start"]) == ["a", "b"]


def test_the_readme_table_is_the_shipped_one() -> None:
    """README.md's divergence table is generated from results/divergence/divergence.csv (`report --readme`)."""
    table = dr.read_table(ROOT / "results")
    assert table is not None, "results/divergence/divergence.csv is shipped"
    assert readme_block(ROOT / "README.md", dr.README_BLOCK) == dr.compact_table(table)


def test_the_declared_studies_readme_tables_are_the_shipped_ones() -> None:
    """Each declared study that names `readme` has its table in README.md as `report --readme` writes it from its
    shipped contrasts.csv (causal and length_edge)."""
    from moe_rl.studies import study_report

    tables = study_report.readme_tables(ROOT / "experiments" / "conf" / "study")
    assert {markers[0].split()[1] for markers, _ in tables} >= {"causal", "length_edge"}
    for markers, table in tables:
        shipped = table(ROOT / "results")
        assert shipped is not None and readme_block(ROOT / "README.md", markers) == shipped, markers


def test_a_readme_block_is_replaced_between_its_markers_and_refused_without_them(tmp_path) -> None:
    page = tmp_path / "README.md"
    page.write_text("a\n<!-- s -->\nold\n<!-- e -->\nb\n")
    assert write_readme_block(page, ("<!-- s -->", "<!-- e -->"), "new\n") == page
    assert page.read_text() == "a\n<!-- s -->\nnew\n<!-- e -->\nb\n"
    assert write_readme_block(page, ("<!-- s -->", "<!-- e -->"), None) is None  # nothing shipped: unchanged
    with pytest.raises(ValueError, match="has no markers"):
        write_readme_block(page, ("<!-- x -->", "<!-- e -->"), "new\n")


def test_start_covariates_read_each_starts_meta_and_fall_back_for_older_runs(tmp_path) -> None:
    import json

    from moe_rl.analysis.configs import format_starts, start_covariates

    new, old = tmp_path / "a", tmp_path / "b"
    covariates = {"greedy_accuracy": 0.4, "sampled_reward": 0.15, "sampled_entropy": 1.1, "sft_steps": 75}
    covariates["pass_counts"] = [5, 2, 0, 1]  # prompts with 0, 1, 2, 3 of 3 samples right
    for folder, block in ((new, {"key": "k1", "covariates": covariates}), (old, {"key": "k2", "steps": 50})):
        folder.mkdir()
        (folder / "meta.json").write_text(json.dumps({"cold_start": {**block, "accuracy": 0.3}}))
    runs = pd.DataFrame({"family": ["m", "m", "m"], "start": ["k1", "k1", "k2"], "run_dir": [new, new, old]})
    table = start_covariates(runs).set_index("start")
    assert table.loc["k1", "sampled_reward"] == 0.15 and table.loc["k1", "runs"] == 2
    assert table.loc["k2", "sft_steps"] == 50 and table.loc["k2", "greedy_accuracy"] == 0.3
    assert math.isnan(table.loc["k2", "sampled_reward"])
    text = format_starts(table.reset_index())
    assert "| m | k2 | — | 50 | 0.300 | — | — | — | 1 |" in text
    assert (
        "| m | k1 | — | 75 | 0.400 | 0.150 | 1.10 | 5/2/0/1 | 2 |" in text
        and table.loc["k1", "pass_counts"] == "5 2 0 1"
    )
