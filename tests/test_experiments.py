"""Every experiment config composes and validates; sweeps dry-run (submitit multiruns: test_distributed)."""

from __future__ import annotations

import copy
import itertools
import math
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT, run_train
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from moe_rl.config import TrainConfig, config_hash, identity_spec, to_train_config, validate
from moe_rl.studies.design import load_study, study_files

CONF = ROOT / "experiments" / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "preset").glob("*.yaml"))
SWEEP_SIZES = {
    "compare": 20,
    "offpolicy": 48,
    "mismatch": 9,
    "families": 72,
    "depth": 36,
    "smoke": 4,
    "stress": 12,
    "drift_scaling": 42,
    "phase": 144,
    "phase_mismatch": 16,
    "phase_edge": 48,
    "drift_scaling_depth": 15,
    "phase_band": 72,
    "drift_forecast": 26,
    "engine_mismatch_stable": 48,
    "engine_mismatch": 40,
    "engine_mismatch_gentle": 40,
    "dense_control": 64,
    "phase_mixtral": 72,
    "stabilizers": 112,
    "engine_phase": 12,
    "mechanism": 88,
    "mechanism_gentle": 110,
    "mechanism_fine": 20,
    "frontier": 64,  # the shared point; the other points come from experiments/frontier.py, one multirun per probe
}
# a preset whose study is declared as it ran: its runs come from the declaration (experiments/study.py NAME), one
# multirun per cell, so its own sweep is one run (a study re-reading its presets' runs, `as_ran`, keeps their sweeps)
AS_RAN = sorted({s.preset for p in study_files(CONF / "study") if (s := load_study(p)).declared and s.as_ran is None})
SWEEP_SIZES |= dict.fromkeys(AS_RAN, 1)
# experiments whose analysis reads only outcome metrics (accuracy, reward, collapse, ratio/token_var, logged on
# every step whatever `metrics.route_every`): they run at the lean defaults
# (the length study reads route flips and the ratio split too, as run means over the route steps, every 10th)
LEAN = {"frontier", *AS_RAN}
# experiments that add seeds to another one's folder (same configs, so its report pools them)
ADDS_TO = {
    "phase_edge": "phase",
    "phase_band": "phase",
    "drift_scaling_depth": "drift_scaling",
    "engine_mismatch_gentle": "engine_mismatch",
}

ConfigStore.instance().store(name="base_config", node=TrainConfig)


