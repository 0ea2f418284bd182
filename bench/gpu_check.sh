#!/usr/bin/env bash
# The GPU check of issue 21 (bench/gpu_check.py): a random-weight LLaVA-1.5-7B-shaped checkpoint
# built on the device, CPU/GPU greedy parity, decode tok/s at batch 32/64 against transformers and
# the HBM roofline, TTFT, the mixed workload per policy, torch vs TensorRT encoder. One command,
# at most 8 minutes, one JSON object on stdout (progress and build logs go to stderr).
# A GPU host with only torch and transformers: carry the wheels of `make gpu-wheels` in .whl/;
# they are installed into .visor/gpu-site, offline (docs/benchmarks.md has the exact call).
# Usage: bench/gpu_check.sh [--device cpu --small] [--workdir DIR] [--budget-s S]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c 'import grpc, grpc_tools, structlog, lmdb, xxhash, llguidance' 2>/dev/null \
  && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target .visor/gpu-site .whl/*.whl >&2
  export PYTHONPATH=$PWD/.visor/gpu-site${PYTHONPATH:+:$PYTHONPATH}
fi
if [[ " $* " != *" --device cpu "* ]]; then
  "$PY" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null \
    || { echo '{"bench": "gpu_check", "error": "no CUDA device (--device cpu --small runs on the CPU)"}'; exit 1; }
fi
result=$(mktemp)
# The script keeps its own 480 s budget; the kill is for a section stuck where no signal reaches.
rc=0
timeout -k 5 500 "$PY" -m bench.gpu_check --result-file "$result" "$@" || rc=$?
if [ "$rc" -ne 0 ]; then
  # Killed or crashed: what the finished sections wrote, marked as cut short.
  "$PY" -c 'import json, sys
out = json.loads(open(sys.argv[1]).read() or "{}")
out["error"] = f"gpu_check exited with status {sys.argv[2]}"
print(json.dumps(out))' "$result" "$rc"
fi
rm -f "$result"
exit "$rc"
