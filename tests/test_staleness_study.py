"""The staleness study: points at equal updates, edges on log(1 + age), claims 10 and 11 on the papers' axes."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from helpers import PRESETS

from moe_rl.analysis.claims.rules import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, UNTESTABLE_HERE
from moe_rl.studies import staleness as st
from moe_rl.studies import staleness_claims as sc

S_AXIS = st.Axis("rollout.staleness", (1, 2, 4, 8), ("grpo_none", "sapo_none", "vespo_none"))
LAG_AXIS = st.Axis("rollout.policy_lag", (0, 4, 8, 16), ("grpo_none", "dppo_tv_none", "cispo_none", "is_none"))


def test_every_point_makes_the_same_updates_and_the_base_point_is_shared() -> None:
    spec = st.load_spec(PRESETS)
    assert len(spec.seeds) >= 6
    assert st.overrides(spec, spec.axis("rollout.staleness"), 1) == []
    assert st.overrides(spec, spec.axis("rollout.policy_lag"), 0) == []
    assert st.overrides(spec, spec.axis("rollout.staleness"), 8) == ["rollout.staleness=8", "steps=24", "eval_every=3"]
    assert st.overrides(spec, spec.axis("rollout.policy_lag"), 4) == ["rollout.policy_lag=4"]
    jobs = st.jobs(spec)
    first = [a for a in spec.axes if a.seeds == spec.seeds]
    assert jobs[0][1] == [] and set(jobs[0][0]) == {a for axis in first for a in axis.rows}
    assert sum(1 for _, o, _ in jobs if not o) == 2  # the base point: one multirun per block's seeds
    long = spec.axis("staleness_long")
    assert long.name == "rollout.staleness" and not set(long.seeds) & set(spec.seeds)  # seeds no other block ran
    assert [j for j in st.jobs(spec, ("staleness_long",)) if not j[1]] == [(long.rows, [], long.seeds)]
    assert st.overrides(spec, long, 24) == ["rollout.staleness=24", "steps=8", "eval_every=1"]
    with pytest.raises(ValueError, match="no axis nope"):
        st.jobs(spec, ("nope",))
    with pytest.raises(ValueError, match="must divide"):
        st.overrides(spec, spec.axis("rollout.staleness"), 5)


def _points(axis: st.Axis, changes: list[float]) -> pd.DataFrame:
    return pd.DataFrame({"age": [axis.age(v) for v in axis.values], "change": changes})


def test_the_edge_is_read_back_in_the_axis_units() -> None:
    """Change 0 at S = 2 and -10 pp at S = 4: -5 pp halfway in log(1 + age) between 2 and 4, i.e. S = sqrt(8); on the
    lag axis between k = 4 and 8 it is 1 + age = sqrt(45): k = sqrt(45) - 1."""
    assert st.edge(_points(S_AXIS, [0.0, 0.0, -0.1, -0.1]), S_AXIS, -0.05) == pytest.approx(math.sqrt(8))
    assert st.edge(_points(LAG_AXIS, [0.0, 0.0, -0.1, -0.1]), LAG_AXIS, -0.05) == pytest.approx(math.sqrt(45) - 1)
    assert st.edge(_points(S_AXIS, [0.0] * 4), S_AXIS, -0.05) == math.inf  # past the grid
    assert st.edge(_points(S_AXIS, [-0.2] * 4), S_AXIS, -0.05) == -math.inf  # below its first value


def _run(monkeypatch, tmp_path, axis: str, draws: dict[str, list[float]], earlier: dict | None = None):
    """The claims read `draws` on `axis` (and `earlier` on the first block's axes, where given)."""

    def one(draws: dict[str, list[float]]) -> tuple[pd.DataFrame, dict]:
        table = pd.DataFrame({"row": list(draws), "edge": [d[0] for d in draws.values()], "edge_lo": 0.0})
        table["edge_hi"], table["descriptive"] = 0.0, ""
        return table, {k: np.array(v, dtype=float) for k, v in draws.items()}

    axes = {axis: one(draws), **{k: one(v) for k, v in (earlier or {}).items()}}
    monkeypatch.setattr(sc, "_axes", lambda root, presets: axes)
    monkeypatch.setattr(sc.frontier_claims, "claim_vespo_staleness", lambda root, presets: sc.Claim(10, "", "", "old"))
    monkeypatch.setattr(sc.frontier_claims, "claim_no_trust_region", lambda root, presets: sc.Claim(11, "", "", "old"))


INF = math.inf


@pytest.mark.parametrize(
    ("vespo", "grpo", "sapo", "verdict"),
    [([8.0] * 100, [2.0] * 100, [1.5] * 100, REPRODUCED), ([INF] * 100, [2.0] * 100, [2.0] * 100, REPRODUCED),
     ([6.0] * 100, [2.0] * 100, [1.5] * 100, INCONCLUSIVE), ([2.0] * 100, [2.0] * 100, [3.0] * 100, NOT_REPRODUCED),
     ([INF] * 100, [INF] * 100, [INF] * 100, UNTESTABLE_HERE),  # nobody degrades on the grid: nothing to order
     ([INF] * 100, [2.0] * 50 + [INF] * 50, [2.0] * 50 + [INF] * 50, INCONCLUSIVE),  # half the draws tie, censored
     ([-INF] * 100, [2.0] * 100, [3.0] * 100, NOT_REPRODUCED),  # vespo below the grid: at or below both
     ([-INF] * 100, [-INF] * 100, [-INF] * 100, INCONCLUSIVE),  # all below the grid: ties order nothing
     ([8.0] * 99 + [1.0] * 1, [2.0] * 100, [2.0] * 100, REPRODUCED),  # 99% >= 1 - 0.05 / 3 (three looks)
     ([8.0] * 98 + [1.0] * 2, [2.0] * 100, [2.0] * 100, INCONCLUSIVE)],  # 98% < 98.33%
)  # fmt: skip
def test_claim_10_reads_paired_draws_with_censoring_and_three_looks(monkeypatch, tmp_path, vespo, grpo, sapo, verdict):
    _run(monkeypatch, tmp_path, "staleness_long", {"vespo_none": vespo, "grpo_none": grpo, "sapo_none": sapo})
    c = sc.claim_vespo_staleness(tmp_path, PRESETS)
    assert c.verdict == verdict and any(n.startswith("first look (counted)") for n in c.notes)
    assert any(n.startswith("second look (counted), on rollout.staleness to S = 8") for n in c.notes)


def test_claim_10s_second_look_is_read_at_two_looks_and_kept_in_the_notes(monkeypatch, tmp_path) -> None:
    """The first block's axis decided claim 10 while it was the second of two looks (97.5%): its verdict is kept, at
    that level, beside the third look that decides."""
    ninety_eight = {"vespo_none": [8.0] * 98 + [1.0] * 2, "grpo_none": [2.0] * 100, "sapo_none": [2.0] * 100}
    _run(monkeypatch, tmp_path, "staleness_long", ninety_eight, {"rollout.staleness": ninety_eight})
    c = sc.claim_vespo_staleness(tmp_path, PRESETS)
    second = next(n for n in c.notes if n.startswith("second look"))
    assert c.verdict == INCONCLUSIVE and second.startswith(
        f"second look (counted), on rollout.staleness to S = 8 (seeds 0..5): {REPRODUCED}"
    )


def test_claim_11_needs_all_four_pairs_and_a_censored_tie_decides_nothing(monkeypatch, tmp_path) -> None:
    ok = {"cispo_none": [2.0] * 50, "is_none": [1.0] * 50, "grpo_none": [INF] * 50, "dppo_tv_none": [4.0] * 50}
    _run(monkeypatch, tmp_path, "staleness_long", ok)
    assert sc.claim_no_trust_region(tmp_path, PRESETS).verdict == REPRODUCED
    _run(monkeypatch, tmp_path, "staleness_long", {**ok, "cispo_none": [4.0] * 50})  # ties DPPO: at or above
    assert sc.claim_no_trust_region(tmp_path, PRESETS).verdict == NOT_REPRODUCED
    _run(monkeypatch, tmp_path, "staleness_long", {**ok, "dppo_tv_none": [-INF] * 50})  # IS above DPPO
    assert sc.claim_no_trust_region(tmp_path, PRESETS).verdict == NOT_REPRODUCED
    censored = {k: [INF] * 50 for k in ok}
    _run(monkeypatch, tmp_path, "staleness_long", censored)
    assert sc.claim_no_trust_region(tmp_path, PRESETS).verdict == UNTESTABLE_HERE
    _run(monkeypatch, tmp_path, "rollout.policy_lag", ok)  # only the first block's axis run: the claim waits
    c = sc.claim_no_trust_region(tmp_path, PRESETS)
    assert c.verdict == INCONCLUSIVE and c.reason == "no data"
    assert any(
        n.startswith(f"second look (counted), on rollout.policy_lag (seeds 0..5): {REPRODUCED}") for n in c.notes
    )


def test_claim_11_says_which_arms_the_lag_cannot_tell_apart(monkeypatch, tmp_path) -> None:
    """At one update per rollout the decoupled ratio is 1: GRPO, DPPO-TV and plain IS make the same runs, and the
    claim says so (from equal changes at every lag), not where they differ."""
    draws = {k: [INF] * 10 for k in ("cispo_none", "is_none", "grpo_none", "dppo_tv_none")}
    _run(monkeypatch, tmp_path, "staleness_long", draws, {"rollout.policy_lag": draws})
    assert not any("same runs" in n for n in sc.claim_no_trust_region(tmp_path, PRESETS).notes)  # no changes: no note
    table = sc._axes(tmp_path, PRESETS)["rollout.policy_lag"][0]
    table["change@0"], table["change@4"] = 0.19, [0.21, 0.11, 0.11, 0.11]  # cispo differs, the other three agree
    notes = sc.claim_no_trust_region(tmp_path, PRESETS).notes
    assert any("; grpo_none, dppo_tv_none, is_none are the same runs" in n for n in notes)
    table["change@4"] = [0.21, 0.11, 0.11, 0.12]  # dppo_tv differs at one lag
    notes = sc.claim_no_trust_region(tmp_path, PRESETS).notes
    assert any("; grpo_none, is_none are the same runs" in n for n in notes)


def test_without_runs_the_claims_say_how_to_get_them(tmp_path) -> None:
    sc._axes.cache_clear()
    c = sc.claim_vespo_staleness(tmp_path, PRESETS)
    assert c.verdict == INCONCLUSIVE and c.reason == "no data" and any("experiments/staleness.py" in n for n in c.notes)


def test_a_row_has_an_edge_only_once_every_value_has_five_starts() -> None:
    """Runs at S = 1 and 2 only: no edge, and the reason names the values not run; 4 starts at every value:
    an edge, but descriptive."""
    spec = st.Spec((S_AXIS,), 192, 24, tuple(range(6)), -0.05)

    def runs(values: tuple[int, ...], starts: int) -> pd.DataFrame:
        rows = [
            {"family": "qwen3_moe", "arm_file": "grpo_none", "S": v, "lag": 0, "start": f"s{s}", "seed": s,
             "change": 0.1 - 0.05 * v, "collapsed": False}
            for v in values for s in range(starts)
        ]  # fmt: skip
        return pd.DataFrame(rows)

    table, _ = st.axis_table(runs((1, 2), 6), spec, S_AXIS, draws=[])
    grpo = table.set_index("row").loc["grpo_none"]
    assert math.isnan(grpo["edge"]) and grpo["descriptive"] == "incomplete: no runs yet at 4, 8"
    table, _ = st.axis_table(runs((1, 2, 4, 8), 4), spec, S_AXIS, draws=[])
    grpo = table.set_index("row").loc["grpo_none"]
    assert grpo["edge"] == pytest.approx(st.edge(st.on_axis(runs((1, 2, 4, 8), 4), S_AXIS), S_AXIS, -0.05))
    assert grpo["descriptive"].startswith("descriptive: 4")


def test_a_block_reads_only_its_own_seeds() -> None:
    """grpo_none runs at S = 8 from seeds 0 and 6: the first block's axis (seeds 0..5) reads seed 0's, the
    staleness_long block (seeds 6..17) seed 6's, so neither block's rows mix in the other's starts."""
    spec = st.load_spec(PRESETS)
    runs = pd.DataFrame(
        {"family": "qwen3_moe", "arm_file": "grpo_none", "S": 8, "lag": 0, "seed": [0, 6], "start": ["a", "b"],
         "change": [0.1, -0.1], "collapsed": False}
    )  # fmt: skip
    assert st.on_axis(runs, spec.axis("rollout.staleness"))["seed"].tolist() == [0]
    assert st.on_axis(runs, spec.axis("staleness_long"))["seed"].tolist() == [6]
    tables = st.axis_tables(runs, spec)  # one table per block, though two share an override
    assert set(tables) == {"rollout.staleness", "rollout.policy_lag", "staleness_long"}
    first, long = tables["rollout.staleness"][0].set_index("row"), tables["staleness_long"][0].set_index("row")
    assert first.loc["grpo_none", "change@8"] == 0.1 and long.loc["grpo_none", "change@8"] == -0.1


def test_the_span_loss_pairs_the_grid_ends_on_start_and_seed() -> None:
    """Change at S = 24 minus at S = 1, per (start, seed) pair, then the mean of the starts' means: start s loses
    0.01 * s on both of its seeds, so 6 starts give -0.025 with an interval; 4 starts give the mean alone."""
    axis = st.Axis("rollout.staleness", (1, 2, 4, 8, 24), ("cispo_none",))

    def own(starts: int) -> pd.DataFrame:
        rows = [
            {"start": f"s{s}", "seed": s + 6 * k, "value": v, "change": 0.2 - (0.01 * s if v == 24 else 0.0)}
            for s in range(starts) for k in range(2) for v in (1, 8, 24)
        ]  # fmt: skip
        return pd.DataFrame(rows)

    six = st.span_loss(own(6), axis)
    assert six["loss"] == pytest.approx(-0.025) and six["loss_starts"] == 6
    assert six["loss_lo"] < six["loss"] < six["loss_hi"]
    four = st.span_loss(own(4), axis)
    assert four["loss"] == pytest.approx(-0.015) and math.isnan(four["loss_lo"])
    assert math.isnan(st.span_loss(own(6)[lambda d: d["value"] < 24], axis)["loss"])  # the last value not run yet
