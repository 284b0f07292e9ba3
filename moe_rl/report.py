"""Write a report of a results folder: summary.md, summary.csv and figures; the claims page; the index; all of it.

    python -m moe_rl.report RESULTS_DIR [--out OUT_DIR] [--by arm [N ...]] [--pool KEY ...]
                            [--variant auto|all|offpolicy] [--ref ARM] [--presets DIR]
    python -m moe_rl.report --claims [RESULTS_ROOT]                # RESULTS_ROOT/CLAIMS.md
    python -m moe_rl.report --collapse-definitions [RESULTS_ROOT]  # RESULTS_ROOT/collapse_definitions.md
    python -m moe_rl.report --index [RESULTS_ROOT]                 # RESULTS_ROOT/README.md
    python -m moe_rl.report --readme [RESULTS_ROOT]                # README.md's tables generated from the results
    python -m moe_rl.report --all [RESULTS_ROOT]                   # every RESULTS_ROOT/*/runs (or */), then the pages
    python -m moe_rl.report --power RESULTS_DIR --contrast A-B [--mde 0.05] [--warmup-s S --run-s S]
                            [--by COLUMN] [--within KEY ...]        # starts needed for a paired contrast (printed)
    python -m moe_rl.report --cost [RESULTS_ROOT] [--warmup-s S]    # CPU-minutes per declared study and claim (printed)

A folder's runs name the study that made them (the `experiment` their meta.json records: a preset, or a declared
study's name, of one declaration in the registry, `moe_rl.studies.registry`); a row with a report of its own (a declared study's is
`moe_rl.studies.study_rule`'s, from its declaration) writes it whatever the options and wherever `--out` points.
Other runs get the folder report (`moe_rl.analysis.folder_report`): `--by` names the comparison (default arm); every other run key
that varies is added to the grouping unless `--pool` names it, and summary.md says what was added and what was
pooled. Runs are pooled only when they share every config key except the seed (their `config.yaml`): other
differences (a reward, a step count, a data file) become a `config` column of the grouping, unless `--pool`
names those keys too (e.g. `--pool task.reward`). A group whose runs repeat a seed or ran different numbers of
steps is flagged at the top of summary.md. When the runs vary in learning rate and N the report adds the phase
map. Every file is written to a temporary name and renamed into place, so a reader never sees a half-written
report. The studies that decide the claims are declared beside the presets (`--presets`, default experiments/conf/preset
under the working directory), in experiments/conf/study/. `--cost` prints the cost ledger (`moe_rl.analysis.cost`) of
those studies.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

from moe_rl import analysis, studies
from moe_rl.analysis.claims import runs_folder
from moe_rl.analysis.folder_report import write_report
from moe_rl.analysis.pages import README_CLAIMS, readme_claims_table, write_collapse_definitions, write_readme_block
from moe_rl.analysis.power import arm_column, contrast_power_table, describe, load_outcomes, strata
from moe_rl.studies import divergence_report, ledger, study_report
from moe_rl.studies.design import studies_folder
from moe_rl.studies.index import write_index

PRESETS = Path("experiments") / "conf" / "preset"  # from the repository root, where results/ is too
README = Path("README.md")
README_TABLES = (  # (markers, table from RESULTS_ROOT): README.md's generated tables besides the declared studies'
    (README_CLAIMS, readme_claims_table),  # from claims.csv, which --claims writes beside CLAIMS.md
    (divergence_report.README_BLOCK, divergence_report.readme_table),
)  # a declared study adds its own with `readme` in its declaration (`study_report.readme_tables`)


def main(argv: list[str] | None = None) -> int:
    matplotlib.use("Agg")
    parser = argparse.ArgumentParser(prog="python -m moe_rl.report", description=__doc__.splitlines()[0])
    parser.add_argument(
        "results_dir",
        type=Path,
        nargs="?",
        default=None,
        help="folder searched recursively for runs (with --claims/--all: the results root, default `results`)",
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: RESULTS_DIR)")
    parser.add_argument(
        "--by", nargs="+", default=None, help="run keys to compare and group by (default: arm; --power: detected)"
    )
    parser.add_argument("--pool", nargs="+", default=[], help="run keys to average over instead of grouping by")
    parser.add_argument(
        "--variant",
        choices=analysis.tables.VARIANTS,
        default="auto",
        help="route-flip / ratio-variance variant: auto (off-policy where N > 1), all, offpolicy",
    )
    parser.add_argument("--ref", default=None, help="reference value of the first --by key (default grpo+r2)")
    parser.add_argument("--claims", action="store_true", help="write RESULTS_ROOT/CLAIMS.md")
    parser.add_argument(
        "--collapse-definitions",
        action="store_true",
        help="write RESULTS_ROOT/collapse_definitions.md from the stress and compare runs",
    )
    parser.add_argument("--index", action="store_true", help="write RESULTS_ROOT/README.md, the index of the folders")
    parser.add_argument(
        "--readme",
        action="store_true",
        help="regenerate README.md's generated tables (each between its markers: declared studies with a `readme` "
        "and the older studies' blocks) from RESULTS_ROOT",
    )
    parser.add_argument(
        "--all", action="store_true", help="report every RESULTS_ROOT/*/runs into its folder, then the pages"
    )
    parser.add_argument(
        "--presets", type=Path, default=PRESETS, help=f"the presets folder (default {PRESETS.as_posix()})"
    )
    parser.add_argument("--power", type=Path, default=None, help="print the power of a paired contrast of this folder")
    parser.add_argument("--contrast", default=None, help="with --power: arm A against reference B, written A-B")
    parser.add_argument("--mde", type=float, default=0.05, help="with --power: the difference to detect (default 0.05)")
    parser.add_argument(
        "--cost",
        action="store_true",
        help="print the cost ledger of RESULTS_ROOT's declared studies: CPU-minutes per study, run, start, decided claim",
    )
    parser.add_argument(
        "--warmup-s", type=float, default=None, help="with --power/--cost: seconds of one warm-up (a start)"
    )
    parser.add_argument(
        "--run-s", type=float, default=None, help="with --power: seconds of one run (default: the runs' median wall_s)"
    )
    parser.add_argument("--within", nargs="*", default=None, help="with --power: run keys to pair within")
    args = parser.parse_args(argv)
    if args.power is not None:
        return power_report(args, parser)
    if args.cost:
        root = args.results_dir or Path("results")
        print("\n".join(ledger.ledger(root, studies_folder(args.presets), warmup_s=args.warmup_s)))
        return 0
    by = [c for item in (args.by or ["arm"]) for c in item.split(",") if c]
    pool = [c for item in args.pool for c in item.split(",") if c]

    def report_one(out: Path, runs_dir: Path) -> list[Path]:
        """The report of the runs under `runs_dir` into `out`; runs of a study with a report of its own (e.g.
        results/stabilizers) get it whatever the options."""
        study = studies.study_of_runs(runs_dir, args.presets)
        if study is not None and study.report is not None:
            return study.report(runs_dir, out, args.presets)
        return write_report(runs_dir, out, by=by, pool=pool, variant=args.variant, reference=args.ref)

    if args.claims or args.collapse_definitions or args.index or args.readme or args.all:
        root = args.results_dir or Path("results")
        written: list[Path | None] = []
        if args.all:
            folders = [runs_folder(root, p.name) for p in sorted(root.iterdir()) if p.is_dir()]
            for runs_dir in [f for f in folders if any(f.rglob("metrics.parquet"))]:
                try:
                    written += report_one(runs_dir.parent if runs_dir.name == "runs" else runs_dir, runs_dir)
                except (FileNotFoundError, KeyError) as err:
                    print(f"skipped {runs_dir}: {err}", file=sys.stderr)
        if args.all or args.collapse_definitions:
            written.append(write_collapse_definitions(root, studies.COLLAPSE_FOLDERS, args.out))
        if args.all or args.claims:
            written.append(studies.write_claims(root, args.presets, args.out))
        if args.all or args.index:
            written.append(write_index(root, args.presets, args.out))
        if args.readme:  # only when asked: --all writes inside RESULTS_ROOT alone
            for markers, table in (*README_TABLES, *study_report.readme_tables(studies_folder(args.presets))):
                written.append(write_readme_block(README, markers, table(root)))
        for path in written:
            if path is not None:
                print(path)
        return 0

    if args.results_dir is None:
        parser.error("RESULTS_DIR is required (or pass --claims / --collapse-definitions / --index / --all)")
    try:
        # a shipped folder keeps its runs under runs/ (probes or pilots beside them are not its runs)
        files = report_one(args.out or args.results_dir, runs_folder(args.results_dir.parent, args.results_dir.name))
    except (FileNotFoundError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for path in files:
        print(path)
    return 0


def power_report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`--power`: load the folder's runs, pair the contrast's arms and print `power.describe` per stratum."""
    if not args.contrast:
        parser.error("--power needs --contrast A-B")
    try:
        runs = load_outcomes(args.power)
        by = [c for item in args.by for c in item.split(",") if c] if args.by else ["rung", "arm"]
        col, a, b = arm_column(runs, args.contrast, by, others=not args.by)
    except (FileNotFoundError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    keys = [c for c in analysis.run_key_columns(runs) if c in runs and c not in ("value", "wall_s", "last_step")]
    within = args.within if args.within is not None else strata(runs, a, b, col, keys)
    rows = contrast_power_table(
        runs, a, b, within=within, by=col, mde=args.mde, warmup_s=args.warmup_s, run_s=args.run_s
    )
    print(f"{args.power}: {col} {a} against {b}, accuracy change paired on (start, seed)")
    if not rows:
        print(f"  no (start, seed) pairs of {a} and {b} within {within}")
        return 1
    for row in rows:
        print("\n".join(describe(row)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
