"""Runs say where they came from (meta.json), pinned numerics rerun bitwise, and `moe_rl.reproduce` checks it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from helpers import ROOT, launch, run_values, tiny_overrides, train_command, train_env

from moe_rl.analysis.provenance import commits, load_provenance, provenance_line
from moe_rl.reproduce import choose, compare, group_columns, seed_spread, verdict_line
from moe_rl.run.code import portable
from moe_rl.run.folder import PINNED_ENV, pin_numerics, relative_paths

RUN = tiny_overrides("steps=2", "eval_every=2", "checkpoint_every=0", "cold_start.max_steps=100", "threads=1")
HAS_AVX2 = "avx2" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False


def _train(run: Path, cache: Path, *extra: str, env: dict[str, str] | None = None) -> None:
    full_env = train_env(**(env or {}))
    for key in PINNED_ENV["avx2"]:  # the host's own choice, unless the test sets one
        if key not in (env or {}):
            full_env.pop(key, None)
    launch(train_command(RUN, run, cache, *extra), env=full_env)


@pytest.fixture(scope="module")
def pinned(tmp_path_factory, cache):
    """One numerics=avx2 run on this CPU's own settings, one with the host told to use other kernels."""
    if not HAS_AVX2:
        pytest.skip("numerics=avx2 needs an x86 CPU with AVX2")
    root = tmp_path_factory.mktemp("pinned")
    _train(root / "shipped" / "native_host", cache, "numerics=avx2")
    # a host whose MKL is told to take its AVX-512 path outside any reproducibility branch, whose ATen is told
    # to use no vector kernels at all and whose oneDNN may use every ISA (MKL_ENABLE_INSTRUCTIONS=AVX512 alone
    # moved the pinned run off its bits before the pin cleared it)
    _train(
        root / "other_host",
        cache,
        "numerics=avx2",
        env={
            "MKL_ENABLE_INSTRUCTIONS": "AVX512",
            "MKL_CBWR": "AUTO",
            "ATEN_CPU_CAPABILITY": "default",
            "ONEDNN_MAX_CPU_ISA": "ALL",
        },
    )
    return root


def test_meta_json_records_commit_command_cpu_threads_and_versions(pinned) -> None:
    run = pinned / "shipped" / "native_host"
    meta = json.loads((run / "meta.json").read_text())
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert meta["git_sha"] == sha and len(sha) == 40 and isinstance(meta["git_dirty"], bool)
    assert meta["command"].startswith("experiments/train.py ") and "numerics=avx2" in meta["command"]  # no root
    assert str(ROOT) not in json.dumps(meta)  # the checkout's own location is never recorded
    assert "numerics=avx2" in meta["overrides"] and meta["numerics"] == "avx2"
    assert set(meta["versions"]) >= {"moe_rl", "torch", "transformers", "numpy", "python"}
    assert meta["versions"]["torch"] == torch.__version__ and "vllm" not in meta["versions"]  # no engine: not recorded
    cpu = meta["cpu"]
    assert cpu["capability"] == "AVX2" and cpu["torch_threads"] == 1 and cpu["model"]
    assert cpu["env"]["ATEN_CPU_CAPABILITY"] == "avx2" and cpu["env"]["MKL_CBWR"] == "AVX2"
    other = json.loads((pinned / "other_host" / "meta.json").read_text())
    assert "MKL_ENABLE_INSTRUCTIONS" not in other["cpu"]["env"]  # the pin cleared the host's override
    assert other["cpu"]["env"]["MKL_CBWR"] == "AVX2" and cpu["vendor"] == other["cpu"]["vendor"]


def test_config_yaml_holds_paths_relative_to_the_run_folder(pinned, tmp_path) -> None:
    run = pinned / "shipped" / "native_host"
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["out_dir"] == "."
    cache = (run / cfg["cold_start"]["cache_dir"]).resolve()
    assert not Path(cfg["cold_start"]["cache_dir"]).is_absolute() and any(cache.iterdir())  # the cache it used
    got = relative_paths(
        {"out_dir": str(tmp_path / "a" / "b"), "results_dir": str(tmp_path / "a"), "cold_start": {}},
        tmp_path / "a" / "b",
    )
    assert got == {"out_dir": ".", "results_dir": "..", "cold_start": {}}


def test_pinned_numerics_are_bitwise_equal_whatever_the_host_kernels(pinned) -> None:
    a, b = run_values(pinned / "shipped" / "native_host"), run_values(pinned / "other_host")
    assert len(a) > 100 and a["key"].eq("reward/mean").sum() == 2
    pd.testing.assert_frame_equal(a, b, check_exact=True)


