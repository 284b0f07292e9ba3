"""The length study: its jobs from the preset, the length key, per-member slopes by hand, the declared verdict rules."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from helpers import PRESETS

from moe_rl.analysis.claims.rules import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, UNTESTABLE_HERE
from moe_rl.config import TaskConfig
from moe_rl.studies import length as ln
from moe_rl.studies import length_claims as lc

ARMS = PRESETS.parent / "arm"


def test_every_job_is_an_arm_file_at_its_length_and_level_lr() -> None:
    spec = ln.load_spec(PRESETS)
    assert spec.lengths == (4, 16, 32) and spec.claims_level == "past"
    points = [(lv, size, arm, s) for lv, size, arms, _, seeds in ln.jobs(spec) for arm in arms for s in seeds]
    assert len(points) == len(set(points))  # no run twice
    for _, _, arms, _, seeds in ln.jobs(spec):
        assert {s % ln.POOL for s in seeds} == set(range(ln.POOL))  # every block covers the whole pool
        assert all((ARMS / f"{a}.yaml").is_file() for a in arms)
    first = ln.jobs(spec)[0]  # the claims' three arms at the claims level come first
    assert first[0] == "past" and set(first[2]) == {lc.GRPO, lc.R2, lc.GSPO}
    assert spec.task_overrides(32) == [
        "task.gym.kwargs.min_digits=32",
        "task.gym.kwargs.max_digits=32",
        "task.max_new_tokens=35",
    ]
    assert ln.only_blocks(spec, [1]).blocks == spec.blocks[:1]
    assert ln.only_blocks(spec, [3, 2]).blocks == spec.blocks[1:3]
    with pytest.raises(ValueError, match="blocks 1..6"):
        ln.only_blocks(spec, [7])


def test_every_job_composes_and_reads_back_its_length_and_level() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from moe_rl.config import TrainConfig, to_train_config, validate

    ConfigStore.instance().store(name="base_config", node=TrainConfig)
    spec = ln.load_spec(PRESETS)
    with initialize_config_dir(config_dir=str(PRESETS.parent), version_base="1.3"):
        for level, size, arms, lr, _ in ln.jobs(spec)[:3]:
            for arm in arms:
                over = ["+preset=length", *spec.task_overrides(size), f"arm={arm}", f"optim.lr={lr:.6g}", "seed=7"]
                cfg = validate(to_train_config(compose("config", overrides=over)))
                assert cfg.task.fixed_length() == size and cfg.task.max_new_tokens == size + 3
                assert cfg.arm == arm.replace("_", "+", 1) or cfg.arm == arm
                assert ln._level_of(spec, size, cfg.optim.lr) == level and cfg.cold_start.pool == ln.POOL


def test_the_launcher_skips_seeds_whose_start_ended_out_of_band(tmp_path, capsys) -> None:
    """Member 1's cached warm-up ended outside the band, member 0's inside, member 2 is not warmed: seeds 1 and 7
    (member 1 of a pool of 6) are skipped, the others kept, and each seed's start is printed."""
    import importlib.util
    import json

    from moe_rl.forecast import compose_config
    from moe_rl.loop.cold_start import cold_start_key, data_hash_of, run_member

    spec_ = importlib.util.spec_from_file_location("length_launcher", PRESETS.parents[1] / "length.py")
    assert spec_ is not None and spec_.loader is not None
    launcher = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(launcher)
    over = [*ln.load_spec(PRESETS).task_overrides(4), f"cold_start.cache_dir={tmp_path}"]
    for seed, accuracy in ((0, 0.3), (1, 0.0)):
        cfg = compose_config(launcher.member_overrides(over, seed), PRESETS.parent)
        cold = run_member(cfg)
        key = cold_start_key(cfg.model, cfg.task, cold, data_hash_of(cfg.task), numerics=cfg.numerics)
        (tmp_path / key).mkdir()
        record = {"steps": 3000, "accuracy": accuracy, "in_band": 0.2 <= accuracy <= 0.6}
        (tmp_path / key / "cold_start.json").write_text(json.dumps(record))
    kept = launcher.live_seeds(over, (0, 1, 2, 7), jobs=1, warm_first=False, label="[past L=4]", conf=PRESETS.parent)
    assert kept == (0, 2)
    assert capsys.readouterr().out.splitlines() == [
        "[past L=4] seed 0: start 3000 SFT steps, accuracy 0.300",
        "[past L=4] seed 1: start 3000 SFT steps, accuracy 0.000, out of band: skipped",
        "[past L=4] seed 2: start not warmed",
        "[past L=4] seed 7: start 3000 SFT steps, accuracy 0.000, out of band: skipped",
    ]


