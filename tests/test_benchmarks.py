"""Every script under benchmarks/ runs end to end at tiny sizes, so a refactor that breaks one fails here.

These are smoke tests, not timings: each runs the script's `main` in-process with the smallest
sizes its flags allow and checks that it printed its figures as finite numbers. The figures
themselves are quoted from full-size runs in docs/performance.md and docs/step_profile.md.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch
from helpers import ROOT

BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def numbers_after(label: str, text: str) -> list[float]:
    """The numbers after `label` on the first line of `text` that is `label`, spaces, then a number."""
    row = re.compile(re.escape(label) + r"\s+-?\d[\d.]*(?:\s|x|%|$)")  # not "step 4: a log line"
    line = next(line for line in text.splitlines() if row.match(line))
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", line[len(label) :])]


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run in a scratch folder (cold-start caches are relative paths); conftest keeps torch's thread count."""
    monkeypatch.chdir(tmp_path)


def test_every_benchmark_has_a_smoke_test() -> None:
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    assert BENCHMARKS and set(BENCHMARKS) <= tested, sorted(set(BENCHMARKS) - tested)


def test_step_profile(capsys: pytest.CaptureFixture[str]) -> None:
    load("step_profile").main(
        "--models default --prompts 2 --group 2 --max-new-tokens 2 --updates 2 --repeats 1 --warmup 0 --cold-start-steps 1 --threads 1".split()
    )
    out = capsys.readouterr().out
    phases = ("generate", "old pass", "forward", "ratio split", "backward", "optimizer")
    for phase in phases:  # harness ms, share, floor ms, ratio
        harness_ms, share, floor_ms, ratio = numbers_after(phase, out)
        assert harness_ms > 0 and floor_ms > 0 and ratio > 0, phase
    step_ms, _, floor_ms, ratio = numbers_after("step", out)
    # one repeat: the ratio is of the unrounded times; printed, the times carry +-0.05 ms and the ratio +-0.005
    rounding = 0.005 + (step_ms / floor_ms) * (0.05 / step_ms + 0.05 / floor_ms)
    assert step_ms > 0 and floor_ms > 0 and ratio == pytest.approx(step_ms / floor_ms, abs=rounding)
    rest_ms, rest_floor_ms, rest = numbers_after("step w/o split", out)  # the step less the split, over its floor
    split_ms, _, split_floor_ms, _ = numbers_after("ratio split", out)
    assert rest_ms == pytest.approx(step_ms - split_ms, abs=0.15) and rest > 0
    assert rest_floor_ms == pytest.approx(floor_ms - split_floor_ms, abs=0.15)
    route_ms, _ = numbers_after("route bookkeeping", out)
    assert route_ms > 0  # the routing calls of the loop were found and timed
    on_ms, off_ms, ratio = numbers_after("split on/off", out)  # a step with the ratio split's extra forward vs without
    rounding = 0.005 + (on_ms / off_ms) * (0.05 / on_ms + 0.05 / off_ms)
    assert on_ms > 0 and off_ms > 0 and ratio == pytest.approx(on_ms / off_ms, abs=rounding)
    # the other blocks: a step between route steps (no split), the mean over K steps, and every step on all rows
    other, mean, every = (out.split(header, 1)[1] for header in ("-- other steps", "-- mean step", "-- all rows, K=1"))
    assert numbers_after("ratio split", other)[0] == 0.0 and numbers_after("route bookkeeping", other)[0] >= 0
    for block in (other, mean, every):
        assert numbers_after("step", block)[-1] > 0
    for block in (mean, every):
        assert numbers_after("split on/off", block)[-1] > 0
    assert "(metrics.route_every=10, split_rows=24)" in out  # the config's defaults unless told otherwise


