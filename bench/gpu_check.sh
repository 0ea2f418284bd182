#!/usr/bin/env bash
# On a GPU host: the torch encoder on the GPU (bf16, fp16) and, where TensorRT is installed, the
# strongly typed TensorRT engine, each checked against torch float32 on the CPU and timed at
# batch 1/8/32. Prints one JSON object. TensorRT is optional (`pip install '.[gpu]'`).
# Usage: bench/gpu_check.sh [MODEL_DIR]      (about 2-5 minutes with TensorRT; engines are cached)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-models/demo}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"' \
  || { echo '{"error": "no CUDA device"}'; exit 1; }
[ -f "$MODEL/config.json" ] || "$PY" -m visor.cli model init-demo --out "$MODEL"
exec timeout 480 "$PY" -m bench.gpu_check "$MODEL"
