"""moe_rl.analysis, the report CLI and the notebooks, on a fake results folder (tests/fake_results.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fake_results import make_fake_grid, make_fake_results
from helpers import ROOT, RUN_KEY_HEAD
from matplotlib.figure import Figure

from moe_rl import analysis

ARMS = ("grpo+r2", "grpo+none", "gspo+none")
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("results")
    make_fake_results(root, arms=ARMS, seeds=SEEDS, steps=12, num_layers=2, collapse=("grpo+none", 1))
    return root


@pytest.fixture(scope="module")
def df(results: Path) -> pd.DataFrame:
    return analysis.load_results(results)


def test_load_results_rows_and_columns(results: Path, df: pd.DataFrame) -> None:
    files = sorted(results.rglob("metrics.parquet"))
    assert len(files) == len(ARMS) * len(SEEDS)
    assert len(df) == sum(len(pd.read_parquet(f)) for f in files)
    for col in [
        *RUN_KEY_HEAD,
        "step",
        "key",
        "value",
        "status",
        "n_collapse_events",
        "first_collapse_step",
        "run_dir",
        "num_layers",
    ]:
        assert col in df.columns, col
    assert df["run"].nunique() == 9
    assert "num_experts" in analysis.run_key_columns(df) and "status" not in analysis.run_key_columns(df)
    table = analysis.runs(df).set_index("run")
    collapsed = table[table["n_collapse_events"] > 0]
    assert list(collapsed["arm"]) == ["grpo+none"] and list(collapsed["status"]) == ["collapsed"]
    assert table["first_collapse_step"].notna().sum() == 1
    assert set(table["status"]) == {"completed", "collapsed"}
    # native_vs_replayed exists only for the replay arm
    native = df[df["key"] == "route/native_vs_replayed/flip_rate"]
    assert set(native["arm"]) == {"grpo+r2"}


def test_load_results_flags_incomplete_and_skips_unreadable(tmp_path: Path) -> None:
    dirs = make_fake_results(tmp_path, arms=("grpo+r2",), seeds=(0, 1, 2), steps=4, collapse=None)
    (dirs[0] / "status.json").unlink()
    status = json.loads((dirs[1] / "status.json").read_text())
    (dirs[1] / "status.json").write_text(json.dumps({**status, "status": "running"}))
    (dirs[2] / "metrics.parquet").write_bytes(b"not a parquet file")
    with pytest.warns(UserWarning) as record:
        df = analysis.load_results(tmp_path)
    messages = "\n".join(str(w.message) for w in record)
    assert str(dirs[2] / "metrics.parquet") in messages and "incomplete" in messages
    assert dict(analysis.runs(df)[["run", "status"]].itertuples(index=False)) == {
        "compare-grpo+r2-s0": "missing",
        "compare-grpo+r2-s1": "running",
    }
    assert analysis.summarize(df)["n_incomplete"].tolist() == [2]


def test_runs_labelled_by_two_collapse_rules_are_refused_naming_them(tmp_path: Path) -> None:
    dirs = make_fake_results(tmp_path, arms=("grpo+r2",), seeds=(0, 1, 2), steps=4, collapse=None)
    for run_dir, version in zip(dirs, (1, 1, 2)):
        status = json.loads((run_dir / "status.json").read_text())
        (run_dir / "status.json").write_text(json.dumps({**status, "collapse_rule": version}))
    two = f"version 1: 2 run(s), e.g. {dirs[0].relative_to(tmp_path).as_posix()}; version 2: 1 run(s)"
    with pytest.raises(ValueError, match="different versions of the collapse rule") as err:
        analysis.load_results(tmp_path)
    assert two in str(err.value)
    status = json.loads((dirs[2] / "status.json").read_text())
    (dirs[2] / "status.json").write_text(json.dumps({**status, "collapse_rule": 1}))
    assert analysis.load_results(tmp_path)["run"].nunique() == 3  # one rule: pooled


def test_load_results_without_runs_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no runs"):
        analysis.load_results(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        analysis.load_results(tmp_path / "nope")


def test_load_events(results: Path, df: pd.DataFrame) -> None:
    events = analysis.load_events(results)
    assert len(events) == 1
    event = events.iloc[0]
    assert (event["arm"], event["seed"], event["trigger"]) == ("grpo+none", 0, "reward_drop")
    assert event["step"] == df.loc[df["run"] == event["run"], "first_collapse_step"].iloc[0]
    assert event["step"] == df.loc[df["run"] == event["run"], "step"].max()  # the run stopped there


def _by_hand(df: pd.DataFrame, arm: str, key: str) -> tuple[float, float]:
    per_run = [df[(df["arm"] == arm) & (df["seed"] == s) & (df["key"] == key)]["value"].mean() for s in SEEDS]
    return float(np.mean(per_run)), 4.303 * float(np.std(per_run, ddof=1)) / math.sqrt(3)


def test_summarize_matches_pandas(df: pd.DataFrame) -> None:
    summary = analysis.summarize(df).set_index("arm")
    assert list(summary.index) == sorted(ARMS)
    assert summary["n_seeds"].tolist() == [3, 3, 3]
    for name, key in [
        ("flip_rate", "route/old_vs_new/flip_rate"),
        ("token_var", "ratio/token_var"),
        ("clipfrac_high", "ratio/clipfrac_high"),
        ("routing_share", "ratio/split/routing_share"),
    ]:
        mean, ci = _by_hand(df, "grpo+r2", key)
        assert summary.loc["grpo+r2", f"{name}_mean"] == pytest.approx(mean, rel=1e-12)
        assert summary.loc["grpo+r2", f"{name}_ci95"] == pytest.approx(ci, rel=1e-3)
    acc = df[(df["arm"] == "gspo+none") & (df["key"] == "task/accuracy")].sort_values("step")
    final = acc.groupby("seed")["value"].last()
    gain = final - acc[acc["step"] == 0].set_index("seed")["value"]
    assert summary.loc["gspo+none", "final_accuracy_mean"] == pytest.approx(final.mean())
    assert summary.loc["gspo+none", "final_accuracy_ci95"] == pytest.approx(
        4.303 * final.std(ddof=1) / math.sqrt(3), rel=1e-3
    )
    assert summary.loc["gspo+none", "final_accuracy_sd"] == pytest.approx(final.std(ddof=1), rel=1e-12)
    assert summary.loc["gspo+none", "accuracy_gain_mean"] == pytest.approx(gain.mean())
    # the fake data has structure: replay flips less, GRPO without replay has the largest ratio variance
    assert summary.loc["grpo+r2", "flip_rate_mean"] < summary.loc["grpo+none", "flip_rate_mean"]
    assert summary["token_var_mean"].idxmax() == "grpo+none"


def test_summarize_collapses(df: pd.DataFrame) -> None:
    summary = analysis.summarize(df).set_index("arm")
    assert summary["collapsed"].to_dict() == {"grpo+none": "1 of 3", "grpo+r2": "0 of 3", "gspo+none": "0 of 3"}
    assert summary["n_collapsed"].to_dict() == {"grpo+none": 1, "grpo+r2": 0, "gspo+none": 0}
    assert summary.loc["grpo+none", "first_collapse_step"] == df["first_collapse_step"].min()
    assert summary[["first_collapse_step"]].drop("grpo+none").isna().all().all()


def test_summarize_options(df: pd.DataFrame) -> None:
    one = analysis.summarize(df[df["seed"] == 0])
    assert one["n_seeds"].tolist() == [1, 1, 1]
    assert one["flip_rate_ci95"].isna().all() and one["flip_rate_mean"].notna().all()
    by_two = analysis.summarize(df, by=("arm", "seed"))
    assert len(by_two) == 9 and list(by_two.columns[:3]) == ["arm", "seed", "n_seeds"]
    # last_frac=0.5 keeps the last 6 of 12 steps of a complete run
    run = df[(df["arm"] == "grpo+r2") & (df["seed"] == 0)]
    late = run[(run["key"] == "ratio/token_var") & (run["step"] >= 6)]["value"].mean()
    assert analysis.per_run_mean(run, "ratio/token_var", last_frac=0.5).iloc[0] == pytest.approx(late)
    with pytest.raises(ValueError, match="last_frac"):
        analysis.summarize(df, last_frac=0.0)
    with pytest.raises(KeyError, match="unknown column"):
        analysis.summarize(df, by=("nope",))
    with pytest.warns(UserWarning, match="differ in"):
        analysis.summarize(df, by=("algo",))  # mixes replay modes within grpo
    per_run = analysis.summarize(df, by="run")
    assert len(per_run) == 9 and per_run["n_seeds"].eq(1).all()


def test_t_quantiles_against_numeric_cdf() -> None:
    def cdf(t: float, dof: int, n: int = 2000) -> float:  # Simpson's rule on the Student-t density
        c = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(dof * math.pi)
        x = np.linspace(0.0, t, n + 1)
        f = c * (1 + x**2 / dof) ** (-(dof + 1) / 2)
        return 0.5 + (t / n / 3) * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())

    for dof in [1, 2, 3, 5, 10, 29, 30, 31, 50, 200]:
        assert cdf(analysis.t_quantile_975(dof), dof) == pytest.approx(0.975, abs=2e-5), dof
    assert analysis.t_quantile_975(2) == pytest.approx(4.303, abs=1e-3)
    assert math.isnan(analysis.mean_ci95([0.5])[1])


def test_format_summary_markdown(df: pd.DataFrame) -> None:
    partial = df[~((df["arm"] == "gspo+none") & (df["key"] == "ratio/clipfrac_low"))]
    text = analysis.format_summary_markdown(analysis.summarize(partial))
    lines = text.strip().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == [
        "arm",
        "seeds",
        "flip rate (%)",
        "expert flip (%)",
        "token ratio var",
        "routing share (%)",
        "seq ratio var",
        "clip low (%)",
        "clip high (%)",
        "final acc (%)",
        "acc gain (pp)",
        "collapsed",
        "first collapse",
    ]
    assert len(lines) == 2 + 3
    rows = {r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert rows["gspo+none"][header.index("clip low (%)")] == "—"
    assert rows["grpo+r2"][header.index("first collapse")] == "—"
    assert rows["grpo+none"][header.index("collapsed")] == "1 of 3"
    assert " ± " in rows["grpo+r2"][header.index("flip rate (%)")]
    assert "e-0" in rows["grpo+r2"][header.index("seq ratio var")]  # small variances in scientific notation
    # routing share next to the ratio variance: the fake share 0.1 * (1 + 0.5 * progress) of r2 runs averages
    # 0.1 * 1.25 over evenly spaced steps 0..1 (12 steps: progress = step / 11, mean 0.5), the same in every seed
    assert rows["grpo+r2"][header.index("routing share (%)")] == "12.5 ± 0.0"
    flip = analysis.summarize(df).set_index("arm").loc["grpo+r2", "flip_rate_mean"]
    assert rows["grpo+r2"][header.index("flip rate (%)")].startswith(f"{100 * flip:.1f}")
    # the cell's spread is the SD across seeds, not a seed-level interval (runs of one start are not independent)
    sd = analysis.summarize(df).set_index("arm").loc["grpo+r2", "flip_rate_sd"]
    assert rows["grpo+r2"][header.index("flip rate (%)")].endswith(f" ± {100 * sd:.1f}")  # the column's .1f


def test_plots_return_figures(df: pd.DataFrame, results: Path) -> None:
    fig = analysis.plot_flip_rate(df)
    assert isinstance(fig, Figure) and len(fig.axes) == 1 and len(fig.axes[0].lines) == 3
    assert fig.axes[0].get_title() and fig.axes[0].get_xlabel() == "step" and fig.axes[0].get_legend()
    assert len(analysis.plot_flip_rate(df, pair="native_vs_replayed").axes[0].lines) == 1

    fig = analysis.plot_layer_heatmap(df)
    assert isinstance(fig, Figure) and len(fig.axes) == 3 + 1  # one panel per arm + colour bar
    assert len(analysis.plot_layer_heatmap(df, arm="grpo+r2").axes) == 2
    with pytest.raises(ValueError, match="groups with data"):
        analysis.plot_layer_heatmap(df, arm="nope")
    # any per-layer key: the split's flipped mass, whose panels hold the per-(layer, step) seed means
    fig = analysis.plot_layer_heatmap(df, arm="grpo+r2", key="ratio/split/flipped_mass")
    assert fig.axes[-1].get_ylabel() == "ratio/split/flipped_mass"
    want = df[(df["key"] == "ratio/split/flipped_mass/layer_1") & (df["step"] == 1) & (df["arm"] == "grpo+r2")]
    assert fig.axes[0].collections[0].get_array()[1, 1] == pytest.approx(want.groupby("run")["value"].mean().mean())
    with pytest.raises(ValueError, match="no per-layer keys ratio/nope/layer_<i>"):
        analysis.plot_layer_heatmap(df, key="ratio/nope")

    fig = analysis.plot_flip_by_position(df)
    assert len(fig.axes) == 1 and len(fig.axes[0].lines) == 3
    assert list(fig.axes[0].lines[0].get_xdata()) == [0, 4, 8, 12]

    fig = analysis.plot_ratio_variance(df)
    assert len(fig.axes) == 2 and all(len(ax.lines) == 3 and ax.get_yscale() == "log" for ax in fig.axes)

    events = analysis.load_events(results)
    for fig in [analysis.plot_reward_accuracy(df), analysis.plot_reward_accuracy(df, events=events)]:
        assert len(fig.axes) == 2 and all(len(ax.lines) == 3 for ax in fig.axes)
        marks = [c for c in fig.axes[0].collections if c.get_label() == "collapse"]
        assert len(marks) == 1
        assert marks[0].get_offsets()[0][0] == events["step"].iloc[0]

    fig = analysis.plot_metric(df, "route/margin_mean")
    assert len(fig.axes[0].lines) == 3
    with pytest.raises(ValueError, match="route/nope"):
        analysis.plot_flip_rate(df, pair="nope")


def test_report_cli_writes_all_files(results: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m moe_rl.report RESULTS --out OUT --by arm`, run in-process (the module entry point itself
    is run as a subprocess by test_claims)."""
    from moe_rl.report import main

    out = tmp_path / "report"
    assert main([str(results), "--out", str(out), "--by", "arm"]) == 0
    stdout = capsys.readouterr().out
    expected = [
        "summary.md",
        "summary.csv",
        "tests.csv",
        "flip_rate.png",
        "layer_heatmap.png",
        "flip_by_position.png",
        "ratio_variance.png",
        "reward_accuracy.png",
    ]
    assert sorted(p.name for p in out.iterdir()) == sorted(expected)  # no temporary files left behind
    assert {Path(line).name for line in stdout.split()} == set(expected)
    for name in expected:
        assert (out / name).stat().st_size > 0
    assert (out / "flip_rate.png").read_bytes()[:4] == b"\x89PNG"
    text = (out / "summary.md").read_text()
    assert text.startswith("# ") and "| arm | seeds |" in text and "9 runs" in text
    assert "reward_drop" in text and "1 of 3" in text
    assert "## Tests against arm = grpo+r2" in text and "Pooled within a group: seed." in text
    csv = pd.read_csv(out / "summary.csv")
    assert csv["arm"].tolist() == sorted(ARMS) and "flip_rate_ci95" in csv.columns

    empty = subprocess.run(
        [sys.executable, "-m", "moe_rl.report", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert empty.returncode == 1 and "does not exist" in empty.stderr


@pytest.mark.parametrize(
    ("name", "n_figures", "with_phase"),
    [("routing_drift", 7, False), ("compare_algorithms", 4, True), ("compare_algorithms", 2, False)],
)
def test_notebook_executes(
    name: str, n_figures: int, with_phase: bool, results: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # a "python3" kernel spec that runs this interpreter, ahead of any user-level spec
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (test)",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("MOE_RL_RESULTS", str(results))
    monkeypatch.setenv("MOE_RL_DRIFT", str(tmp_path / "no_drift_results"))
    monkeypatch.setenv("MOE_RL_MECHANISM", str(tmp_path / "no_ladder_results"))
    root = tmp_path / "results_root"  # a phase sweep, or nothing: the notebook must run either way
    root.mkdir()
    if with_phase:
        make_fake_grid(
            root,
            Ns=(1, 4),
            lrs=(1e-3,),
            seeds=(0, 1, 2),
            steps=25,
            n_collapse=lambda a, lr, N, L: 2 if a == "grpo+none" and N > 1 else 0,
        )
    monkeypatch.setenv("MOE_RL_RESULTS_ROOT", str(root))
    path = ROOT / "notebooks" / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "stored with outputs"
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=60, resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == n_figures  # each figure shown once


# --- report defects (issue: run ids, pooled groups, off-policy variants, figure sizes) -----------------


def test_duplicate_run_ids_in_two_folders_are_both_kept(tmp_path: Path) -> None:
    for sub in ("a", "b"):  # two sweeps whose folders end alike: the same run id in both
        make_fake_results(tmp_path / sub, arms=("grpo+r2",), seeds=(0,), steps=4, collapse=None)
    with pytest.warns(UserWarning, match="several folders"):
        df = analysis.load_results(tmp_path)
    ids = sorted(df["run"].unique())
    assert ids == ["a/compare/grpo+r2/seed_0", "b/compare/grpo+r2/seed_0"]
    with pytest.warns(UserWarning, match="several folders"):
        again = analysis.load_results(tmp_path)
    assert sorted(again["run"].unique()) == ids  # stable: the same names on every load
    assert len(analysis.summarize(df, by="run")) == 2


def test_by_arm_adds_every_key_that_varies(tmp_path: Path) -> None:
    make_fake_results(tmp_path, arms=("grpo+r2", "grpo+none"), seeds=(0, 1), steps=4, collapse=None)
    other = tmp_path / "compare" / "grpo+r2" / "seed_1" / "metrics.parquet"
    frame = pd.read_parquet(other)
    frame.assign(family="mixtral").to_parquet(other, index=False)  # one run of another family
    df = analysis.load_results(tmp_path)
    groups, added, pooled = analysis.grouping(df, "arm")
    assert groups == ["arm", "family"] and added == ["family"] and pooled == ["seed"]
    # algo and replay vary too, but are fixed by arm: they add nothing
    assert analysis.grouping(df, "arm", pool=["family"]) == (["arm"], [], ["family", "seed"])

    out = tmp_path / "report"
    assert __import__("moe_rl.report").report.main([str(tmp_path), "--out", str(out)]) == 0
    text = (out / "summary.md").read_text()
    assert "family also varies across runs and was added to the grouping" in text
    assert "| arm | family | seeds |" in text and "| grpo+r2 | mixtral | 1 |" in text
    assert __import__("moe_rl.report").report.main([str(tmp_path), "--out", str(out), "--pool", "family"]) == 0
    assert "Pooled within a group: family, seed." in (out / "summary.md").read_text()


def test_variant_auto_uses_offpolicy_values_where_n_above_one() -> None:
    rows = []
    for run, n in (("a", 4), ("b", 1)):
        for step in (1, 2):
            rows.append({"run": run, "N": n, "step": step, "key": "route/old_vs_new/flip_rate", "value": 0.03})
            if n > 1:
                rows.append(
                    {"run": run, "N": n, "step": step, "key": "route/old_vs_new/flip_rate/offpolicy", "value": 0.04}
                )
    df = pd.DataFrame(rows)
    key = "route/old_vs_new/flip_rate"
    assert analysis.variant_per_run(df, key, "auto").to_dict() == {"a": 0.04, "b": 0.03}
    assert analysis.variant_per_run(df, key, "all").to_dict() == {"a": 0.03, "b": 0.03}
    off = analysis.variant_per_run(df, key, "offpolicy")
    assert off["a"] == 0.04 and math.isnan(off["b"])
    assert analysis.summarize(df.assign(arm="x", seed=0), by="run", variant="auto").set_index("run")[
        "flip_rate_mean"
    ].to_dict() == {"a": 0.04, "b": 0.03}
    with pytest.raises(ValueError, match="variant"):
        analysis.variant_per_run(df, key, "nope")


def test_flip_by_position_ticks_are_the_buckets(df: pd.DataFrame) -> None:
    ax = analysis.plot_flip_by_position(df).axes[0]
    assert list(ax.get_xticks()) == [0, 4, 8, 12]


def test_many_groups_are_faceted_and_sized(tmp_path: Path) -> None:
    make_fake_results(
        tmp_path, arms=("grpo+r2", "grpo+none", "gspo+none", "gspo+r2"), seeds=(0, 1, 2, 3), steps=6, collapse=None
    )
    df = analysis.load_results(tmp_path)
    by = ["arm", "seed"]  # 16 groups
    fig = analysis.plot_layer_heatmap(df, by=by)
    w, h = fig.get_size_inches() * 120
    assert w <= 1440 and h <= 1080, (w, h)  # was 960 x 2568 px for the offpolicy sweep
    fig = analysis.plot_ratio_variance(df, by=by)
    panels = [ax for ax in fig.axes if ax.lines]
    assert len(panels) == 2 * 4 and all(len(ax.lines) <= analysis.plots.MAX_LINES for ax in panels)
    assert all(len(ax.lines) == 4 for ax in panels)  # one line per arm, one column per seed
    assert all(len(ax.lines) == 4 for ax in analysis.plot_flip_rate(df, by=by).axes if ax.lines)
    assert len(analysis.plot_flip_rate(df, by="arm").axes) == 1  # few groups: one panel


def test_summarize_gives_the_per_update_kl_where_runs_logged_it(df: pd.DataFrame) -> None:
    """kl/update_k3 of step s planted as s / 1000 in every run: the early mean (steps 1..20) is 0.0105 and the run
    mean the mean of its steps >= 1; without the key the columns are absent."""
    assert "update_kl_early_mean" not in analysis.summarize(df)
    steps = sorted(s for s in df["step"].unique() if s >= 1)
    first = df.drop_duplicates("run")
    kl = pd.concat([first.assign(step=s, key="kl/update_k3", value=s / 1000) for s in steps], ignore_index=True)
    summary = analysis.summarize(pd.concat([df, kl], ignore_index=True)).set_index("arm")
    early = np.mean([s / 1000 for s in steps if s <= 20])
    assert summary["update_kl_early_mean"].tolist() == pytest.approx([early] * 3)
    assert summary["update_kl_mean"].tolist() == pytest.approx([np.mean(steps) / 1000] * 3)
    assert "update KL, steps <= 20" in analysis.format_summary_markdown(summary.reset_index())