def _sweep(experiment: str) -> tuple[list[list[str]], object]:
    """Every override combination of an experiment's sweep."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"+preset={experiment}"], return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params) if cfg.hydra.sweeper.params else {}  # none: one run
    axes = [[f"{k}={v.strip()}" for v in str(values).split(",")] for k, values in params.items()]
    return [list(c) for c in itertools.product(*axes)], cfg


def test_experiment_list_is_complete() -> None:
    assert EXPERIMENTS == sorted(SWEEP_SIZES)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_combination_composes_and_validates(experiment: str) -> None:
    combos, base = _sweep(experiment)
    assert len(combos) == SWEEP_SIZES[experiment]
    text = (CONF / "preset" / f"{experiment}.yaml").read_text()
    assert "# Question:" in text, "each experiment file says which question it answers"
    seen = set()
    # Combinations that differ only in `seed` differ only in `cfg.seed`: Hydra composes the first
    # combination of every other-axes group and every seed of the first group (each axis value goes
    # through Hydra once); the other seeds are set on a copy. Every combination is still validated.
    composed: dict[tuple[str, ...], TrainConfig] = {}
    first = tuple(c for c in combos[0] if not c.startswith("seed="))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for combo in combos:
            rest = tuple(c for c in combo if not c.startswith("seed="))
            seed = [int(c.split("=", 1)[1]) for c in combo if c.startswith("seed=")]
            if rest not in composed or not seed or rest == first:
                cfg = to_train_config(compose("config", overrides=[f"+preset={experiment}", *combo]))
                assert not seed or cfg.seed == seed[0]
                composed.setdefault(rest, cfg)
            else:
                cfg = copy.deepcopy(composed[rest])
                cfg.seed = seed[0]
            cfg = validate(cfg)
            assert cfg.experiment == ADDS_TO.get(experiment, experiment)
            seen.add(
                (
                    cfg.arm,
                    cfg.seed,
                    cfg.model.family,
                    cfg.optim.updates_per_rollout,
                    cfg.model.num_layers,
                    cfg.model.num_experts,
                    cfg.model.top_k,
                    cfg.optim.lr,
                    cfg.rung,
                    cfg.cold_start.seed,
                )
            )
    assert len(seen) == len(combos)  # every combination is a distinct run


def test_every_experiment_logs_every_route_instrument_on_every_step_and_row() -> None:
    """The shipped sweeps' claims and summaries read route/* and ratio/split/* keys at every step: each experiment
    file pins the settings its runs logged them with (`metrics.route_every=1`, the split on all rows), not the
    leaner defaults, so a rerun logs what the shipped run logged and keeps its identity."""
    pinned = []
    firsts = {experiment: _sweep(experiment)[0][0] for experiment in EXPERIMENTS}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for experiment, combo in firsts.items():
            cfg = to_train_config(compose("config", overrides=[f"+preset={experiment}", *combo]))
            pinned.append((experiment, cfg.metrics.route_every, cfg.metrics.split_rows))
    lean = (TrainConfig().metrics.route_every, TrainConfig().metrics.split_rows)
    assert pinned == [(e, *(lean if e in LEAN else (1, None))) for e in EXPERIMENTS]
    assert lean != (1, None)


@pytest.mark.parametrize("adder", sorted(ADDS_TO))
def test_added_seeds_are_runs_of_the_experiment_they_join(adder: str) -> None:
    """A run of `phase_edge` is the `phase` run of the same overrides: same config, so the same config
    hash and run folder, and reports pool the seeds."""
    combos, _ = _sweep(adder)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for combo in (combos[0], combos[-1]):
            ours = to_train_config(compose("config", overrides=[f"+preset={adder}", *combo]))
            theirs = to_train_config(compose("config", overrides=[f"+preset={ADDS_TO[adder]}", *combo]))
            assert ours.to_dict() == theirs.to_dict()
            assert config_hash(ours) == config_hash(theirs)


def test_dense_control_pairs_each_moe_run_with_a_dense_run_from_its_own_cold_start() -> None:
    """Every (cell, arm, seed) of `dense_control` runs both models; each model has one cold start of its own,
    and the cells are the phase map's runs' values (lr 3e-4 with N = 8, lr 1e-3 with N = 2)."""
    from moe_rl.loop.cold_start import expected_key

    combos, _ = _sweep("dense_control")
    families: dict[tuple, set[str]] = {}
    keys: dict[str, set[str]] = {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for combo in combos:
            if "seed=0" not in combo and "seed=7" not in combo:
                continue
            cfg = validate(to_train_config(compose("config", overrides=["+preset=dense_control", *combo])))
            cell = (cfg.optim.lr, cfg.optim.updates_per_rollout, cfg.arm, cfg.seed)
            families.setdefault(cell, set()).add(cfg.model.family)
            keys.setdefault(cfg.model.family, set()).add(expected_key(cfg.model, cfg.task, cfg.cold_start))
    assert {c[:3] for c in families} == {
        (lr, n, arm) for lr, n in ((3e-4, 8), (1e-3, 2)) for arm in ("grpo+none", "gspo+none")
    }
    assert (
        all(f == {"qwen3_moe", "qwen3_dense"} for f in families.values()) and len(families) == 8
    )  # 4 cells x seeds 0, 7
    assert [len(k) for k in keys.values()] == [1, 1] and keys["qwen3_moe"] != keys["qwen3_dense"]


def test_experiment_deltas() -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        mismatch = to_train_config(compose("config", overrides=["+preset=mismatch", "replay=r3"]))
        default = to_train_config(compose("config"))
        gspo = to_train_config(compose("config", overrides=["algo=gspo"]))
    assert mismatch.rollout.dtype == "bfloat16" and mismatch.replay.mode == "r3"
    # config groups add nothing to the dataclass defaults (task files spell out their kwargs' defaults)
    assert identity_spec(default.to_dict()) == identity_spec(TrainConfig().to_dict())
    assert default.task.kwargs == {"min_len": 3, "max_len": 6}
    assert gspo.algo.eps() == (3e-4, 4e-4) and default.algo.eps() == (0.2, 0.27)


# every method's arm: what it sets, and the arm name its runs carry
ARMS = {
    "sapo_none": ("sapo+none", lambda c: c.algo.loss_kwargs() == {"tau_pos": 1.0, "tau_neg": 1.05}),
    "cispo_none": ("cispo+none", lambda c: c.algo.agg == "token-mean" and c.algo.eps() == (1.0, 0.28)),
    "grpo_rspo": ("grpo+none+rspo", lambda c: c.algo.router_shift and c.algo.router_shift_floor == 0.5),
    "grpo_r2_threshold": ("grpo+r2_threshold", lambda c: c.replay.threshold == 0.5),
    "grpo_r3_threshold": ("grpo+r3_threshold", lambda c: c.rollout.record_routes),
    "grpo_trr": ("grpo+trr", lambda c: c.replay.mode == "trr"),
    "grpo_tis": ("grpo+none+tis", lambda c: c.rollout.is_cap == 2.0 and c.rollout.is_level == "token"),
    "grpo_mis": ("grpo+none+mis", lambda c: c.rollout.is_cap == 2.0),
    "grpo_icepop": ("grpo+none+icepop", lambda c: (c.rollout.is_low, c.rollout.is_high) == (0.5, 5.0)),
    "dppo_tv_none": (
        "dppo_tv+none",
        lambda c: c.algo.loss_kwargs() == {"eps_low": 0.15, "eps_high": 0.15, "kl_tau": 0.0},
    ),
    "dppo_kl_none": (
        "dppo_kl+none",
        lambda c: c.algo.loss_kwargs() == {"eps_low": 0.05, "eps_high": 0.05, "kl_tau": 0.0},
    ),
    "vespo_none": (
        "vespo+none",
        lambda c: (
            c.algo.agg == "token-mean"
            and c.algo.loss_kwargs() == {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}
        ),
    ),
    "grpo_offpolicy_mask": (
        "grpo+none+opsm=0.5",
        lambda c: c.algo.loss_kwargs() == {"eps_low": 0.2, "eps_high": 0.27, "offpolicy_mask_delta": 0.5},
    ),
    "is_none": (
        "grpo+none+eps_low=1+eps_high=inf",
        lambda c: c.algo.eps() == (1.0, math.inf) and c.algo.agg == "seq-mean-token-mean",
    ),
    "sapo_tau5": ("sapo+none+tau_pos=5+tau_neg=5", lambda c: c.algo.loss_kwargs() == {"tau_pos": 5.0, "tau_neg": 5.0}),
    "sapo_tau10": (
        "sapo+none+tau_pos=10+tau_neg=10",
        lambda c: c.algo.loss_kwargs() == {"tau_pos": 10.0, "tau_neg": 10.0},
    ),
    "cispo_verl": (
        "cispo+none+eps_low=0.2+eps_high=0.2",
        lambda c: c.algo.agg == "token-mean" and c.algo.eps() == (0.2, 0.2),
    ),
}


@pytest.mark.parametrize(
    ("algo", "match"),
    [
        ({"name": "vespo", "lambda_pos": 0.0}, r"algo.lambda_pos=0.0 must be > 0"),
        ({"name": "vespo", "k_neg": -1.0}, r"algo.k_neg=-1.0 must be >= 0"),
        ({"name": "dppo_tv", "kl_tau": -1e-3}, r"algo.kl_tau=-0.001 must be >= 0"),
        ({"name": "dppo_kl", "eps_low": 2.0}, r"algo.eps_low=2.0 must lie in \[0, 1\]"),
        ({"name": "grpo", "kl_tau": 1e-3}, r"algo.kl_tau is not a parameter of algo.name='grpo'"),
        ({"name": "sapo", "k_pos": 1.0}, r"algo.k_pos is not a parameter of algo.name='sapo'"),
        ({"name": "vespo", "eps_high": 0.3}, r"algo.eps_high is not a parameter of algo.name='vespo'"),
        ({"name": "gspo", "offpolicy_mask_delta": -0.5}, r"algo.offpolicy_mask_delta=-0.5 must be >= 0"),
    ],
)
def test_loss_hyperparameters_are_checked_naming_the_key(algo: dict, match: str) -> None:
    cfg = TrainConfig()
    for key, value in algo.items():
        setattr(cfg.algo, key, value)
    with pytest.raises(ValueError, match=match):
        validate(cfg)


def test_arm_names_the_loss_hyperparameters_away_from_the_paper() -> None:
    """Two arms of one loss never share a name; a value set to the paper's own leaves the name as it was."""
    cfg = TrainConfig()
    cfg.algo.eps_high = 0.27  # GRPO's default, set explicitly
    assert cfg.arm == "grpo+none"
    cfg.algo.eps_low, cfg.algo.offpolicy_mask_delta = 0.1, 0.25
    assert cfg.arm == "grpo+none+opsm=0.25+eps_low=0.1"
    assert cfg.algo.loss_kwargs() == {"eps_low": 0.1, "eps_high": 0.27, "offpolicy_mask_delta": 0.25}
    cfg.algo.name = "not_a_loss"
    assert cfg.arm == "not_a_loss+none+opsm=0.25"  # validate() names the bad key; the name must not fail first


