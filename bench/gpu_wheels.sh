#!/usr/bin/env bash
# The wheels bench/gpu_check.sh needs on a GPU host that has only torch and transformers (and what
# they pull: numpy, tokenizers, safetensors, jinja2, tqdm) and no network: the project's other
# runtime dependencies, pinned to the versions of this machine's environment, into .whl/
# (git-ignored; the device tool's `carry` takes it). grpcio-tools generates shared/pb there.
# Usage: bench/gpu_wheels.sh [PYVER]   e.g. 312 for CPython 3.12 (default: this machine's Python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
PYVER=${1:-$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')}
NAMES="grpcio grpcio-status grpcio-health-checking grpcio-reflection grpcio-tools protobuf
googleapis-common-protos structlog prometheus-client lmdb xxhash cryptography cffi pycparser
llguidance"
pins=$("$PY" -c 'import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' $NAMES)
mkdir -p .whl
platforms=()
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
missing=()
for pin in $pins; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
    --python-version "$PYVER" "${platforms[@]}" -d .whl "$pin" 2>/dev/null || missing+=("$pin")
done
echo "wheels for cp$PYVER in .whl/: $(du -sh .whl | cut -f1)" >&2
if [ ${#missing[@]} -gt 0 ]; then
  echo "not found on this machine's package index (put a wheel of each in .whl/): ${missing[*]}" >&2
  exit 1
fi
