#!/usr/bin/env bash
# On a GPU host with TensorRT: build the encoder engine from the ONNX export, check parity against
# torch FP32, and time torch eager vs TensorRT at batch 1/8/32. Prints one JSON object.
# Usage: bench/gpu_check.sh [MODEL_DIR]      (about 2-5 minutes; the engine is cached afterwards)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-models/demo}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
"$PY" -c 'import tensorrt, torch; assert torch.cuda.is_available(), "no CUDA device"' \
  || { echo '{"error": "TensorRT or CUDA missing: pip install .[gpu] on a GPU host"}'; exit 1; }
[ -f "$MODEL/config.json" ] || "$PY" -m visor.cli model init-demo --out "$MODEL"
exec timeout 480 "$PY" -m bench.gpu_check "$MODEL"
