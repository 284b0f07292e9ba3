#!/usr/bin/env bash
# Set up .venv and run the whole test suite: bash scripts/test.sh [pytest args]
# The engine tests need the vllm extra, so it is installed by default; EXTRAS= (empty) skips them.
set -euo pipefail
cd "$(dirname "$0")/.."
export EXTRAS="${EXTRAS-vllm}"
bash scripts/setup.sh
# Two pytest workers (pytest-xdist), torch at one thread each (and in the runs they launch): most tests
# wait on subprocesses and imports, so two workers share 2 cores well, and one thread each keeps the
# compute-bound ones from oversubscribing them (measured on 2 idle cores: 419 s, against 516 s at torch's
# default threads and 687 s in one process). TEST_WORKERS=0 runs in one process.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" "$@"