def test_the_launcher_neither_warms_nor_launches_a_seed_whose_runs_all_finished(tmp_path) -> None:
    """A run counts as finished only under the folder name Hydra's multirun gave it (this one from a shipped run of
    grpo_none at lr 1.8e-4, seed 0, L = 4), with a finished status and its metrics; a running one, or one without
    metrics, is not."""
    import importlib.util
    import json

    spec_ = importlib.util.spec_from_file_location("length_launcher", PRESETS.parents[1] / "length.py")
    assert spec_ is not None and spec_.loader is not None
    launcher = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(launcher)
    over = ln.load_spec(PRESETS).task_overrides(4)
    name = "arm=grpo_none,optim.lr=0.00018,seed=0,task.gym.kwargs.max_digits=4,task.gym.kwa~67403dd51cc33333"
    folder = tmp_path / "length" / "runs" / name
    folder.mkdir(parents=True)
    assert not launcher.finished(tmp_path, over, "grpo_none", 1.8e-4, 0)
    (folder / "status.json").write_text(json.dumps({"status": "running"}))
    (folder / "metrics.parquet").write_bytes(b"")
    assert not launcher.finished(tmp_path, over, "grpo_none", 1.8e-4, 0)
    (folder / "status.json").write_text(json.dumps({"status": "completed"}))
    assert launcher.finished(tmp_path, over, "grpo_none", 1.8e-4, 0)
    assert not launcher.finished(tmp_path, over, "grpo_none", 1.8e-4, 1)  # another seed's folder
    (folder / "metrics.parquet").unlink()
    assert not launcher.finished(tmp_path, over, "grpo_none", 1.8e-4, 0)


@pytest.mark.parametrize(
    ("task", "length"),
    [
        (TaskConfig(name="running_sum", kwargs={"min_len": 16, "max_len": 16}), 16),
        (TaskConfig(name="reversal", kwargs={"min_len": 3, "max_len": 6}), None),
        (TaskConfig(name="reversal"), None),
    ],
)
def test_fixed_length_is_set_only_where_the_task_pins_it(task: TaskConfig, length: int | None) -> None:
    assert task.fixed_length() == length


def test_member_slopes_by_hand() -> None:
    """Member m's difference a - b is m + 2 log L: each slope is 2, whatever the intercept."""
    rows = []
    for m in range(6):
        for size in (4, 16, 32):
            for arm, y in (("a", m + 2 * math.log(size)), ("b", 0.0)):
                rows.append(dict(level="past", L=size, member=m, unit=str(m), seed=m, arm_file=arm, change=y))
    runs = pd.DataFrame(rows)
    s = ln.slopes(ln.member_values(runs, "past", "change", "a", "b"))
    assert s.to_numpy() == pytest.approx(np.full(6, 2.0))
    t = ln.trend(runs, "past", "change", "a", "b")
    assert t["mean_diff"] == pytest.approx(2.0) and t["n_members"] == 6 and t["lengths"] == [4, 16, 32]
    assert t["p_value"] == pytest.approx(2 / 64)  # all six slopes positive: the most extreme of 2^6 sign patterns
    few = ln.trend(runs[runs["member"] < 4], "past", "change", "a", "b")
    assert few["descriptive"] and math.isnan(few["lo"])  # below 5 members: no interval


def test_twins_warmed_on_two_machines_are_one_unit() -> None:
    """Pool indices 0..3, each warmed on two machines: 8 members (runs pair within each) but 4 units, since twins
    share their initial weights and data order. Nothing is decided; a twin pair's slopes (2 and 4) enter as their
    mean, 3; and a contrast pairs within a member but counts 4 starts."""
    rows = []
    for i in range(4):
        for machine, slope in (("amd", 2.0), ("intel", 4.0)):
            for size in (4, 16, 32):
                for arm, y in (("a", slope * math.log(size)), ("b", 0.0)):
                    rows.append(dict(level="past", L=size, member=f"{i} ({machine})", unit=str(i), seed=i,
                                     arm_file=arm, change=y, kl_early=0.01))  # fmt: skip
    runs = pd.DataFrame(rows)
    t = ln.trend(runs, "past", "change", "a", "b")
    assert t["n_members"] == 8 and t["n_starts"] == 4 and t["descriptive"] and t["mean_diff"] == pytest.approx(3.0)
    c = ln.contrast(runs, "a", "b", "past", 16)
    assert c["n_starts"] == 4 and c["n_seeds"] == 8 and c["descriptive"]
    assert c["mean_diff"] == pytest.approx(3.0 * math.log(16))


