#!/usr/bin/env bash
# The main job: set up .venv, run the `compare` sweep (GRPO+R2, GRPO, GSPO, GSPO+R2, one run each
# from each of 5 cold starts) and write its report to results/compare/ (summary.md, summary.csv, figures).
#   bash scripts/compare.sh [extra Hydra overrides, e.g. steps=100]
# Runs go to runs/compare/ (untracked; finished runs are skipped on a rerun; delete runs/ to start
# over). The committed per-run files under results/compare/runs/ (what the notebooks read) are left
# alone unless REFRESH_RUNS=1 asks to replace them with the runs of this sweep.
# JOBS (default 2) runs in parallel, one thread each.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
JOBS=${JOBS:-2}
start=$(date +%s)
$PY experiments/train.py -m +preset=compare results_dir=runs progress=false threads=1 \
  hydra/launcher=joblib hydra.launcher.n_jobs="$JOBS" "$@"
if [ "${REFRESH_RUNS:-0}" = 1 ]; then  # ship the small per-run files the notebooks re-analyse
  $PY scripts/ship_runs.py runs/compare results/compare/runs
fi
$PY -m moe_rl.report runs/compare --out results/compare --pool cold_seed cold_member  # the starts replicate
echo "compare sweep and report: $(( $(date +%s) - start )) s"
