"""Run a declared study (`experiments/conf/study/NAME.yaml`, `moe_rl.studies.design`) look by look.

    python experiments/study.py NAME --dry-run            # the declaration's multiruns, nothing run
    python experiments/study.py NAME [--jobs 2] [--runs runs] [--look K]

One Hydra multirun of `experiments/train.py` per cell (arm@level) over the seeds of the look's starts, into
<runs>/NAME/runs/<arm>@<level>/. A look runs the starts up to its declared count (the earlier looks' runs are read,
not rerun), then decides each contrast at that look by the one rule (`moe_rl.studies.study_rule`) and writes the
study's report into <runs>/NAME/. The looks run in order, stopping after the first at which every contrast has
stopped (its efficacy boundary reached, the claimed effect excluded, or its futility boundary crossed: the remaining
looks cannot move it), else at the last (a floor or a flat reference at an earlier look does not stop it, nor does an
unmatched contrast: more starts can change the means, the ratio and the placebo it is read on); `--look K` runs look
K alone.

A study matched per start (`match.reference` in its declaration, `moe_rl.studies.matching`) first runs each look's
probes: one multirun per cell and bracket multiplier over the look's seeds, `match.probe_steps` steps each, into
<runs>/NAME/probes/<arm>@<level>@x<multiplier>/ (the reference at its declared lr alone); it then solves each seed's
lr from them (and, where it declares `match.confirm`, probes each seed at those multipliers of its solved lr, one
process per seed into <runs>/NAME/probes/<arm>@<level>@c<multiplier>/, and takes the lr of its probe nearest the
reference's KL; with `match.per: pool`, only the first look's seeds probe and each arm runs every seed at the one
lr its probes give) into <runs>/NAME/match/lrs.csv (kept once written) and runs the reference's cells as above and every
other arm's runs one seed at a time, each at its own lr, `--jobs` at a time. `--dry-run` prints the probes; the full
runs' lrs come from them. A probe longer than 15% of its run's steps is refused.

A pilot (`pilot:` in its declaration, no contrasts: `moe_rl.studies.pilot`) runs its cells look by look the same way
and decides nothing: after each look it writes <runs>/NAME/summary.md, each cell's change over starts and the edge
its reference reaches (the level in `pilot.loss`), with the starts a study there needs.

Runs go to `runs/` (untracked) unless `--runs` says otherwise; a shipped study runs into `--runs results`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd

from moe_rl.studies import matching
from moe_rl.studies.design import Study, load_study, study_path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STUDIES = HERE / "conf" / "study"


def train_command(overrides: list[str], experiment: str, out: Path, seeds: list[int], jobs: int | None) -> list[str]:
    """A multirun of `experiments/train.py` over `seeds` into `out` (joblib with `jobs` at a time; `jobs` None: the
    basic launcher, in process)."""
    launcher = ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={jobs}"] if jobs is not None else []
    return [
        sys.executable,
        "experiments/train.py",
        "-m",
        *overrides,
        f"experiment={experiment}",
        f"out_dir={out}",
        f"seed={','.join(str(s) for s in seeds)}",
        "progress=false",
        "threads=1",
        *launcher,
    ]


def cell_command(study: Study, arm: str, level: str, starts: int, runs: Path, jobs: int) -> list[str]:
    out = runs / study.name / "runs" / f"{arm}@{level}"
    return train_command(study.run_overrides(arm, level), study.name, out, study.seeds(starts, (arm, level)), jobs)


def at_lr_command(
    study: Study, arm: str, level: str, lr: float, seeds: list[int], out: Path, jobs: int | None, probe: bool
) -> list[str]:
    """A multirun of a cell at `lr` over `seeds` into `out`: its full runs, or (`probe`) their first
    `match.probe_steps` steps under the study's probe experiment."""
    assert study.match is not None
    over = matching.with_override(study.run_overrides(arm, level), "optim.lr", matching.lr_text(lr))
    if probe:
        over = matching.with_override(over, "steps", study.match.probe_steps)
    return train_command(over, f"{study.name}_probe" if probe else study.name, out, seeds, jobs)


def probe_command(
    study: Study, arm: str, level: str, multiplier: float, seeds: list[int], runs: Path, jobs: int
) -> list[str]:
    """The multirun of one cell's probes at one multiplier of its declared lr, under <runs>/NAME/probes/
    (`matching.probe_folder`)."""
    out = runs / study.name / "probes" / matching.probe_folder(arm, level, multiplier)
    return at_lr_command(study, arm, level, matching.probe_lr(study, arm, level, multiplier), seeds, out, jobs, True)


def matched_command(study: Study, arm: str, level: str, seed: int, lr: float, runs: Path) -> list[str]:
    """One run of a matched cell at its seed's own lr, into the cell's folder (named as the multirun names it)."""
    return at_lr_command(study, arm, level, lr, [seed], runs / study.name / "runs" / f"{arm}@{level}", None, False)


