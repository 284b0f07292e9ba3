"""The cost ledger (`moe_rl.analysis.cost`, its study side `moe_rl.studies.ledger`, `python -m moe_rl.report --cost`)
on a fake results tree of two declared studies whose runs' wall_s are known: every figure checked by hand."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from fake_results import FakeRun, make_fake_runs

from moe_rl import report
from moe_rl.analysis import cost
from moe_rl.metrics.names import TASK_ACCURACY
from moe_rl.studies import ledger
from moe_rl.studies.design import POOL, load_study

# Study `big`: members 300..305 at looks 3 and 6, two cells; r2 - none is +0.3 on every member, so claim x is
# reproduced at look 1 and the second look's three members (303..305) moved no verdict. A none run costs 60 s, an r2
# run 180 s: 4 min a member, 24 min of runs; a pilot of two 90 s runs from two more warm-ups (members 700, 701).
BIG_CHANGE = {"none@hi": [0.0] * 6, "r2@hi": [0.30, 0.31, 0.29, 0.30, 0.32, 0.28]}
BIG_WALL = {"none@hi": 60.0, "r2@hi": 180.0}
# Study `small`: members 400..402 at one look, three cells of 60 s runs (9 min) and a failed run of 30 s (a second
# replicate of member 400 that the design does not read): claim y reproduced, claim z inconclusive, an exploratory
# contrast not a claim.
SMALL_CHANGE = {"none@hi": [0.0] * 3, "r2@hi": [0.30, 0.31, 0.29], "r3@hi": [0.3, -0.2, 0.1]}


def _declare(folder: Path, name: str, members: str, looks: list[int], arms: list[str], contrasts: list[dict]) -> None:
    raw = {
        "name": name,
        "question": "What does it cost?",
        "preset": "staleness",
        "arms": {a: {"overrides": [f"replay={a}"]} for a in arms},
        "levels": {"hi": {"overrides": ["optim.lr=2e-3"]}},
        "unit": {"members": members, "seeds_per_start": 1},
        "outcome": "change",
        "contrasts": contrasts,
        "design": {"mde": 0.05, "looks": looks, "sized_from": "a test"},
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(raw))


def _runs(root: Path, cells: dict[str, list[float]], members: list[int], wall: dict[str, float]) -> None:
    """One run per cell and member: accuracy 0.5 at step 0, 0.5 + change after (its `change`), its wall_s, and a warm-up
    of its own per member (25 SFT steps)."""
    index = {m: i for i, m in enumerate(members)}

    def run(rng: np.random.Generator, cell: str, lr: float, N: int, L: int, s: int, seed: int) -> FakeRun:
        change = cells[cell][index[seed]]
        rows = [(0, TASK_ACCURACY, 0.5), *((step, TASK_ACCURACY, 0.5 + change) for step in (1, 2, 3))]
        meta = {"cold_start": {"key": f"warm{seed}", "steps": 25}}
        return FakeRun(f"{cell}/seed={seed}", {"seed": seed}, rows, [], 3, meta=meta, status={"wall_s": wall[cell]})

    make_fake_runs(root, run, arms=tuple(cells), seeds=tuple(members))


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """results/ with the two studies' runs and big's pilot; conf/study/ with their declarations and one study that
    never ran (no folder: left out)."""
    tmp_path = tmp_path_factory.mktemp("cost")
    root, studies = tmp_path / "results", tmp_path / "conf" / "study"
    claim = {"cells": {"r2@hi": 1, "none@hi": -1}, "direction": "greater"}
    _declare(studies, "big", "300..305", [3, 6], ["none", "r2"], [{"name": "r2_minus_none", "claim": "x", **claim}])
    small = [
        {"name": "r2_minus_none", "claim": "y", **claim},
        {"name": "r3_minus_none", "claim": "z", "cells": {"r3@hi": 1, "none@hi": -1}, "direction": "greater"},
        {"name": "also_r2", "claim": "exploratory", **claim},
    ]
    _declare(studies, "small", "400..402", [3], ["none", "r2", "r3"], small)
    _declare(studies, "unrun", "500..502", [3], ["none", "r2"], [{"name": "r2_minus_none", "claim": "w", **claim}])
    _runs(root / "big" / "runs", BIG_CHANGE, list(range(300, 306)), BIG_WALL)
    _runs(root / "big" / "pilot", {"none@hi": [0.0, 0.0]}, [700, 701], {"none@hi": 90.0})
    _runs(root / "small" / "runs", SMALL_CHANGE, [400, 401, 402], dict.fromkeys(SMALL_CHANGE, 60.0))
    failed = FakeRun("none@hi/failed", {"seed": 400 + POOL}, [(0, TASK_ACCURACY, 0.5)], [], 0)
    failed.status, failed.meta = {"status": "failed", "wall_s": 30.0}, {"cold_start": {"key": "warm400", "steps": 25}}
    failed.config = "seed: 1000400\nthreads: 2\n"  # two threads: its wall_s understates its CPU, and the ledger says so
    make_fake_runs(root / "small" / "runs", lambda *_: failed, arms=("none@hi",), seeds=(400 + POOL,))
    return root, studies


def test_settled_look_is_the_first_from_which_no_verdict_moved() -> None:
    r, n, i = "reproduced", "not reproduced", "inconclusive"
    assert cost.settled_look([]) == 0
    assert cost.settled_look([[r, i], [r, i], [r, i]]) == 1
    assert cost.settled_look([[i, i], [r, i], [r, i]]) == 2
    assert cost.settled_look([[r, i], [i, i], [r, i]]) == 3  # look 2 moved one: the look after it counts
    assert cost.settled_look([[i], [i], [n]]) == 3
    assert cost.members_after(range(10), [3, 6, 9], 1, 3) == frozenset(range(3, 9))
    assert cost.members_after(range(10), [3, 6, 9], 3, 3) == frozenset()
    assert cost.members_after(range(10), [3, 6, 9], 1, 2) == frozenset(range(3, 6))  # only looks read


@pytest.mark.filterwarnings("ignore:1 incomplete run")  # small's failed run, loaded and left out of its verdicts
def test_ledger_by_hand(tree: tuple[Path, Path]) -> None:
    root, studies = tree
    big = ledger.study_cost(load_study(studies / "big.yaml"), root)
    assert big.decided == ("x",) and big.after == frozenset({303, 304, 305})
    assert big.settled == "look 1 of 2 (2 read)"
    small = ledger.study_cost(load_study(studies / "small.yaml"), root)
    assert small.claims == ("y", "z") and small.decided == ("y",) and not small.after

    table = cost.ledger_table([big, small]).set_index("study")
    b, s, every = table.loc["big"], table.loc["small"], table.loc["all"]
    # big: 12 runs, 24 min; pilots 3 min; total 27 min over 1 decided claim; the second look's 3 members 12 min
    assert (b["runs"], b["starts"], b["pilot_runs"], b["warmups"], b["sft_steps"]) == (12, 6, 2, 8, 200)
    assert b["run_min"] == pytest.approx(24.0) and b["pilot_min"] == pytest.approx(3.0)
    assert b["total_min"] == pytest.approx(27.0) and b["per_run_min"] == pytest.approx(2.0)
    assert b["per_start_min"] == pytest.approx(4.0) and b["per_claim_min"] == pytest.approx(27.0)
    assert b["pilot_share"] == pytest.approx(3 / 27) and b["run_share"] == pytest.approx(24 / 27)
    assert b["after_min"] == pytest.approx(12.0) and b["after_share"] == pytest.approx(12 / 27)
    assert math.isnan(b["warmup_min"]) and math.isnan(b["warmup_share"])  # not timed: never guessed
    # small: 9 runs of 60 s and the failed one's 30 s; 3 members (the failed run is a replicate of 400)
    assert (s["runs"], s["starts"], s["warmups"], s["claims"], s["decided"]) == (10, 3, 3, 2, 1)
    assert s["total_min"] == pytest.approx(9.5) and s["per_run_min"] == pytest.approx(0.95)
    assert s["per_start_min"] == pytest.approx(9.5 / 3) and s["per_claim_min"] == pytest.approx(9.5)
    assert s["after_min"] == 0.0 and (s["threaded"], b["threaded"]) == (1, 0)
    # all: 36.5 min over claims x and y
    assert (every["runs"], every["claims"], every["decided"], every["decided_claims"]) == (22, 3, 2, "x, y")
    assert every["total_min"] == pytest.approx(36.5) and every["per_claim_min"] == pytest.approx(18.25)
    assert every["after_share"] == pytest.approx(12 / 36.5)

    assert (big.geometry, small.geometry) == ("", "")  # neither is matched per start
    # per model, the studies matched by probes: big alone on one model, small alone on another
    rows = cost.ledger_table([dataclasses.replace(big, geometry="m1"), dataclasses.replace(small, geometry="m2")])
    rows = rows.set_index("study")
    assert rows.loc["matched by probes: m1", "per_claim_min"] == pytest.approx(27.0)
    assert rows.loc["matched by probes: m2", "total_min"] == pytest.approx(9.5)
    line = cost.headline(rows.reset_index(), timed=False)
    assert line.endswith(
        "; matched by probes on m1: 27.0 (27.0 CPU-min / 1); matched by probes on m2: 9.5 (9.5 CPU-min / 1)"
    )
    assert "matched by probes" not in cost.headline(table.reset_index(), timed=False)

    priced = cost.ledger_table([big, small], warmup_s=30.0).set_index("study")  # 11 warm-ups of half a minute
    assert priced.loc["big", "total_min"] == pytest.approx(31.0)
    assert priced.loc["big", "per_start_min"] == pytest.approx((24 + 4) / 6)  # its 6 runs' members' warm-ups too
    assert priced.loc["all", "warmup_min"] == pytest.approx(5.5)
    assert priced.loc["all", "per_claim_min"] == pytest.approx(42.0 / 2)


@pytest.mark.filterwarnings("ignore:1 incomplete run")
def test_report_cost_prints_the_ledger(tree: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    root, studies = tree
    assert report.main(["--cost", str(root), "--presets", str(studies.parent / "preset")]) == 0
    out = capsys.readouterr().out
    assert cost.ASSUMPTION in out and "not timed (8, 200 SFT steps)" in out and "unrun" not in out
    assert "1 run(s) set more than one torch thread" in out
    assert (
        out.rstrip()
        .splitlines()[-1]
        .startswith(
            "CPU-minutes per decided claim over all declared studies: 18.2 (36.5 CPU-min of pilots and runs; warm-ups not "
            "timed / 2 decided claims: x, y)"
        )
    )


def test_a_matched_study_s_probes_are_priced_as_pilots(tree: tuple[Path, Path], tmp_path: Path) -> None:
    """Probes (root/<study>/probes/<cell>@x<m>/, a study matched per start) count with its pilots: two 12 s probes
    beside big's two 90 s pilot runs."""
    import shutil

    root, studies = tree
    copy = tmp_path / "results"
    shutil.copytree(root / "big", copy / "big")
    _runs(copy / "big" / "probes", {"none@hi@x0.8": [0.0, 0.0]}, [300, 301], {"none@hi@x0.8": 12.0})
    big = ledger.study_cost(load_study(studies / "big.yaml"), copy)
    assert len(big.pilots) == 4 and cost.seconds(big.pilots) == pytest.approx(2 * 90.0 + 2 * 12.0)


def test_an_earlier_look_is_re_read_with_the_study_s_matching_checks() -> None:
    """The shipped `dense_pooled` (claim 7): at look 1 the placebo read -5.2 pp, past its 5-point margin, so the dense
    contrast read unmatched (its rule alone a futility stop); at look 2 the placebo came inside and the contrast read
    not reproduced. Re-read look by look, look 1 must say unmatched, so the study settled at look 2 and no run of it
    counts as read after its verdict settled."""
    from moe_rl.studies import study_rule

    root = Path(__file__).resolve().parents[1] / "results"
    study = load_study(root.parent / "experiments" / "conf" / "study" / "dense_pooled.yaml")
    by_look = ledger.verdicts_by_look(study, study_rule.analyse(study, root / "dense_pooled" / "runs"))
    assert by_look == [
        [study_rule.UNMATCHED, study_rule.NEGLIGIBLE],
        [study_rule.NOT_REPRODUCED, study_rule.NEGLIGIBLE],
    ]
    assert cost.settled_look(by_look) == 2
