#!/usr/bin/env bash
# GPU check of routing on CUDA and of the MegaBlocks backend (docs/megablocks.md), about 10 minutes.
#
#   bash scripts/gpu_check.sh [OUT_DIR]     # OUT_DIR default: $OUT if set, else results/gpu_check
#
# Steps, each with its own log and time limit; a failing step is recorded and the next one runs:
#   install      megablocks 0.10.0 + stanford-stk + grouped_gemm, unless already importable
#   pytest_gpu   pytest -m gpu (self-replay equality, router gradients under forced routes, ...)
#   gpu_check    benchmarks/gpu_check.py: exactness and routing overhead on CUDA, per backend
#   overhead_cpu benchmarks/routing_overhead.py as shipped (CPU), for the same machine's reference
#   sweep_*      the smoke `compare` sweep (grpo,gspo x r2,none) with device=cuda, per family
# OUT_DIR gets summary.txt (every step's rc, time and last lines), gpu_check.json and
# gpu_check.tar.gz (all logs, sweep outputs and report tables): three files, so that a tool that
# returns only a few files from OUT gets them all.
#
# Environment: PYTHON (default python3); WHEELHOUSE=dir for offline installs (wheels or sdists of
# moe_rl's dependencies, megablocks==0.10.0, stanford-stk==0.7.1, grouped_gemm==0.3.0);
# STEP_TIMEOUT (default 300 s). megablocks pins torch==2.7.0: it is installed with --no-deps and
# built against the torch already there (--no-build-isolation), so the check runs on the machine's
# own torch; a build that fails leaves the megablocks tests skipped with the import error as reason.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-results/gpu_check}}
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
export PY WORK WHEELHOUSE=${WHEELHOUSE:-}
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
status=0

step() {  # step NAME TIMEOUT_S CMD...: run CMD (a command or an exported function), log, record rc and time
    local name=$1 limit=$2; shift 2
    local start=$SECONDS rc
    echo "== $name: $*" | tee -a "$SUMMARY"
    timeout "$limit" bash -c '"$@"' _ "$@" > "$WORK/$name.log" 2>&1
    rc=$?
    echo "   rc=$rc in $((SECONDS - start)) s" | tee -a "$SUMMARY"
    tail -n 12 "$WORK/$name.log" | sed 's/^/   | /' >> "$SUMMARY"
    [ "$rc" -eq 0 ] || status=1
    return "$rc"
}

{
    echo "date: $(date -u +%FT%TZ)  git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 2
    $PY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
} >> "$SUMMARY" 2>&1

if ! $PY -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    echo "no CUDA device: nothing to check" | tee -a "$SUMMARY"
    exit 1
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$($PY -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
LIMIT=${STEP_TIMEOUT:-300}

install_all() {
    local pip=("$PY" -m pip install -q --no-build-isolation)
    [ -n "${WHEELHOUSE:-}" ] && pip+=(--no-index --find-links "$WHEELHOUSE")
    if ! $PY -c 'import moe_rl, hydra, datasets' 2>/dev/null; then
        "${pip[@]}" -e ".[test]" || return 1
    fi
    if ! $PY -c 'import megablocks.layers.dmoe' 2>/dev/null; then
        # The extra, without its torch pin: see the header. megablocks 0.10.0's csrc/cumsum.h passes
        # CUB's `debug_synchronous` argument, which CUDA 13's CCCL 3 removed ("no instance of
        # overloaded function cub::DeviceScan::ExclusiveSum"): build it from its sdist without it.
        local src="$WORK/megablocks_src"
        mkdir -p "$src"
        "$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$src" "megablocks==0.10.0" \
            ${WHEELHOUSE:+--no-index --find-links "$WHEELHOUSE"} || return 1
        tar -xzf "$src"/megablocks-0.10.0.tar.gz -C "$src" || return 1
        perl -0pi -e 's/stream,\s*debug_synchronous\)\)/stream))/g' "$src/megablocks-0.10.0/csrc/cumsum.h"
        "${pip[@]}" --no-deps "stanford-stk==0.7.1" "grouped_gemm==0.3.0" "$src/megablocks-0.10.0" || return 1
    fi
    $PY -c 'import importlib.metadata as m, grouped_gemm, megablocks.layers.dmoe; print("megablocks", m.version("megablocks"))'
}
export -f install_all
step install 420 install_all
step pytest_gpu "$LIMIT" "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider tests/
step gpu_check "$LIMIT" "$PY" benchmarks/gpu_check.py --out "$WORK"
cp "$WORK/gpu_check.json" "$OUT_DIR/" 2>/dev/null
step overhead_cpu 120 "$PY" benchmarks/routing_overhead.py --batch 16 --seq 64 --repeats 9

sweep() {  # sweep NAME [overrides...]: the smoke compare sweep on CUDA, then its report
    local name=$1; shift
    "$PY" experiments/train.py -m +preset=smoke device=cuda "$@" \
        results_dir="$WORK/$name" cold_start.cache_dir="$WORK/cold_start" \
        && "$PY" -m moe_rl.report "$WORK/$name/smoke" --out "$WORK/$name/report"
}
export -f sweep
step sweep_default "$LIMIT" sweep sweep_default
if [ -f experiments/conf/model/megablocks.yaml ]; then
    step sweep_megablocks "$LIMIT" sweep sweep_megablocks model=megablocks
else
    echo "== sweep_megablocks: skipped, experiments/conf/model/megablocks.yaml is missing (config hook)" \
        | tee -a "$SUMMARY"
    status=1
fi

tar -C "$WORK" -czf "$OUT_DIR/gpu_check.tar.gz" --exclude='*.safetensors' --exclude='checkpoint.pt' . \
    || echo "archiving failed" >> "$SUMMARY"
echo "status: $status (0: every step passed)" | tee -a "$SUMMARY"
exit "$status"