def test_sweep_throughput(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Two tiny eager sweeps (one run of one step each) through Hydra's joblib launcher: both finish, and the layout
    ratio is the ratio of the printed rates."""
    tiny = ["task.n_train=64", "task.n_eval=8", "eval_size=8", "rollout.prompts_per_step=2", "rollout.group_size=2"]
    tiny += ["cold_start.band=[0.0,1.0]", "cold_start.max_steps=1", f"cold_start.cache_dir={tmp_path / 'cache'}"]
    argv = "--arms grpo_none --seeds 0 --steps 1 --setting eager= --layouts 1x1,2x1".split()
    load("sweep_throughput").main([*argv, *(arg for o in tiny for arg in ("--set", o))])
    out = capsys.readouterr().out
    one, two = numbers_after("eager      1x1", out)[0], numbers_after("eager      2x1", out)[0]
    ratio = numbers_after("1x1 / 2x1, eager", out)[0]
    assert one > 0 and two > 0  # runs per hour, medians
    # the ratio is of the unrounded rates; printed, the rates carry +-0.05 runs/h and the ratio +-0.005
    rounding = 0.005 + (one / two) * (0.05 / one + 0.05 / two)
    assert ratio == pytest.approx(one / two, abs=rounding)
    # --length L composes the length study's run at L (its preset, task overrides and `stable` lr)
    bench = load("sweep_throughput")
    assert bench.run_count(["+rung=moe,anchored", "seed=0,1,2"]) == 6  # the block's runs: rungs x seeds
    assert bench.parse_setting("off=metrics.update_kl_rows=0 compile=true") == (
        "off",
        ["metrics.update_kl_rows=0", "compile=true"],
    )
    length = bench.length_overrides(16)
    assert length[0] == "+preset=length" and "task.max_new_tokens=19" in length and length[-1].startswith("optim.lr=")


def test_sweep_throughput_pairs_runs(tmp_path: Path) -> None:
    """The run-by-run ratio pairs a run with itself under the other setting (its folder's name less the setting's
    overrides), finished runs only, and divides the sums of their wall times: old 2 s and 4 s, new 1 s and 0.5 s give 6 / 1.5 = 4.00x,
    and its bootstrap interval lies between the runs' own ratios, 2 and 8."""
    bench = load("sweep_throughput")
    walls = {"old": {"seed=0": 2.0, "seed=1": 4.0}, "new": {"compile=True,seed=0": 1.0, "compile=True,seed=1": 0.5}}
    (tmp_path / "old" / "seed=2").mkdir(parents=True)  # started, never finished: no status.json
    for name, runs in walls.items():
        for folder, wall in runs.items():
            (tmp_path / name / folder).mkdir(parents=True)
            (tmp_path / name / folder / "status.json").write_text(json.dumps({"status": "completed", "wall_s": wall}))
            (tmp_path / name / folder / "metrics.parquet").touch()  # a finished run's outputs
    old = bench.run_seconds(tmp_path / "old", [])
    new = bench.run_seconds(tmp_path / "new", ["compile=true"])
    assert old == {"seed=0": 2.0, "seed=1": 4.0} and new == {"seed=0": 1.0, "seed=1": 0.5}
    (line,) = bench.paired_lines({("old", "2x1"): [old], ("new", "2x1"): [new]}, ["old", "new"], ["2x1"])
    ratio, lo, hi = numbers_after("new / old, 2x1", line)[:3]
    assert ratio == 4.0 and 2.0 <= lo <= ratio <= hi <= 8.0 and "2 runs paired" in line


def test_split_spread(capsys: pytest.CaptureFixture[str]) -> None:
    load("split_spread").main(
        f"--arms grpo_none --steps 2 --every 1 --sizes 1 --draws 2 --prompts 4 --group 2 --max-new-tokens 2 "
        f"--cold-start-steps 1 --numerics native --results {ROOT / 'results' / 'compare'}".split()
    )
    out = capsys.readouterr().out
    assert "== grpo_none: 2 steps (1..2, every 1), 2 rows per update, 2 draws per S" in out
    seed_sd, all_steps = numbers_after("ratio/split/routing_share", out)[:2]
    assert seed_sd > 0 and all_steps > 0  # the shipped compare seeds' spread at those steps and overall


def test_numerics_cost(capsys: pytest.CaptureFixture[str]) -> None:
    load("numerics_cost").main(
        "--models default --repeats 1 --steps 1 --prompts 2 --group 2 --max-new-tokens 2 --updates 2 --cold-start-steps 1".split()
    )
    out = capsys.readouterr().out
    assert numbers_after("default: native", out)[0] > 0
    line = next(line for line in out.splitlines() if line.startswith("default: native"))
    for mode in ("avx2", "portable"):
        ratio, lo, hi = map(
            float, re.search(rf"{mode} / native ([\d.]+) \(range ([\d.]+) to ([\d.]+)\)", line).groups()
        )
        assert 0 < lo <= ratio <= hi
    assert line.endswith("medians of 1 rotations, CPU time")


def test_routing_overhead(capsys: pytest.CaptureFixture[str]) -> None:
    load("routing_overhead").main("--models default --batch 2 --seq 4 --repeats 3 --threads 1".split())
    out = capsys.readouterr().out
    recorder, lo, hi = numbers_after("recorder / plain forward", out)[:3]
    assert 0 < lo <= recorder <= hi
    assert numbers_after("replay fwd+bwd / plain fwd+bwd", out)[0] > 0
    assert numbers_after("route bytes per token per MoE layer", out)[:2] == [2, 2]  # uint8 ids, k = 2


def test_compile_probe(capsys: pytest.CaptureFixture[str]) -> None:
    """Dynamo's eager backend (no inductor), the hook checks only (the timing's three compiles would double the test's
    time): with the hook guards on (compile=true's setting) every route context gets the eager routes, and with
    torch's default a recorder after a hookless pass gets none."""
    load("compile_probe").main("--backend eager --hooks-only".split())
    out = capsys.readouterr().out
    rows = re.findall(r"^hook guards (on |off), (.+?) +got the eager routes: (yes|NO)$", out, re.M)
    assert len(rows) == 10
    assert all(ok == "yes" for guards, _, ok in rows if guards == "on ")
    assert ("off", "recorder after a hookless pass", "NO") in rows


def test_experts_step(capsys: pytest.CaptureFixture[str]) -> None:
    """Both kernels' trainers per model take their steps in turn and end with the same weights (one thread)."""
    load("experts_step").main("--repeats 1 --prompts 2 --group 2 --cold-start-steps 2 --updates 1".split())
    out = capsys.readouterr().out
    assert out.count("same weights after every step: True") == 2
    assert len(re.findall(r"^fine/default per MoE layer, \S+: \d+\.\d+x$", out, re.M)) == 2


def test_experts_impl(capsys: pytest.CaptureFixture[str]) -> None:
    load("experts_impl").main("--batch 2 --seq 4 --repeats 1".split())
    out = capsys.readouterr().out
    rows = {}
    for impl in (
        "eager",
        "batched_mm",
        "grouped_mm",
        "grouped_mm_cpu",
    ):  # max|diff| to eager, forward and fwd+bwd time ratios
        found = re.search(rf"^{impl}\s+max\|diff\|=(\S+)\s+forward\s+(\S+)x\s+fwd\+bwd\s+(\S+)x", out, re.M)
        assert found, impl
        rows[impl] = [float(x) for x in found.groups()]
    assert rows["eager"] == [0.0, 1.0, 1.0]
    assert all(math.isfinite(x) and x >= 0 for row in rows.values() for x in row)


def test_long_run_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    load("long_run_memory").main(f"--steps 2 --out {tmp_path / 'run'} --cold-start-steps 1 --eval-every 2".split())
    out = capsys.readouterr().out
    peak, now = numbers_after("step     2: peak RSS", out)
    assert peak >= now > 0
    # a one-step cold start earns no reward, so the run says `no_signal`
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] in (
        "completed",
        "collapsed",
        "no_signal",
    )