def run_steps(study: Study) -> dict[tuple[str, str], int]:
    """Each cell's `steps` as its runs compose it (Hydra, the study's overrides on its preset, validated as a run
    validates it); a cell that does not compose (an override naming no config, a key the config lacks, a value a run
    refuses) is refused in one line naming the declaration, the cell and why."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from moe_rl.config import TrainConfig, to_train_config, validate

    ConfigStore.instance().store(name="base_config", node=TrainConfig)
    out = {}
    with initialize_config_dir(config_dir=str(HERE / "conf"), version_base="1.3"):
        for arm, level in study.cells():
            try:
                cfg = validate(
                    to_train_config(compose("config", overrides=[*study.run_overrides(arm, level), "seed=0"]))
                )
            except Exception as err:  # Hydra's and the config's refusals alike: one line, the first of its message
                why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise ValueError(f"{study.file}: cell {arm}@{level} does not compose: {why}") from None
            out[(arm, level)] = int(cfg.steps)
    return out


def probe_cost(study: Study) -> str:
    """Refuse a probe above `matching.MAX_PROBE_SHARE` of any cell's run; else the probes' cost, in steps, per seed."""
    assert study.match is not None
    steps = run_steps(study)
    shares = [matching.check_probe_cost(study.match.probe_steps, n, f"{a}@{lv}") for (a, lv), n in steps.items()]
    per_seed = matching.probes_per_seed(study)
    total = {lv: sum(n for (_, lv2), n in steps.items() if lv2 == lv) for lv in per_seed}
    each = ", ".join(
        f"{lv}: {k} probes per seed, {k * study.match.probe_steps / total[lv]:.0%} of its {total[lv]} run steps"
        for lv, k in per_seed.items()
    )
    if study.match.pooled:
        each += f"; the first look's {study.design.looks[0]} starts alone probe (one lr per arm, `match.per: pool`)"
    return (
        f"probes of {study.match.probe_steps} steps, {min(shares):.0%}-{max(shares):.0%} of a run's steps each; {each}"
    )


def finished_at(folder: Path) -> set[tuple[int, str]]:
    """(seed, lr as launched) of every finished run under `folder` (its config.yaml): a matched run or probe found
    here is not launched again (a run skips its finished folder itself, but each launch costs a process)."""
    import yaml

    from moe_rl.run.launch import finished_status

    done = set()
    for path in folder.glob("*/config.yaml"):
        if finished_status(path.parent, None) is not None:
            cfg = yaml.safe_load(path.read_text())
            done.add((int(cfg["seed"]), matching.lr_text(float(cfg["optim"]["lr"]))))
    return done


def run_probes(study: Study, starts: int, runs: Path, jobs: int, dry_run: bool) -> list[str]:
    """Each cell's probes at each of its multipliers over the look's seeds (those not probed yet; with `match.per:
    pool`, the first look's seeds alone)."""
    failed = []
    starts = matching.probe_starts(study, starts)
    for arm, level, mult in matching.probe_cells(study):
        seeds = study.seeds(starts, (arm, level))
        name = matching.probe_folder(arm, level, mult)
        if not dry_run and seeds:
            done = finished_at(runs / study.name / "probes" / name)
            lr = matching.lr_text(matching.probe_lr(study, arm, level, mult))
            seeds = [s for s in seeds if (s, lr) not in done]
            if not seeds:
                print(f"[probe {name}] every probe of the look finished", flush=True)
        if not seeds:
            continue
        cmd = probe_command(study, arm, level, mult, seeds, runs, jobs)
        print(f"[probe {name}] " + " ".join(cmd[2:]), flush=True)
        if not dry_run and subprocess.run(cmd, cwd=ROOT).returncode != 0:
            failed.append(f"probe {matching.probe_folder(arm, level, mult)}")
            print(f"{study.name}: a probe of {arm}@{level} at x{mult:g} failed; going on", flush=True)
    return failed


def run_each(commands: list[tuple[str, list[str]]], jobs: int) -> list[str]:
    """Run each (name, command), `jobs` at a time, one process each; the names of those that exited non-zero."""
    if not commands:
        return []
    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        codes = list(pool.map(lambda c: subprocess.run(c[1], cwd=ROOT).returncode, commands))
    return [name for (name, _), code in zip(commands, codes, strict=True) if code != 0]


def confirm_command(
    study: Study, arm: str, level: str, multiplier: float, seed: int, lr: float, runs: Path
) -> list[str]:
    """One confirm probe: the seed's run at `lr` (a multiplier of its solved lr) for `match.probe_steps` steps, under
    <runs>/NAME/probes/ (`matching.confirm_folder`)."""
    out = runs / study.name / "probes" / matching.confirm_folder(arm, level, multiplier)
    return at_lr_command(study, arm, level, lr, [seed], out, None, True)


def run_confirm_probes(study: Study, starts: int, runs: Path, jobs: int, dry_run: bool) -> list[str]:
    """Each matched seed's confirm probes (`match.confirm` multipliers of its solved lr) not run yet, `--jobs` at a
    time; a seed whose lr was written before (an earlier look's) takes none."""
    assert study.match is not None
    if not study.match.confirm:
        return []
    if dry_run:
        for arm, level in matching.matched_cells(study):
            mults = ", ".join(f"x{c:g}" for c in study.match.confirm)
            print(f"[confirm {arm}@{level}] each seed's probes at {mults} of its solved lr", flush=True)
        return []
    folder = runs / study.name / "probes"
    probes = matching.read_probes(folder, study)
    wanted = matching.confirm_probes(matching.solved_lrs(study, probes), study.match.confirm)
    kept = matching.read_lrs(matching.lrs_path(runs, study))
    written = set() if kept is None else set(zip(kept["seed"], kept["arm"], kept["level"], strict=True))
    commands: list[tuple[str, list[str]]] = []
    done: dict[str, set[tuple[int, str]]] = {}
    for p in wanted.itertuples():
        seed, arm, level, mult, lr = int(p.seed), str(p.arm), str(p.level), float(p.multiplier), float(p.lr)
        name = matching.confirm_folder(arm, level, mult)
        if seed not in study.seeds(starts, (arm, level)) or (seed, arm, level) in written:
            continue
        if name not in done:
            done[name] = finished_at(folder / name)
        if (seed, matching.lr_text(lr)) not in done[name]:
            commands.append((name, confirm_command(study, arm, level, mult, seed, lr, runs)))
    print(f"[confirm] {len(commands)} probes at {len(study.match.confirm)} multipliers of each seed's solved lr")
    failed = []
    for name in run_each(commands, jobs):
        failed.append(f"probe {name}")
        print(f"{study.name}: a confirm probe of {name} failed; going on", flush=True)
    return failed


def choose_lrs(study: Study, runs: Path, starts: int) -> pd.DataFrame:
    """Each matched seed's lr (of the first `starts` members) from the probes run so far, the rows written before
    kept (`matching.study_lrs`)."""
    path = matching.lrs_path(runs, study)
    probes = matching.read_probes(runs / study.name / "probes", study)
    lrs = matching.study_lrs(study, probes, matching.read_lrs(path), starts)
    matching.write_lrs(lrs, path)
    return lrs


def run_matched_look(study: Study, starts: int, runs: Path, jobs: int, dry_run: bool) -> list[str]:
    """A look of a study matched per start: its probes, each seed's lr, the reference's multiruns, then every other
    arm's runs one seed at a time at its own lr."""
    assert study.match is not None and study.match.reference is not None
    failed = run_probes(study, starts, runs, jobs, dry_run)
    failed += run_confirm_probes(study, starts, runs, jobs, dry_run)
    path = matching.lrs_path(runs, study)
    lrs = None if dry_run else choose_lrs(study, runs, starts)
    singles: list[tuple[str, list[str]]] = []
    for arm, level in study.cells():
        seeds = study.seeds(starts, (arm, level))
        if not seeds:
            continue
        if arm == study.match.reference:
            if not dry_run:  # a resumed look: the reference's runs finished at its declared lr launch nothing
                done = finished_at(runs / study.name / "runs" / f"{arm}@{level}")
                lr = matching.lr_text(matching.declared_lr(study, arm, level))
                if all((s, lr) in done for s in seeds):
                    print(f"[{arm}@{level}] every run of the look finished", flush=True)
                    continue
            cmd = cell_command(study, arm, level, starts, runs, jobs)
            print(f"[{arm}@{level}] " + " ".join(cmd[2:]), flush=True)
            if not dry_run and subprocess.run(cmd, cwd=ROOT).returncode != 0:
                failed.append(f"{arm}@{level}")
                print(f"{study.name}: a run of {arm}@{level} failed (its status.json says why); going on", flush=True)
            continue
        if lrs is None:
            each = "one lr the first look's probes give" if study.match.pooled else "the lr its seed's probes give"
            print(f"[{arm}@{level}] {len(seeds)} runs, each at {each} ({path})", flush=True)
            continue
        chosen = matching.seed_lrs(lrs, arm, level, seeds)
        cell = lrs[(lrs["arm"] == arm) & (lrs["level"] == level)].set_index("seed")
        done = finished_at(runs / study.name / "runs" / f"{arm}@{level}")
        finished = [s for s in seeds if s in chosen and (s, matching.lr_text(chosen[s])) in done]
        if finished:
            print(f"[{arm}@{level}] {len(finished)} runs finished at their seeds' lrs", flush=True)
        for seed in (s for s in seeds if s not in finished):
            if seed not in chosen:
                failed.append(f"{arm}@{level}")
                why = cell.loc[seed, "status"] if seed in cell.index else "no probes"
                print(f"{study.name}: seed {seed} of {arm}@{level} is not matched ({why}); its run waits", flush=True)
                continue
            row = cell.loc[seed]
            print(
                f"[{arm}@{level}] seed {seed} at lr {matching.lr_text(chosen[seed])} (x{row['multiplier']:.3f} of "
                f"{matching.lr_text(row['lr_declared'])}, {row['status']}, slope {row['slope']:.2f} "
                f"{row['slope_from']})",
                flush=True,
            )
            singles.append((f"{arm}@{level}", matched_command(study, arm, level, seed, chosen[seed], runs)))
    for cell_name in run_each(singles, jobs):
        failed.append(cell_name)
        print(f"{study.name}: a run of {cell_name} failed (its status.json says why); going on", flush=True)
    return failed


def run_look(study: Study, look: int, runs: Path, jobs: int, dry_run: bool) -> list[str]:
    """Every cell's multirun for the look's starts; the cells where a run failed (the others still run, and the
    look is decided on the pairs that finished)."""
    starts = study.design.looks[look]
    print(f"== {study.name}: look {look + 1} of {len(study.design.looks)}, {starts} starts", flush=True)
    if study.match is not None and study.match.probes:
        return run_matched_look(study, starts, runs, jobs, dry_run)
    failed = []
    for arm, level in study.cells():
        if not study.seeds(starts, (arm, level)):  # every seed of this look skipped as the study ran (`not_run`)
            continue
        cmd = cell_command(study, arm, level, starts, runs, jobs)
        print(f"[{arm}@{level}] " + " ".join(cmd[2:]), flush=True)
        if not dry_run and subprocess.run(cmd, cwd=ROOT).returncode != 0:
            failed.append(f"{arm}@{level}")
            print(f"{study.name}: a run of {arm}@{level} failed (its status.json says why); going on", flush=True)
    return failed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="a study declared in experiments/conf/study/")
    ap.add_argument("--runs", type=Path, default=Path("runs"), help="runs land in <runs>/NAME/runs (default: runs/)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    ap.add_argument("--look", type=int, default=None, help="run look K (1-based) only; default: each look in turn")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--studies", type=Path, default=STUDIES, help="the folder of declarations")
    args = ap.parse_args(argv)
    args.runs = args.runs.resolve()  # the runs are launched from the repository root and read from here
    try:
        study = load_study(study_path(args.name, args.studies))
    except ValueError as err:
        sys.exit(f"error: {err}")
    if study.as_ran is not None and not args.dry_run:
        sys.exit(
            f"error: {study.name} re-reads runs its presets made (as_ran): launch those presets "
            f"(experiments/conf/preset/{study.preset}.yaml), not the declaration"
        )
    try:  # a study declared as it ran composed as it ran (tests/test_study.py composes every declaration's cells)
        if not study.declared:
            run_steps(study)
    except ValueError as err:
        sys.exit(f"error: {err}")
    if study.match is not None and study.match.probes:
        try:
            print(
                f"{study.name}: matched {study.match.scope} to {study.match.reference}: {probe_cost(study)}", flush=True
            )
        except ValueError as err:
            sys.exit(f"error: study {study.name}: {err}")
    from moe_rl.studies.study_report import write_study_report
    from moe_rl.studies.study_rule import analyse, decided

    looks = range(len(study.design.looks))
    if args.look is not None:
        if not 1 <= args.look <= len(looks):
            sys.exit(f"error: --look {args.look}: {study.name} declares looks 1..{len(looks)}")
        looks = range(args.look - 1, args.look)
    failed: list[str] = []
    for look in looks:
        failed += run_look(study, look, args.runs, args.jobs, args.dry_run)
        if args.dry_run:
            continue
        if study.pilot is not None:  # a pilot decides nothing: its table and the edge it reads, after every look
            from moe_rl.studies.pilot import write_pilot_report
            from moe_rl.studies.study_rule import per_run

            summary = write_pilot_report(study, per_run(args.runs / study.name / "runs"), args.runs / study.name)[0]
            print(summary.read_text(), flush=True)
            continue
        result = analyse(study, args.runs / study.name / "runs")
        write_study_report(study, result, args.runs / study.name)
        print(result.verdicts.to_string(index=False), flush=True)
        if decided(result):
            print(
                f"{study.name}: every contrast stopped (efficacy, exclusion or futility) or reached its last look at look "
                f"{look + 1}; stopping",
                flush=True,
            )
            break
    if failed:
        sys.exit(f"{study.name}: runs failed in {sorted(set(failed))}; rerun the same command to retry them")


if __name__ == "__main__":
    main()
