#!/usr/bin/env bash
# Open MPI from Debian (openmpi-bin: mpirun / mpiexec), for `placement.mode=launcher` under
# MPI and its tests (tests/test_launcher_runs.py, docs/clusters.md). Idempotent: where
# `mpirun` answers already, it returns at once. tidal needs no MPI library in Python: the
# ranks read Open MPI's environment (OMPI_COMM_WORLD_*) and meet through torch.distributed.
# Exit 0: mpirun is there; 1: it could not be installed (said why); 3: it is missing and this
# machine cannot install it (not root, or no apt-get).
set -euo pipefail
if command -v mpirun >/dev/null 2>&1 && timeout 30 mpirun --version >/dev/null 2>&1; then
  echo "mpi: $(mpirun --version 2>/dev/null | head -1)"; exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "mpi: openmpi-bin is missing and this script installs it only as root with apt-get" >&2
  exit 3
fi
echo "mpi: installing openmpi-bin (Debian)"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends openmpi-bin >/dev/null 2>&1 \
  || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends openmpi-bin >/dev/null 2>&1; } \
  || { echo "mpi: apt-get could not install openmpi-bin" >&2; exit 1; }
timeout 30 mpirun --version >/dev/null 2>&1 || { echo "mpi: openmpi-bin is installed but mpirun does not answer" >&2; exit 1; }
echo "mpi: $(mpirun --version 2>/dev/null | head -1)"