def test_new_loss_keys_leave_the_shipped_identity_alone() -> None:
    """The algo keys DPPO, VESPO and the off-policy mask added are out of a run's identity while unset (the shipped
    runs keep their config hash); set, they are in it."""
    added = {"kl_tau", "k_pos", "lambda_pos", "k_neg", "lambda_neg", "offpolicy_mask_delta"}
    assert not added & set(identity_spec(TrainConfig().to_dict())["algo"])
    cfg = TrainConfig()
    cfg.algo.offpolicy_mask_delta = 0.5
    assert config_hash(cfg) != config_hash(TrainConfig())


# Keys added after the oldest shipped runs that stay in a run's identity at their default: most shipped runs
# were made after `model.moe_intermediate_size` came and hash it at null, so leaving it out at null would move
# their identity; only the oldest folders (stress, offpolicy, mismatch) lack it.
HASHED_AT_DEFAULT = {"model.moe_intermediate_size"}


def test_every_key_added_since_the_oldest_shipped_config_has_its_default_in_identity() -> None:
    """A config key that a shipped run's config.yaml lacks is in `run/identity.py`'s ADDED_DEFAULTS (or ADDED_TOP), so
    the shipped runs keep their identity: a new key cannot forget its second home. One config per shipped folder
    (a folder's runs share their schema); the oldest, results/stress, lacks the most."""
    from moe_rl.run.identity import ADDED_DEFAULTS, ADDED_TOP, NOT_IDENTITY

    def keys(cfg: dict) -> set[str]:
        return {f"{k}.{kk}" for k, v in cfg.items() if isinstance(v, dict) for kk in v} | {
            k for k, v in cfg.items() if not isinstance(v, dict)
        }

    now = {k for k in keys(TrainConfig().to_dict()) if k.split(".")[0] not in NOT_IDENTITY}
    homes = set(ADDED_TOP) | {f"{section}.{k}" for section, defaults in ADDED_DEFAULTS.items() for k in defaults}
    assert homes <= keys(TrainConfig().to_dict()), "ADDED_DEFAULTS names a key the config no longer has"
    shipped = {path.parent.parent.parent.name: path for path in sorted(ROOT.glob("results/*/runs/*/config.yaml"))}
    assert len(shipped) >= 15 and "stress" in shipped
    missing = {folder: now - keys(OmegaConf.to_container(OmegaConf.load(path))) for folder, path in shipped.items()}
    homeless = {folder: sorted(lacks - homes - HASHED_AT_DEFAULT) for folder, lacks in missing.items()}
    assert {folder: lacks for folder, lacks in homeless.items() if lacks} == {}
    assert max(missing.values(), key=len) == missing["stress"]  # the oldest


