"""experiments/calibrate_kl.py: the lr that reaches a target early per-update KL, from pilots, cached."""

from __future__ import annotations

import importlib.util
import json
import math

import pandas as pd
import pytest
from helpers import ROOT, tiny_overrides, train_in_process

from moe_rl.analysis.dose import acting_kl_per_run, kl_summary
from moe_rl.metrics.names import KL_UPDATE_K3, KL_UPDATE_K3_ACTING

_spec = importlib.util.spec_from_file_location("calibrate_kl", ROOT / "experiments" / "calibrate_kl.py")
assert _spec is not None and _spec.loader is not None
ck = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ck)


def test_kl_summary_gives_the_early_and_the_run_mean() -> None:
    """Steps 1..20 make the early mean, every step the run mean; step 0 (the evaluation) and other keys are not read."""
    rows = [(s, KL_UPDATE_K3, float(s)) for s in range(1, 31)] + [(0, KL_UPDATE_K3, 99.0), (5, "kl/k3", 7.0)]
    frame = pd.DataFrame(rows, columns=["step", "key", "value"])
    assert kl_summary(frame) == {"early": 10.5, "mean": 15.5}
    assert kl_summary(frame, early_steps=2)["early"] == 1.5
    assert all(math.isnan(v) for v in kl_summary(frame, key="absent").values())


def test_a_scheduled_run_mean_weighs_each_value_by_the_steps_it_stands_for() -> None:
    """Steps 1..20 logged, then 30 and 40 (each standing for the 10 steps since the last logged one): the run mean is
    (210 + 30 * 10 + 40 * 10) / 40; the early mean reads the window alone."""
    rows = [(s, KL_UPDATE_K3, float(s)) for s in [*range(1, 21), 30, 40]]
    frame = pd.DataFrame(rows, columns=["step", "key", "value"])
    assert kl_summary(frame) == {"early": 10.5, "mean": (210 + 300 + 400) / 40}


def test_the_acting_kl_is_the_anchored_runs_own_and_the_native_one_elsewhere() -> None:
    rows = [("a", 1, KL_UPDATE_K3, 1.0), ("a", 1, KL_UPDATE_K3_ACTING, 3.0), ("b", 1, KL_UPDATE_K3, 2.0)]
    frame = pd.DataFrame(rows, columns=["run", "step", "key", "value"])
    assert acting_kl_per_run(frame).to_dict() == {"a": 3.0, "b": 2.0}


def test_the_power_law_fit_and_its_inverse() -> None:
    """KL = 5 lr^2 exactly: the fit recovers a = log 5, b = 2, and the lr at a target is its inverse."""
    lrs = [1e-4, 3e-4, 1e-3]
    a, b = ck.fit_power_law(lrs, [5 * lr**2 for lr in lrs])
    assert a == pytest.approx(math.log(5)) and b == pytest.approx(2)
    assert ck.lr_at(a, b, 5 * 2e-4**2) == pytest.approx(2e-4)
    with pytest.raises(ValueError, match="2 or more"):
        ck.fit_power_law([1e-4, 1e-4], [1.0, 2.0])
    with pytest.raises(ValueError, match="> 0"):
        ck.fit_power_law(lrs, [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="does not grow"):
        ck.lr_at(0.0, -1.0, 0.1)


def test_the_local_interpolation_uses_the_bracketing_pair() -> None:
    """KL = lr^2 below 3e-4 and = lr^3 x (1 / 3e-4) above: the target between 3e-4 and 1e-3 is met on the cubic
    branch, one below 3e-4 on the quadratic one, and one past the grid on the end pair's line."""
    pts = [(1e-4, 1e-8), (3e-4, 9e-8), (1e-3, 1e-9 / 3e-4)]
    assert ck.interpolated_lr(pts, 5e-4**3 / 3e-4) == pytest.approx(5e-4)
    assert ck.interpolated_lr(pts, 2e-4**2) == pytest.approx(2e-4)
    assert ck.interpolated_lr(pts, 2e-3**3 / 3e-4) == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="2 or more"):
        ck.interpolated_lr(pts[:1], 1e-8)