def test_trl_vs_harness(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("trl")
    # two updates: TRL computes old log-probs (and R2 has routes to replay) only off-policy
    load("trl_vs_harness").main(
        "--prompts 2 --group 2 --max-new-tokens 2 --updates 2 --repeats 1 --warmup 0 --cold-start-steps 1 --arms r2".split()
    )
    out = capsys.readouterr().out
    harness_s, trl_s, ratio = numbers_after("total", out)
    # the ratio is of unrounded times; the seconds are printed to 1 ms, a few percent of a tiny step
    assert harness_s > 0 and trl_s > 0 and ratio == pytest.approx(trl_s / harness_s, rel=0.2)
    median, low, high = numbers_after("time-per-step ratio TRL/harness (median of 1 paired steps):", out)
    assert low <= median <= high and median > 0


def test_fsdp_scaling(capsys: pytest.CaptureFixture[str]) -> None:
    """One process under torchrun with the harness's own FSDP2 wrapping, on a model of hidden size 16."""
    load("fsdp_scaling").main(
        "--nproc 1 --batch 2 --seq 4 --steps 1 --warmup 0 --hidden 16 --layers 2 --experts 4".split()
    )
    out = capsys.readouterr().out
    rank, state, peak, step_s, state_ratio, peak_ratio, time_ratio = numbers_after("    1", out)  # procs = 1
    assert (rank, state_ratio, peak_ratio, time_ratio) == (0, 1.0, 1.0, 1.0)
    assert state > 0 and peak > state and step_s > 0


def test_engine_throughput(capfd: pytest.CaptureFixture[str]) -> None:
    """One engine (the default geometry) against `generate`, one ABBA pair of 2 x 2 rows; needs the vllm extra.
    (vLLM writes to sys.stdout's file descriptor, so output is captured at the descriptor level.)"""
    pytest.importorskip("vllm")
    load("engine_throughput").main(
        "--geometry default --prompts 2 --group-size 2 --prompt-len 4 --new-tokens 2 --pairs 1".split()
    )
    out = capfd.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("default"))
    generate_tps, engine_tps = (float(x) for x in re.findall(r"([\d.]+) tok/s", line))
    ratio = re.search(r"engine/generate ([\d.]+)x", line)
    assert generate_tps > 0 and engine_tps > 0 and ratio is not None and float(ratio.group(1)) > 0