def test_every_loss_and_replay_mode_has_its_config_group_file() -> None:
    from moe_rl.algos import LOSSES
    from moe_rl.routing.modes import REPLAY_MODES

    assert {p.stem for p in (CONF / "algo").glob("*.yaml")} == set(LOSSES)
    assert {p.stem for p in (CONF / "replay").glob("*.yaml")} == set(REPLAY_MODES)


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_every_method_arm_composes_and_validates(arm: str) -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = validate(to_train_config(compose("config", overrides=[f"+arm={arm}"])))
        engine = validate(
            to_train_config(
                compose("config", overrides=[f"+arm={arm}", "model=qwen3_moe_engine", "rollout.engine=vllm"])
            )
        )
    name, check = ARMS[arm]
    assert cfg.arm == name == engine.arm and check(cfg)
    assert {p.stem for p in (CONF / "arm").glob("*.yaml")} >= set(ARMS)


def test_invalid_override_is_rejected_before_work() -> None:
    """Composed as a launch composes it, the invalid value is refused by validation, which a launch runs before any
    work (a launch of it fails with this message, writes no metrics and marks its folder invalid:
    test_cli.test_a_bad_config_value_ends_the_launch_with_its_one_line_and_marks_its_folder_invalid)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = to_train_config(compose("config", overrides=["algo=gspo", "optim.lr=-1"]))
    assert cfg.algo.name == "gspo"
    with pytest.raises(ValueError, match=r"^optim.lr=-1.0 must be > 0$"):
        validate(cfg)


def _multirun(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """`python experiments/train.py -m ARGS results_dir=TMP_PATH`, the script run in this process (`run_train`: its
    Hydra entry point and launcher as a launch runs them, no interpreter to start)."""
    out = run_train("-m", *args, f"results_dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    return out


# Every combination of every experiment is composed and validated in-process above; through Hydra's
# own launcher (the whole sweep, each job's run folder and its progress lines) we dry-run the main job's sweep.
@pytest.mark.parametrize("experiment", ["compare"])
def test_multirun_dry_run(experiment: str, tmp_path) -> None:
    """Each run of the sweep dry-runs, none writes metrics, and the sweep reports its runs: the launch line (how
    many to run, how many read as finished) and "k of n runs done" after each job."""
    out = _multirun([f"+preset={experiment}", "dry_run=true"], tmp_path)
    n = SWEEP_SIZES[experiment]
    assert out.stderr.count("dry run ") + out.stdout.count("dry run ") == n
    assert not list(tmp_path.rglob("metrics.parquet"))
    text = out.stdout + out.stderr
    assert [f"{k} of {n} runs done" in text for k in range(1, n + 1)] == [True] * n
    assert f"sweep: {n} runs, {n} to run, 0 read as finished (skipped)" in text


def test_short_name_never_nests_and_keeps_values_apart() -> None:
    from moe_rl.run.launch import short_name

    a, b = short_name("model.checkpoint=/a/ckpt,seed=0"), short_name("model.checkpoint=/b/ckpt,seed=0")
    assert a == "model.checkpoint=%2Fa%2Fckpt,seed=0" and "/" not in b and a != b
    assert short_name("x=50%/y") == "x=50%25%2Fy"  # '%' is escaped too, so the mapping stays one-to-one
    long = short_name("model.checkpoint=/" + "d/" * 80 + "ckpt")
    assert len(long) == 96 and "/" not in long
    assert long != short_name("model.checkpoint=/" + "d/" * 80 + "ckpt2")
    assert short_name("algo=grpo,seed=1") == "algo=grpo,seed=1"  # names without '/' are unchanged


def test_sweep_over_values_with_slashes_gives_one_folder_per_run(tmp_path) -> None:
    # A string key with '/' in its values (task.system_prompt is only read by dataset tasks).
    out = _multirun(
        ["+preset=smoke", "algo=grpo", "replay=none", "task.system_prompt=x/a/ckpt,y/b/ckpt", "dry_run=true"],
        tmp_path,
    )
    dirs = sorted(
        line.split(": ", 1)[1].strip() for line in (out.stdout + out.stderr).splitlines() if "dry run " in line
    )
    assert len(dirs) == 2 and len(set(Path(d).name for d in dirs)) == 2
    assert all(Path(d).parent == tmp_path / "smoke" for d in dirs), dirs
