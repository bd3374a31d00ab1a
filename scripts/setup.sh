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
# bubblewrap isolates generated code (tidal/sandbox); without it sandboxed runs refuse to
# start. Installed only where missing; where it cannot be installed the sandbox tests fail
# (rather than skip) if this machine could have installed it (see tests/sandbox_support.py).
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing bubblewrap (the sandbox for generated code)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; } \
      || echo "WARNING: apt-get could not install bubblewrap: tidal will refuse to run generated code" >&2
  else
    echo "WARNING: bubblewrap (bwrap) is missing and this script can install it only as root with apt-get;" \
         "install it to run generated code in tidal's sandbox" >&2
  fi
fi
# libseccomp compiles the sandbox's syscall filter (tidal/sandbox/seccomp.py, through pyseccomp);
# without it sandboxed runs refuse to start unless sandbox.seccomp=false.
if ! ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing libseccomp2 (the sandbox's syscall filter)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq libseccomp2 >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libseccomp2 >/dev/null 2>&1; } \
      || echo "WARNING: apt-get could not install libseccomp2: tidal will refuse to run generated code" >&2
  else
    echo "WARNING: libseccomp2 is missing and this script can install it only as root with apt-get;" \
         "install it to run generated code in tidal's sandbox" >&2
  fi
fi
# A C compiler and libc's static library build the sandbox's native init once
# (tidal/sandbox/supervisor.py); without them each run's interpreter forks its own, a few ms slower.
if ! command -v cc >/dev/null 2>&1 || { [ "$(uname -m)" = x86_64 ] && [ ! -e /usr/lib/x86_64-linux-gnu/libc.a ]; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing gcc and libc6-dev (the sandbox's native supervisor)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq gcc libc6-dev >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq gcc libc6-dev >/dev/null 2>&1; } \
      || echo "WARNING: apt-get could not install gcc: sandboxed runs fall back to a slower supervisor" >&2
  else
    echo "WARNING: no C compiler (cc); sandboxed runs use a slower supervisor (install gcc and libc6-dev)" >&2
  fi
fi
# Debian's headless Chromium (and a font) for the browser environment (tidal.envs.browser, docs/browser.md) and the
# dashboard's browser tests, driven by Playwright through its executable path; Playwright's own browser download
# cannot work here.
if [ ! -x /usr/lib/chromium/chromium-headless-shell ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing chromium-headless-shell (the browser environment and tests)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq chromium-headless-shell fonts-liberation >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium-headless-shell fonts-liberation >/dev/null 2>&1; } \
      || echo "WARNING: apt-get could not install chromium-headless-shell: the browser environment and its tests will fail" >&2
  else
    echo "WARNING: chromium-headless-shell is missing and this script can install it only as root with apt-get;" \
         "the browser environment and its tests need it" >&2
  fi
fi
