#!/usr/bin/env bash
# Set up .venv and run the whole test suite: bash scripts/test.sh [pytest args]
# The engine tests need the vllm extra, so it is installed by default; EXTRAS= (empty) skips them.
set -euo pipefail
cd "$(dirname "$0")/.."
export EXTRAS="${EXTRAS-vllm}"
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