def test_the_key_holds_what_the_calibration_depends_on() -> None:
    key = ck.calibration_key("grpo_none", "qwen3_moe", 0.02, KL_UPDATE_K3, 20, ["optim.updates_per_rollout=8"])
    assert key.startswith("grpo_none|qwen3_moe|kl/update_k3=0.02|")
    assert key == ck.calibration_key("grpo_none", "qwen3_moe", 0.02, KL_UPDATE_K3, 20, ["optim.updates_per_rollout=8"])
    runtime = ["cold_start.cache_dir=/elsewhere", "threads=1", "progress=false", "optim.updates_per_rollout=8"]
    assert key == ck.calibration_key("grpo_none", "qwen3_moe", 0.02, KL_UPDATE_K3, 20, runtime)  # no other run
    for other in (
        ck.calibration_key("sapo_none", "qwen3_moe", 0.02, KL_UPDATE_K3, 20, ["optim.updates_per_rollout=8"]),
        ck.calibration_key("grpo_none", "qwen3_moe", 0.02, KL_UPDATE_K3, 20, ["optim.updates_per_rollout=4"]),
        ck.calibration_key("grpo_none", "qwen3_moe", 0.02, KL_UPDATE_K3, 10, ["optim.updates_per_rollout=8"]),
    ):
        assert other != key


@pytest.mark.slow
def test_a_tiny_calibration_runs_its_pilots_and_is_cached(tmp_path, cache, monkeypatch) -> None:
    """Two 2-step pilots and the held-out one on the tiny config: the cache holds the lr, the fit and the held-out
    pilot's measured vs predicted KL; a second call reads it without running anything.

    Each pilot's command is the one `pilot` builds; the held-out pilot is launched as in real use (a process of its
    own), the grid's two run that command's script in this process (`train_in_process`: the same entry point, no
    interpreter to start)."""
    launched = train_in_process(monkeypatch, ck, launch_if=lambda cmd: any("/heldout_lr_" in arg for arg in cmd))
    overrides = (*tiny_overrides(), f"cold_start.cache_dir={cache}")
    table = tmp_path / "kl.json"
    kwargs = dict(lrs=(1e-3, 1e-2), steps=2, overrides=overrides, runs=tmp_path / "runs", cache=table)
    out = ck.calibrate("grpo_none", "qwen3_moe", 1e-3, **kwargs)
    assert not out["cached"] and out["fit"]["b"] > 0 and out["lr"] > 0
    assert [p["lr"] for p in out["pilots"]] == [1e-3, 1e-2] and all(p["early"] > 0 for p in out["pilots"])
    held = out["holdout"]
    assert held["early"] > 0 and held["measured_over_predicted"] == pytest.approx(held["early"] / 1e-3)
    assert len(json.loads(table.read_text())) == 1
    runs = sorted((tmp_path / "runs").rglob("metrics.parquet"))
    assert len(runs) == 3 and len(launched) == 3
    again = ck.calibrate("grpo_none", "qwen3_moe", 1e-3, **kwargs)
    assert again["cached"] and again["lr"] == out["lr"] and len(launched) == 3
    assert ck.cached_lr("grpo_none", "qwen3_moe", 1e-3, overrides=overrides, steps=2, cache=table) == out["lr"]
    assert ck.cached_lr("sapo_none", "qwen3_moe", 1e-3, overrides=overrides, steps=2, cache=table) is None


def test_a_paired_pilot_reads_the_lr_that_meets_the_reference() -> None:
    """The reference at lr 1 with KL 1 and 4 at members 0 and 1; arm x at lr 1 and 2 with KL = 0.5 * lr^2 times the
    reference's at its member: log ratio = log 0.5 + 2 log lr, so slope 2 and ratio 1 at lr sqrt(2)."""
    from moe_rl.analysis.dose import matched_lr

    rows = [("ref", 1.0, m, k) for m, k in ((0, 1.0), (1, 4.0))]
    rows += [("x", lr, m, 0.5 * lr**2 * k) for lr in (1.0, 2.0) for m, k in ((0, 1.0), (1, 4.0))]
    table = matched_lr(pd.DataFrame(rows, columns=["arm", "lr", "member", "kl"]), "ref")
    x = table[table["arm"] == "x"].set_index("lr")
    assert x.loc[1.0, "ratio"] == pytest.approx(0.5) and x.loc[2.0, "ratio"] == pytest.approx(2.0)
    assert x.loc[1.0, "kl"] == pytest.approx(0.5 * 2.0)  # geometric mean of 0.5 and 2
    assert x["slope"].iloc[0] == pytest.approx(2.0) and x["lr_matched"].iloc[0] == pytest.approx(math.sqrt(2))
    assert x.loc[1.0, "sd_log_ratio"] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="must run at one lr"):
        matched_lr(pd.DataFrame(rows, columns=["arm", "lr", "member", "kl"]), "x")


def test_the_match_mode_reads_the_shipped_pilot(capsys) -> None:
    assert ck.main(["--match", str(ROOT / "results" / "causal_matched" / "pilot"), "--reference", "moe"]) == 0
    out = capsys.readouterr().out
    assert "anchored: ratio 1 at lr 0.000451 (1.128x" in out  # the lr_scale causal_matched declares
    assert "dense_total_mup: ratio 1 at lr 0.0003757 (0.683x" in out
