#!/usr/bin/env bash
# The main job: set up .venv, run the `compare` sweep (GRPO+R2, GRPO, GSPO, GSPO+R2, one run each
# from each of 5 cold starts), write its report to runs/compare/report/ (summary.md, summary.csv, figures)
# and print how its table stands against the shipped one (results/compare/summary.csv).
#   bash scripts/compare.sh [extra Hydra overrides, e.g. steps=100]
# Runs and report go to runs/compare/ (untracked; finished runs are skipped on a rerun; delete runs/ to
# start over), so the tree stays clean. SHIP=1 writes the report over the shipped one in results/compare/
# and replaces its committed per-run files (what the notebooks read) with this sweep's.
# JOBS (default 2) runs in parallel, one thread each.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
JOBS=${JOBS:-2}
start=$(date +%s)
$PY experiments/train.py -m +preset=compare results_dir=runs progress=false threads=1 \
  hydra/launcher=joblib hydra.launcher.n_jobs="$JOBS" "$@"
OUT=runs/compare/report
if [ "${SHIP:-0}" = 1 ]; then  # ship the report and the small per-run files the notebooks re-analyse
  OUT=results/compare
  $PY scripts/ship_runs.py runs/compare results/compare/runs
fi
$PY -m moe_rl.report runs/compare --out "$OUT" --pool cold_seed cold_member  # the starts replicate
if [ "$OUT" != results/compare ]; then
  $PY -m moe_rl.analysis.shipped results/compare/summary.csv "$OUT/summary.csv"
fi
echo "compare sweep and report: $(( $(date +%s) - start )) s"
