#!/usr/bin/env bash
# The main job: set up .venv, run the `compare` sweep (GRPO+R2, GRPO, GSPO, GSPO+R2 x 3 seeds from
# one shared cold start) and write its report to results/compare/.
#   bash scripts/compare.sh [extra Hydra overrides, e.g. steps=100]
# Runs go to runs/compare/ (finished runs are skipped on a rerun; delete runs/ to start over).
# JOBS (default 2) runs in parallel, one thread each.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
JOBS=${JOBS:-2}
start=$(date +%s)
$PY experiments/train.py -m +experiment=compare results_dir=runs progress=false threads=1 \
  hydra/launcher=joblib hydra.launcher.n_jobs="$JOBS" "$@"
# Keep the small per-run files next to the report so notebooks can re-analyse them.
$PY - <<'PYEOF'
import shutil
from pathlib import Path
src, dst = Path("runs/compare"), Path("results/compare/runs")
for metrics in src.rglob("metrics.parquet"):
    run = metrics.parent
    out = dst / run.relative_to(src)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.parquet", "status.json", "config.yaml", "meta.json"):
        if (run / name).is_file():
            shutil.copy2(run / name, out / name)
PYEOF
$PY -m moe_rl.report results/compare/runs --out results/compare
echo "compare sweep and report: $(( $(date +%s) - start )) s"
