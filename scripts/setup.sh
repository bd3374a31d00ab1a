#!/usr/bin/env bash
# Create .venv and install tidal with its test tools. Idempotent: a second run is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first, pinned: on CPU machines this is the CPU build; a range would pull CUDA wheels.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install --quiet "torch==2.13.0"
stamp=.venv/.tidal-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install --quiet -e ".[dev]"
  touch "$stamp"
fi