def _planted(
    grpo_slope: float, gspo_slope: float, r2_shift: float, share_slope: float, base: float = -0.1
) -> pd.DataFrame:
    """Per member, length and seed: grpo_none's change base + grpo_slope log(L/4) + noise, gspo_none's with its own
    slope, grpo_r2 = grpo_none + r2_shift; grpo_none's routing share 0.2 + share_slope log(L/4)."""
    rng = np.random.default_rng(1)
    rows = []
    for m in range(6):
        for size in (4, 16, 32):
            x = math.log(size / 4)
            for k in range(2):
                noisy = base + 0.002 * rng.standard_normal()
                for arm, change in (
                    (lc.GRPO, noisy + grpo_slope * x),
                    (lc.GSPO, noisy + gspo_slope * x + 0.001 * m),
                    (lc.R2, noisy + grpo_slope * x + r2_shift + 0.001 * m),
                ):
                    rows.append(
                        dict(level="past", L=size, member=m, unit=str(m), seed=m + 6 * k, arm_file=arm, change=change,
                             kl_early=0.009, routing_share=0.2 + share_slope * x + 0.001 * m, token_var=1e-3 * (1 + x),
                             seq_var=1e-4)
                    )  # fmt: skip
    return pd.DataFrame(rows)


def test_claim_12_reproduced_where_grpo_falls_with_length_and_gspo_does_not() -> None:
    spec = ln.load_spec(PRESETS)
    r = lc.decide(spec, _planted(-0.08, 0.0, 0.0, 0.0))["12"]
    assert r["verdict"] == REPRODUCED and r["grpo"]["mean_diff"] == pytest.approx(-0.08, abs=0.01)
    same = lc.decide(spec, _planted(-0.08, -0.08, 0.0, 0.0))["12"]
    assert same["verdict"] == NOT_REPRODUCED  # GSPO falls as fast: the difference inside +-0.02
    flat = lc.decide(spec, _planted(0.0, 0.0, 0.0, 0.0))["12"]
    assert flat["verdict"] == NOT_REPRODUCED  # GRPO does not fall with length


def test_claim_13_follows_the_routing_share_slope() -> None:
    spec = ln.load_spec(PRESETS)
    assert lc.decide(spec, _planted(0, 0, 0, 0.05))["13"]["verdict"] == REPRODUCED
    assert lc.decide(spec, _planted(0, 0, 0, 0.0))["13"]["verdict"] == NOT_REPRODUCED


def test_claim_2_per_length_holm_over_lengths_and_untestable_where_grpo_holds() -> None:
    spec = ln.load_spec(PRESETS)
    found = lc.decide(spec, _planted(-0.05, 0.0, 0.08, 0.0))["2"]
    assert set(found) == {4, 16, 32}
    verdict, _, rec = found[4]
    assert rec["p_one"] == pytest.approx(1 / 64) and rec["p_holm"] == pytest.approx(3 / 64)
    assert verdict == REPRODUCED and found[32][0] == REPRODUCED
    held = lc.decide(spec, _planted(0.0, 0.0, 0.08, 0.0, base=0.0))["2"]
    assert {v for v, _, _ in held.values()} == {UNTESTABLE_HERE}  # grpo+none holds: nothing to stabilise
    r3 = lc.decide(spec, _planted(-0.05, 0.0, 0.08, 0.0))["3"]
    assert r3[4][0] == NOT_REPRODUCED  # at L = 4 gspo+none ties grpo+none and grpo+r2 beats it by 8 pp
    assert r3[32][0] == REPRODUCED  # at 32 gspo+none is 12 pp above grpo+none and 4 above grpo+r2


def test_below_five_members_nothing_is_decided() -> None:
    spec = ln.load_spec(PRESETS)
    runs = _planted(-0.08, 0.0, 0.08, 0.05)
    found = lc.decide(spec, runs[runs["member"] < 4])
    assert found["12"]["verdict"] == INCONCLUSIVE and found["13"]["verdict"] == INCONCLUSIVE
    assert found["2"][4][0] == INCONCLUSIVE and "not decided" in found["2"][4][1]


def test_runs_from_a_start_outside_the_band_are_left_out() -> None:
    runs = pd.DataFrame({"level": ["past", "past", None], "in_band": [True, False, True], "change": [0.1, 0.0, 0.2]})
    assert ln.analysed(runs)["change"].tolist() == [0.1]


