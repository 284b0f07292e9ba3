#!/usr/bin/env bash
# The control sweeps: `dense_control` (64 runs: qwen3_moe and its dense control) and `phase_mixtral` (72 runs) by
# default, or the presets named (`stabilizers`, `engine_phase`, `engine_mismatch`, ...),
# JOBS (default 2) in parallel, one thread each, into runs/ (untracked; rerunning resumes
# killed runs and skips finished ones). After each sweep: its wall time in runs/<experiment>/wall_time.txt,
# the small per-run files shipped to results/<experiment>/runs (what the claims report reads; route
# snapshots and checkpoints stay behind) and its report in results/<experiment>/.
#   bash scripts/controls.sh                  # both sweeps
#   bash scripts/controls.sh dense_control    # one of them
# Then `python -m moe_rl.report --claims results` decides claim 7 (and the others) from the shipped runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
JOBS=${JOBS:-2}
experiments=("$@")
[ ${#experiments[@]} -gt 0 ] || experiments=(dense_control phase_mixtral)
for exp in "${experiments[@]}"; do
  start=$(date +%s)
  $PY experiments/train.py -m +preset="$exp" results_dir=runs progress=false threads=1 \
    hydra/launcher=joblib hydra.launcher.n_jobs="$JOBS"
  echo "$exp: $(( $(date +%s) - start )) s wall with $JOBS jobs ($(date -u +%FT%TZ))" | tee -a "runs/$exp/wall_time.txt"
  $PY scripts/ship_runs.py "runs/$exp" "results/$exp/runs" --drop-prefix route/flip_vs_margin/
  $PY -m moe_rl.report "results/$exp/runs" --out "results/$exp"
done