def test_gpu_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On a CPU machine the script refuses with its reason; on a GPU it runs the default backend tiny."""
    module = load("gpu_check")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            module.main(f"--out {tmp_path}".split())
        return
    module.main(f"--out {tmp_path} --batch 8 --seq 32 --repeats 1 --backends qwen3_moe".split())
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["backends"]["qwen3_moe"]["self_replay_bitwise"] is True


def test_anchored_cost(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = "cold_start.mode=none rollout.prompts_per_step=2 rollout.group_size=2 task.max_new_tokens=2"
    load("anchored_cost").main(f"--steps 2 --modes none,anchored {tiny} optim.updates_per_rollout=2".split())
    step, low, high, rollout, old, update = numbers_after("anchored / none: step", capsys.readouterr().out)
    assert 0 < low <= step <= high and min(rollout, old, update) > 0


def test_warmup_speed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Two members' warm-ups (2 SFT steps) at length_edge's L4 under two settings, the members in one process each:
    every warm-up reports its steps and CPU time, and each setting's line sums them."""
    argv = "--study length_edge --level L4 --members 1100,1101 --per-process 2 --jobs 2".split()
    argv += ["--setting", "before=", "--setting", "other=cold_start.lr=1e-3", "--keep", str(tmp_path / "w")]
    argv += ["--set", "cold_start.max_steps=2", "--set", "cold_start.eval_every=1", "--set", "task.n_eval=8"]
    load("warmup_speed").main(argv)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("member ")]
    assert len(rows) == 4 and all("2 SFT steps" in row for row in rows)
    cpu = [float(re.search(r"(\d+) CPU s$", row).group(1)) for row in rows if " before:" in row]  # type: ignore[union-attr]
    assert len(cpu) == 2 and numbers_after("before:", out)[1:3] == [2, 4]  # 0 of 2 in band, 4 SFT steps
    assert "before / other CPU per member: median" in out


def test_warmup_speed_ratio_per_start_in_band_over_members() -> None:
    """By hand: the first setting warms 3 members in 100, 300 and 100 CPU s (1,000, 3,000, 1,000 steps), the middle
    one out of band, so 250 CPU s per start in band; the later in 50, 100, 50 (all in band), 66.7 s: 3.75x, in CPU and
    in steps alike, inside its bootstrap interval; the resamples with no start in band under the first are counted,
    not read."""
    ws = load("warmup_speed")

    def rows(setting: str, cpu: list[float], in_band: list[bool]) -> list[dict]:
        return [
            {"member": m, "setting": setting, "cpu_s": c, "steps": c * 10, "in_band": b}
            for m, c, b in zip((1, 2, 3), cpu, in_band, strict=True)
        ]

    both = rows("a", [100, 300, 100], [True, False, True]) + rows("b", [50, 100, 50], [True] * 3)
    lines = ws.member_lines(both, ["a", "b"])
    assert len(lines) == 2 and "CPU s" in lines[0] and "SFT steps" in lines[1]
    for line in lines:
        point, lo, hi = (float(x) for x in re.search(r": ([\d.]+)x \[([\d.]+), ([\d.]+)\]", line).groups())  # type: ignore[union-attr]
        assert point == 3.75 and lo <= point <= hi
    # a resample of member 2 alone has no start in band under `a`: about 1 in 27 of them, counted
    left_out = int(re.search(r"(\d+) resamples without a start in band left out", lines[0]).group(1))  # type: ignore[union-attr]
    assert 0 < left_out < 4000 * 2 / 27
