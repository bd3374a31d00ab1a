#!/usr/bin/env bash
# Open MPI and MPICH from Debian (openmpi-bin: mpirun / mpiexec; mpich: mpiexec.mpich, Hydra),
# for `placement.mode=launcher` under MPI and its tests (tests/test_launcher_runs.py,
# docs/clusters.md). Idempotent: where both answer already, it returns at once. Open MPI stays
# the `mpirun` of the machine (Debian's alternatives rank it first); MPICH's is mpiexec.mpich.
# tidal needs no MPI library in Python: the ranks read the launcher's environment
# (OMPI_COMM_WORLD_*, PMI_*) and meet through torch.distributed.
# Exit 0: both are there; 1: they could not be installed (said why); 3: one is missing and this
# machine cannot install it (not root, or no apt-get).
set -euo pipefail
answers() { command -v mpirun >/dev/null 2>&1 && timeout 30 mpirun --version >/dev/null 2>&1 \
  && command -v mpiexec.mpich >/dev/null 2>&1 && timeout 30 mpiexec.mpich --version >/dev/null 2>&1; }
say() { echo "mpi: $(mpirun --version 2>/dev/null | head -1); MPICH $(mpiexec.mpich --version 2>/dev/null | awk '/Version:/ {print $2; exit}')"; }
if answers; then say; exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "mpi: openmpi-bin or mpich is missing and this script installs them only as root with apt-get" >&2
  exit 3
fi
echo "mpi: installing openmpi-bin and mpich (Debian)"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends openmpi-bin mpich >/dev/null 2>&1 \
  || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends openmpi-bin mpich >/dev/null 2>&1; } \
  || { echo "mpi: apt-get could not install openmpi-bin and mpich" >&2; exit 1; }
answers || { echo "mpi: openmpi-bin and mpich are installed but mpirun or mpiexec.mpich does not answer" >&2; exit 1; }
say