def test_a_length_where_every_run_ends_at_zero_is_named_a_floor() -> None:
    spec = ln.load_spec(PRESETS)
    runs = _planted(-0.05, 0.0, 0.08, 0.0).assign(late_accuracy=0.1)
    runs.loc[runs["L"] == 16, "late_accuracy"] = 0.0
    found = lc.decide(spec, runs)["2"]
    assert "a floor" in found[16][1] and "a floor" not in found[4][1]


def test_a_contrast_table_mixing_decided_and_descriptive_rows_keeps_the_intervals() -> None:
    """A table of contrasts, one from 5 starts (no reason) and one from 3 (a reason): pandas turns the first's None
    into NaN, which must still read as decided."""
    from moe_rl.studies import length_report

    base = {"a": "grpo_r2", "b": "grpo_none", "level": "past", "p_value": 0.5, "kl_ratio": 1.0, "mean_diff": -0.006}
    rows = [
        {**base, "L": 4, "n_seeds": 5, "n_starts": 5, "lo": -0.024, "hi": 0.015},
        {**base, "L": 32, "n_seeds": 3, "n_starts": 3, "lo": math.nan, "hi": math.nan, "descriptive": "3 starts"},
    ]
    text = length_report.format_contrasts(pd.DataFrame(rows))
    assert "| 5 (5) | -0.6 [-2.4, +1.5] |" in text and "| 3 (3) | -0.6 (descriptive) |" in text


def test_the_route_bytes_count_the_presets_rollout_and_question() -> None:
    from moe_rl.config import TrainConfig
    from moe_rl.studies import length_report

    cfg = TrainConfig()
    assert length_report.SEQUENCES == cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert length_report.PROMPT_CHARS + 2 * 4 == len("Calculate 4179 + 1931.")
    runs = pd.DataFrame({"L": [4], "response_len": [6.0], "num_moe_layers": [2], "top_k": [2]})
    assert length_report.route_kib(runs).iloc[0] == pytest.approx(128 * (22 + 6) * 2 * 2 / 1024)


def test_a_member_warmed_in_another_environment_is_another_start() -> None:
    """Seed 4 and seed 10 share pool member 4 where their starts were warmed alike; the same seed warmed on another CPU
    model or transformers version is another member (another start), and a run without meta falls back to the index."""

    def meta(vendor: str, transformers: str) -> dict:
        return {"cpu": {"vendor": vendor, "model": "X"}, "versions": {"torch": "2.13.0", "transformers": transformers}}

    amd, amd_again = meta("AuthenticAMD", "5.24.0"), meta("AuthenticAMD", "5.24.0")
    intel, newer = meta("GenuineIntel", "5.24.0"), meta("AuthenticAMD", "5.25.0")
    assert ln.member_of(4, amd) == ln.member_of(10, amd_again) == "4 (AuthenticAMD X 2.13.0 5.24.0)"
    assert len({ln.member_of(4, m) for m in (amd, intel, newer)}) == 3
    assert ln.member_of(10, {}) == "4"


def test_a_two_sided_p_that_cannot_reach_005_is_marked() -> None:
    """Over 5 starts the sign flip's two-sided p is at least 2 / 32 = 0.0625: marked *; over 6, 2 / 64 can reach it."""
    from moe_rl.studies import length_report

    row = dict(a="a", b="b", level="past", L=4, n_seeds=9, lo=-0.01, hi=0.02, mean_diff=0.005, p_value=0.0625,
               kl_ratio=1.0, descriptive="")  # fmt: skip
    text = length_report.format_contrasts(pd.DataFrame([{**row, "n_starts": 5}, {**row, "n_starts": 6}]))
    assert "| 9 (5) | +0.5 [-1.0, +2.0] | 0.0625* |" in text and "| 9 (6) | +0.5 [-1.0, +2.0] | 0.0625 |" in text


def test_a_cell_where_every_run_sits_at_the_floor_is_untestable_not_a_refutation() -> None:
    at_floor = {
        "descriptive": "",
        "grpo_change": -0.25,
        "floor": True,
        "p_one": 0.5,
        "p_holm": 1.0,
        "lo": 0.0,
        "hi": 0.0,
    }
    verdict, reason = lc.claim2_at(at_floor)
    assert verdict == UNTESTABLE_HERE and "floor" in reason


def test_one_sided_p_halves_the_symmetric_two_sided_one() -> None:
    assert lc.one_sided(2 / 64, 0.07) == pytest.approx(1 / 64)
    assert lc.one_sided(2 / 64, -0.07) == pytest.approx(1 - 1 / 64)
    assert math.isnan(lc.one_sided(math.nan, 0.1))