def test_pinning_after_torch_computed_on_other_kernels_is_refused() -> None:
    saved = dict(os.environ)
    try:
        if torch.backends.cpu.get_cpu_capability() == "AVX2":  # this process already runs the pinned kernels
            pin_numerics("avx2")
        else:
            with pytest.raises(RuntimeError, match="fresh process"):
                pin_numerics("avx2")
        pin_numerics("native")  # a no-op
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.slow
def test_reproduce_reruns_a_pinned_run_bitwise(pinned, tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.reproduce",
        str(pinned / "shipped"),
        "--runs",
        "1",
        "--out",
        str(tmp_path / "re"),
    ]
    out = subprocess.run(
        cmd + ["--cache", str(tmp_path / "cache")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith("REPRODUCED BITWISE"), out.stdout[-2000:]
    table = pd.read_csv(tmp_path / "re" / "reproduce.csv")
    assert set(table["outcome"]) >= {"start_accuracy", "final_accuracy", "reward_auc"} and table["bitwise"].all()


def _outcomes() -> pd.DataFrame:
    rows = [
        {"run": f"{arm}_{lr}_{seed}", "arm": arm, "lr": lr, "seed": seed, "final_accuracy": acc}
        for arm, lr, seed, acc in [
            ("a", 1, 0, 0.50),
            ("a", 1, 1, 0.60),
            ("a", 1, 2, 0.70),
            ("b", 1, 0, 0.40),
            ("b", 1, 1, 0.40),
            ("a", 2, 1, 0.30),
            ("a", 2, 0, 0.20),
        ]
    ]
    return pd.DataFrame(rows)


def test_runs_are_chosen_across_groups_lowest_seed_first() -> None:
    outcomes = _outcomes()
    groups = group_columns(outcomes, ["run", "arm", "lr", "seed"])
    assert groups == ["arm", "lr"]
    chosen = choose(outcomes, 4, groups)
    assert chosen["run"].tolist() == ["a_1_0", "a_2_0", "b_1_0", "a_1_1"]


def test_a_rerun_is_within_seed_variation_by_the_stated_bound() -> None:
    shipped = pd.DataFrame({"final_accuracy": [0.5, 0.4]}, index=["r1", "r2"])
    spread = pd.DataFrame({"final_accuracy": [0.1, 0.05]}, index=["r1", "r2"])
    seeds = pd.DataFrame({"final_accuracy": [3, 8]}, index=["r1", "r2"])
    for name in ("start_accuracy", "reward_auc", "token_var", "flip_rate"):
        shipped[name] = spread[name] = float("nan")
        seeds[name] = 3
    close = shipped.assign(final_accuracy=[0.5, 0.6])  # r1 bitwise, r2 off by 0.2
    table = compare(shipped, close, spread, seeds)
    # 0.05 two-sided over 2 comparisons: Student's t at 1 - 0.0125 with 2 and 7 degrees of freedom
    assert table["t"].tolist() == pytest.approx([6.2053, 2.8412], abs=1e-4)
    assert table["bound"].tolist() == pytest.approx([6.2053 * 2**0.5 * 0.1, 2.8412 * 2**0.5 * 0.05], abs=1e-4)
    assert table["within"].tolist() == [True, True]  # 0.2 <= 2.84 * 1.41 * 0.05 = 0.201
    assert verdict_line(table).startswith("WITHIN SEED VARIATION")
    far = compare(shipped, shipped.assign(final_accuracy=[0.5, 0.61]), spread, seeds)  # 0.21 > 0.201
    assert far["within"].tolist() == [True, False] and verdict_line(far).startswith("NOT WITHIN SEED VARIATION")
    same = compare(shipped, shipped.copy(), spread, seeds)
    assert verdict_line(same).startswith("REPRODUCED BITWISE")
    moved = shipped.assign(final_accuracy=[0.45, 0.5])  # r1 moved where no seed spread is known, r2 within
    shared = verdict_line(compare(shipped, moved, spread.assign(final_accuracy=[float("nan"), 0.05]), seeds))
    assert shared.startswith("WITHIN SEED VARIATION where testable") and "final_accuracy 0.5 vs 0.45" in shared


def test_an_outcome_every_seed_shares_has_no_seed_spread() -> None:
    outcomes = _outcomes().assign(start_accuracy=0.375)
    outcomes["reward_auc"] = outcomes["token_var"] = outcomes["flip_rate"] = 0.1 * outcomes["seed"]
    groups = ["arm", "lr"]
    spread, seeds = seed_spread(outcomes, choose(outcomes, 1, groups), groups)
    row = spread.loc["a_1_0"]
    assert seeds.loc["a_1_0", "final_accuracy"] == 3
    assert pd.isna(row["start_accuracy"]) and row["final_accuracy"] == pytest.approx(0.1) and row["reward_auc"] > 0


def test_report_names_the_commits_and_kernels_of_its_runs(tmp_path) -> None:
    for name, sha, cap in [("r1", "a" * 40, "AVX512"), ("r2", "a" * 40, "AVX2"), ("r3", "unknown", None)]:
        (tmp_path / name).mkdir()
        meta = {"git_sha": sha, "git_dirty": name == "r2", "versions": {"torch": "2.13.0", "transformers": "5"}}
        if cap:
            meta["cpu"] = {"model": "X", "capability": cap, "env": {}}
        else:
            meta["shipped_in"] = "b" * 40
        (tmp_path / name / "meta.json").write_text(json.dumps(meta))
    frame = load_provenance(tmp_path)
    line = provenance_line(frame)
    assert "commits `aaaaaaa` (2)" in line and "1 of them from a tree with uncommitted changes" in line
    assert "1 run(s) recorded no commit (shipped in `bbbbbbb` (1)" in line
    assert "torch kernels AVX2 (1), AVX512 (1)" in line
    assert commits(frame) == ["aaaaaaa", "bbbbbbb"]


# an absolute path into a checkout (its code, its cold-start cache, its runs): a machine's path, not the project's
CHECKOUT_PATH = re.compile(
    r"/(?:work|tmp|home|root|Users|mnt|scratch|data)/[^/\s\"',=]+/(?:experiments|moe_rl|benchmarks|scripts|\.cache|runs|results|tests)/"
)


def test_no_shipped_file_holds_a_machine_path() -> None:
    texts = (".json", ".yaml", ".md", ".csv", ".txt", ".sh", ".log")
    found = {
        str(p.relative_to(ROOT)): m.group(0)
        for p in sorted((ROOT / "results").rglob("*"))
        if p.suffix in texts and p.is_file() and (m := CHECKOUT_PATH.search(p.read_text(errors="replace")))
    }
    assert found == {}
    assert portable({"a": ["/x/repo/experiments/train.py -m", "/x/repo"]}, (Path("/x/repo"),)) == {
        "a": ["experiments/train.py -m", "."]
    }


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


@pytest.mark.slow
def test_a_run_from_a_dirty_tree_reruns_bitwise_from_its_commit_and_stored_patch(tmp_path, cache) -> None:
    """A checkout of this repository's HEAD (its code only) with one edit that moves every number (the mini-batch
    shuffle's seed) and one new untracked file: the run stores that change as a patch beside it, and
    `moe_rl.reproduce` rebuilds the commit plus the patch and reruns it bitwise; with this checkout's code
    (`--current-code`, the edit absent) the rerun differs, so the patch is what reproduced it."""
    clone = tmp_path / "clone"
    _git("clone", "--quiet", "--shared", "--no-checkout", str(ROOT), str(clone), cwd=tmp_path)
    _git("sparse-checkout", "set", "--no-cone", "/moe_rl/", "/experiments/", "/pyproject.toml", cwd=clone)
    _git("checkout", "--quiet", cwd=clone)
    train = clone / "moe_rl" / "train.py"
    shuffle = "manual_seed(cfg.seed * 7919 + step)"
    assert shuffle in train.read_text()
    train.write_text(train.read_text().replace(shuffle, "manual_seed(cfg.seed * 7919 + step + 1)"))
    (clone / "moe_rl" / "untracked_note.py").write_text("NOTE = 1\n")
    runs = tmp_path / "runs"
    env = train_env(PYTHONPATH=str(clone))
    cmd = [sys.executable, "experiments/train.py", *RUN, f"cold_start.cache_dir={cache}", f"hydra.run.dir={runs / 'r'}"]
    out = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    meta = json.loads((runs / "r" / "meta.json").read_text())
    assert (
        meta["git_dirty"] is True
        and meta["git_sha"]
        == subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    )
    patch = (runs / ".code" / f"{meta['git_diff']}.patch").read_text()
    assert "step + 1)" in patch and "untracked_note.py" in patch
    for name, extra in (("recorded", []), ("current", ["--current-code"])):
        rerun = subprocess.run(
            [sys.executable, "-m", "moe_rl.reproduce", str(runs), "--runs", "1", "--out", str(tmp_path / name)]
            + ["--cache", str(tmp_path / "cache"), *extra],
            cwd=ROOT,
            env=train_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
        values = run_values(tmp_path / name / "r")
        same = values.equals(run_values(runs / "r"))
        if name == "recorded":
            assert f"r: commit {meta['git_sha'][:10]} + patch {meta['git_diff'][:10]}" in rerun.stdout
            assert same and rerun.stdout.strip().splitlines()[-1].startswith("REPRODUCED BITWISE")
        else:
            assert not same
