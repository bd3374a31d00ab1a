#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for `tidal launch slurm` and its tests
# (tests/test_launch_slurm.py, docs/clusters.md). Idempotent: where the cluster already
# answers with its node idle, it returns at once.
#
# Debian's slurm-wlm (slurmctld + slurmd) and munge, installed as root with apt-get; munged,
# slurmctld and slurmd started as daemons (no systemd here). The controller is reached on
# 127.0.0.1 and the node's address is 127.0.0.1; ports are chosen free; no accounting
# (jobs are followed with squeue / scontrol show job). Processes are tracked by
# proctrack/linuxproc (the process tree: it needs no cgroup hierarchy of its own, which a
# container may not delegate). Exit 0: the node is idle; 1: it could not be set up (said why);
# 3: the packages are missing and this machine cannot install them (not root, or no apt-get).
set -euo pipefail
STATE=${TIDAL_SLURM_STATE:-/var/lib/tidal-slurm}
CONF=/etc/slurm/slurm.conf
NODE=$(hostname -s)
TIMEOUT_S=${TIDAL_SLURM_TIMEOUT_S:-60}

node_idle() {
  timeout 10 sinfo -h -N -n "$NODE" -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'
}

# Up already, with the config this version of the script wrote (its hash is kept beside it).
SELF=$(sha256sum "$0" | cut -d' ' -f1)
if [ -f "$STATE/slurm.conf.tidal" ] && cmp -s "$STATE/slurm.conf.tidal" "$CONF" \
   && [ "$(cat "$STATE/script.sha256" 2>/dev/null)" = "$SELF" ] && node_idle; then
  echo "slurm: node $NODE is up (sinfo)"; exit 0
fi

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "slurm: slurm-wlm and munge are missing and this script installs them only as root with apt-get" >&2
    exit 3
  fi
  echo "slurm: installing slurm-wlm and munge (Debian)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq slurm-wlm munge >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq slurm-wlm munge >/dev/null 2>&1; } \
    || { echo "slurm: apt-get could not install slurm-wlm and munge" >&2; exit 1; }
fi
if [ "$(id -u)" != 0 ]; then
  echo "slurm: the daemons are started as root; run this script as root" >&2; exit 1
fi

# munge: the key (the package's postinst makes one; a fresh one where it did not), the daemon.
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
if ! timeout 5 munge -n </dev/null 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1; then
  runuser -u munge -- munged
  for _ in $(seq 50); do timeout 5 munge -n </dev/null 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# Stop the daemons this script started before (by their pid files), then write the config.
for pidfile in "$STATE/slurmd.pid" "$STATE/slurmctld.pid"; do
  if [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    pid=$(cat "$pidfile"); kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
done
mkdir -p "$STATE/ctld" "$STATE/d" "$STATE/log"
read -r CTLD_PORT SLURMD_PORT < <(python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)
MEM_MB=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
cat > "$CONF" <<EOF
# Written by tidal's scripts/setup_slurm.sh: a one-node cluster on loopback.
ClusterName=tidal
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MinJobAge=600
KillWait=30
NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE CPUs=2 RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
cp "$CONF" "$STATE/slurm.conf.tidal"
echo "$SELF" > "$STATE/script.sha256"

slurmctld -i   # -i: ignore state saved by an earlier configuration
slurmd -N "$NODE"
deadline=$((SECONDS + TIMEOUT_S))
until node_idle; do
  if [ $SECONDS -ge $deadline ]; then
    echo "slurm: node $NODE is not idle after ${TIMEOUT_S}s: $(sinfo -N 2>&1 | tail -n +2)" >&2
    tail -n 5 "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log" >&2 || true
    exit 1
  fi
  sleep 0.5
done
echo "slurm: node $NODE is up (slurmctld on 127.0.0.1:$CTLD_PORT, slurmd :$SLURMD_PORT)"
