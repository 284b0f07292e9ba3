#!/usr/bin/env bash
# GPU check of moe_rl on the lent H200: routing on CUDA, MegaBlocks backend, smoke sweep on cuda.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
R=$PWD
S=$OUT/summary.txt
log() { echo "$@" | tee -a "$S"; }
step() { local name=$1 lim=$2; shift 2; local t=$SECONDS; log "== $name"; timeout "$lim" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; log "   rc=$rc in $((SECONDS-t)) s"; tail -n 15 "$OUT/$name.log" | sed 's/^/   | /' >> "$S"; return $rc; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$S" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl > "$OUT/pip.log" 2>&1 || log "wheel install failed"
export PYTHONPATH=/tmp/site:$R
python3 -c 'import torch, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)' >> "$S" 2>&1
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=14
# MegaBlocks build in the background while the transformers-backend checks run
( mkdir -p /tmp/mbsrc && cd /tmp/mbsrc && for f in "$R"/.gpu/whl/src/*.tar.gz; do tar xzf "$f"; done
  perl -0pi -e 's/stream,\s*debug_synchronous\)\)/stream))/g' megablocks-0.10.0/csrc/cumsum.h  # CCCL 3 dropped the argument
  t=$SECONDS; timeout 300 python3 -m pip install --no-index --no-deps --no-build-isolation --no-compile --target /tmp/mb \
      ./stanford_stk-0.7.1 ./grouped_gemm-0.3.0 ./megablocks-0.10.0 > "$OUT/mb_build.log" 2>&1; echo "rc=$? in $((SECONDS-t)) s" >> "$OUT/mb_build.log" ) &
MB=$!
step sweep_cuda 120 env HYDRA_FULL_ERROR=1 python3 experiments/train.py -m +experiment=smoke device=cuda results_dir=/tmp/sw cold_start.cache_dir=/tmp/cs
step run_r3_bf16 90 env HYDRA_FULL_ERROR=1 python3 experiments/train.py +experiment=smoke device=cuda replay=r3 rollout.dtype=bfloat16 out_dir=/tmp/r3 cold_start.cache_dir=/tmp/cs
step report 60 python3 -m moe_rl.report /tmp/sw/smoke --out /tmp/sw/report
wait $MB; log "== mb_build: $(tail -n 1 $OUT/mb_build.log)"
export PYTHONPATH=/tmp/mb:/tmp/site:$R
if python3 -c 'import megablocks.layers.dmoe, grouped_gemm' >> "$S" 2>&1; then
  step sweep_mb 90 env HYDRA_FULL_ERROR=1 python3 experiments/train.py -m +experiment=smoke device=cuda model=megablocks results_dir=/tmp/swmb cold_start.cache_dir=/tmp/csmb
fi
cp "$OUT"/hf/gpu_check.json "$OUT/gpu_check_hf.json" 2>/dev/null; cp "$OUT"/mb/gpu_check.json "$OUT/gpu_check_mb.json" 2>/dev/null
rm -rf "$OUT/hf" "$OUT/mb"
cp -r /tmp/sw/report "$OUT/report" 2>/dev/null; tar -czf "$OUT/logs.tar.gz" -C "$OUT" --exclude=logs.tar.gz . 2>/dev/null; rm -rf "$OUT/report"
find "$OUT" -maxdepth 1 -name '*.log' ! -name 'summary.txt' -delete
log "done"
