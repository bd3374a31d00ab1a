"""Ray on Slurm: an `sbatch` script that starts a Ray cluster over the job's nodes, runs
`tidal train` against it, and takes the cluster down with the job.

The choice: Slurm allocates and Ray places. The job asks Slurm for whole nodes, one task
each; a Ray head runs on the first node and a worker on each other node as `srun` steps
(`ray start --block`, so each step lives exactly as long as its Ray node); the driver is the
batch step itself, joining through `placement.address`. The roles' bundles are then placed
by Ray as in any `placement.mode=ray` run. Node roles come from the config: where
`placement.trainer.resources` / `placement.engine.resources` name custom resources, the first
trainer-nodes offer the trainer's and the rest the engine's (docs/clusters.md).

Per job, derived from the job id: the Ray port (20000 + id mod 10000, the next free one on
the head), the temp dir (/tmp/tidal-ray-<id>), and so the processes the teardown may stop.
One node: everything on 127.0.0.1 with Ray's single-machine switch (services on loopback,
as tidal's own local Ray). Several nodes: the head's address, and Ray's token auth with a
token made for the job. Teardown (trap EXIT, also on scancel's SIGTERM and a time limit):
the driver is stopped, each Ray step is ended (srun forwards the signal; `ray start --block`
stops its node's processes), then anything left whose command line names the job's temp dir.
`ray stop` is not used: it stops every Ray process of the user on the node, other jobs' too.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tidal.config import ConfigError, TidalConfig

HEALTH_TIMEOUT_S = 300  # Ray nodes joining: seconds on a busy cluster, never forever
# Graceful stops before SIGKILL, together within Slurm's KillWait (30 s by default) under scancel:
STOP_WAIT_S = 20  # the driver's (it closes its actors; its last complete checkpoint stays)
RAY_STOP_WAIT_S = 5  # the Ray processes' once the driver is gone (measured: gcs_server outlives SIGTERM)


@dataclass
class SlurmJob:
    """What `tidal launch slurm` asks of Slurm, from its flags and the config."""

    configs: list[Path]  # merged in order by `tidal train`
    overrides: list[str]
    run_dir: Path
    nodes: int
    trainer_nodes: int
    gpus_per_node: int = 0
    partition: str | None = None
    time: str | None = None
    job_name: str = "tidal"
    node_resources: list[dict[str, float]] = field(default_factory=list)
    health_timeout_s: int = HEALTH_TIMEOUT_S


def role_gpus(cfg: TidalConfig) -> tuple[float, float]:
    """GPUs the trainer ranks and the engine replicas reserve in all (colocated engines
    count with the trainer)."""
    pl = cfg.placement
    trainer = pl.trainer_ranks * (pl.trainer.num_gpus + (pl.engine.num_gpus if pl.colocate else 0.0))
    engine = 0.0 if pl.colocate else cfg.engine.replicas * pl.engine.num_gpus
    return trainer, engine


def plan_nodes(cfg: TidalConfig, gpus_per_node: int) -> tuple[int, int]:
    """(trainer nodes, engine nodes) the config's roles need. Without GPUs per node (a CPU
    job) everything fits on one node. Roles pinned to node types by distinct custom resources
    get nodes of their own; otherwise they share nodes and only the GPU total counts."""
    trainer_gpus, engine_gpus = role_gpus(cfg)
    if gpus_per_node <= 0:
        if trainer_gpus + engine_gpus > 0:
            raise ConfigError(f"the config's roles reserve {trainer_gpus + engine_gpus:g} GPUs "
                              f"(placement.trainer/engine.num_gpus): give --gpus-per-node")
        return 1, 0
    if _pinned(cfg):
        return max(1, math.ceil(trainer_gpus / gpus_per_node)), math.ceil(engine_gpus / gpus_per_node)
    return max(1, math.ceil((trainer_gpus + engine_gpus) / gpus_per_node)), 0


def check_nodes(cfg: TidalConfig, nodes: int, gpus_per_node: int) -> None:
    """Refuse a job too small for the config's roles (it would wait in Ray's placement until
    placement.start_timeout_s): --nodes × --gpus-per-node must hold the GPUs the roles reserve."""
    if nodes < 1:
        raise ConfigError(f"--nodes {nodes}: a job needs at least one node")
    need = sum(role_gpus(cfg))
    if need > nodes * gpus_per_node and gpus_per_node > 0:
        raise ConfigError(f"--nodes {nodes} × --gpus-per-node {gpus_per_node} = {nodes * gpus_per_node} GPUs, and the "
                          f"config's roles reserve {need:g} (placement.trainer_ranks × placement.trainer.num_gpus + "
                          f"engine.replicas × placement.engine.num_gpus): give more nodes")


def _pinned(cfg: TidalConfig) -> bool:
    pl = cfg.placement
    return not pl.colocate and bool(pl.trainer.resources) and bool(pl.engine.resources) \
        and not set(pl.trainer.resources) & set(pl.engine.resources)


def node_resources(cfg: TidalConfig, nodes: int, trainer_nodes: int) -> list[dict[str, float]]:
    """The custom Ray resources each node offers (`ray start --resources`): the first
    `trainer_nodes` the trainer's, the rest the engine's; where there are not enough nodes to
    split, every node offers both (the roles share nodes). Each offers its role's total, so
    Ray's CPU/GPU accounting is what bounds how many actors land on a node."""
    pl = cfg.placement
    n_engine = 0 if pl.colocate else cfg.engine.replicas
    trainer = {k: v * pl.trainer_ranks for k, v in pl.trainer.resources.items()}
    engine = {k: v * n_engine for k, v in pl.engine.resources.items()} if n_engine else {}
    if nodes > trainer_nodes and trainer and engine:
        return [trainer if i < trainer_nodes else engine for i in range(nodes)]
    both = dict(trainer)
    for k, v in engine.items():
        both[k] = both.get(k, 0.0) + v
    return [both for _ in range(nodes)]


def _executable(name: str) -> str:
    """The tool beside this interpreter (the venv's), else on PATH: the job runs the same tidal."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise ConfigError(f"`{name}` is not installed beside {sys.executable} nor on PATH: `tidal launch slurm` "
                          f"starts Ray with it (pip install 'ray[default]')")
    return found


def render(job: SlurmJob) -> str:
    """The sbatch script (a pure function of the job, for --dry-run and the tests)."""
    q = shlex.quote
    head = [f"#SBATCH --job-name={job.job_name}", f"#SBATCH --nodes={job.nodes}", "#SBATCH --ntasks-per-node=1",
            "#SBATCH --exclusive", f"#SBATCH --output={job.run_dir}/slurm-%j.out", "#SBATCH --export=ALL"]
    head += [f"#SBATCH --gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []
    head += [f"#SBATCH --partition={job.partition}"] if job.partition else []
    # Before the time limit, SIGTERM to the batch shell: the trap stops the driver while there is time.
    head += [f"#SBATCH --time={job.time}", "#SBATCH --signal=B:TERM@120"] if job.time else []
    train = [sys.executable, "-m", "tidal.cli", "train", *[str(c) for c in job.configs], *job.overrides,
             f"run.dir={job.run_dir}", "placement.mode=ray"]
    resources = " ".join(q(json.dumps(r, sort_keys=True)) for r in job.node_resources)
    return TEMPLATE.format(
        sbatch="\n".join(head), py=q(sys.executable), ray=q(_executable("ray")), cwd=q(os.getcwd()),
        run_dir=q(str(job.run_dir)), resources=resources, gpus=job.gpus_per_node, health_s=job.health_timeout_s,
        stop_s=STOP_WAIT_S, ray_stop_s=RAY_STOP_WAIT_S, train=" ".join(q(a) for a in train))


def prepare(job: SlurmJob) -> Path:
    """Write the script into the run directory (which must not hold a run yet)."""
    if (job.run_dir / "metrics.jsonl").exists():
        raise FileExistsError(f"run directory {job.run_dir} already holds a run: choose another run.dir")
    job.run_dir.mkdir(parents=True, exist_ok=True)
    path = job.run_dir / "launch.sbatch"
    path.write_text(render(job))
    path.chmod(0o755)
    return path


def submit(script: Path, timeout_s: float = 60.0) -> str:
    """sbatch the script; the job id."""
    sbatch = shutil.which("sbatch")
    if not sbatch:
        raise ConfigError("`sbatch` is not on PATH: `tidal launch slurm` submits to Slurm from a node that has its "
                          "client commands (--dry-run prints the script without them)")
    out = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, timeout=timeout_s, check=False)
    if out.returncode != 0:
        raise ConfigError(f"sbatch refused {script}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]


def default_run_dir(cfg: TidalConfig) -> Path:
    """The run directory, fixed at launch: the script, the job's output and the run share it."""
    if cfg.run.dir:
        return Path(cfg.run.dir).resolve()
    return (Path("runs") / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


TEMPLATE = r"""#!/usr/bin/env bash
# Written by `tidal launch slurm` (tidal/launch/slurm.py): a Ray cluster over this job's nodes,
# `tidal train` on it, the cluster taken down with the job however it ends.
{sbatch}
set -uo pipefail
cd {cwd}
PY={py}
RAY={ray}
RUN_DIR={run_dir}
RESOURCES=({resources})
GPUS={gpus}
HEALTH_TIMEOUT_S={health_s}
STOP_WAIT_S={stop_s}
RAY_STOP_WAIT_S={ray_stop_s}
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${{NODES[0]}}
RAY_TMP=/tmp/tidal-ray-$SLURM_JOB_ID
mkdir -p "$RAY_TMP"
export RAY_USAGE_STATS_ENABLED=0
if [ ${{#NODES[@]}} -eq 1 ]; then
  # One node: every Ray service on loopback (Ray's single-machine switch, as tidal's own local Ray).
  HEAD_IP=127.0.0.1
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
  export RAY_AUTH_MODE=${{RAY_AUTH_MODE:-disabled}}
else
  # Several nodes: the head's own address, and a token made for this job (srun passes it on).
  HEAD_IP=${{TIDAL_RAY_HEAD_IP:-$(hostname --ip-address | awk '{{print $1}}')}}
  export RAY_AUTH_MODE=token
  export RAY_AUTH_TOKEN=$("$PY" -c 'import secrets; print(secrets.token_hex(32))')
fi
free_port() {{  # the first free port from $1 on this node
  "$PY" - "$1" <<'EOF'
import socket, sys
port = int(sys.argv[1])
while True:
    with socket.socket() as s:
        try:
            s.bind(("", port))
            print(port)
            break
        except OSError:
            port += 1
EOF
}}
PORT=$(free_port $((20000 + SLURM_JOB_ID % 10000)))
RAY_ADDRESS=$HEAD_IP:$PORT
STEPS=()
DRIVER=
cleanup() {{
  rc=$?
  trap - EXIT TERM INT
  echo "tidal: job $SLURM_JOB_ID: stopping the driver and the Ray cluster (exit $rc)"
  # Waits poll the processes, not srun: a cancelled srun lingers for Slurm's KillWait, which
  # also bounds this trap under scancel (then everything got SIGTERM from Slurm already).
  local start=$SECONDS deadline=$((SECONDS + STOP_WAIT_S))
  if [ -n "$DRIVER" ]; then  # first, while the cluster is up: it closes its actors, keeps its checkpoint
    kill -TERM "$DRIVER" 2>/dev/null
    while kill -0 "$DRIVER" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    kill -KILL "$DRIVER" 2>/dev/null
  fi
  for pid in "${{STEPS[@]}}"; do kill -TERM "$pid" 2>/dev/null; done
  # The Ray processes of this job, named by its temp dir (raylet, gcs_server, workers).
  deadline=$((SECONDS + RAY_STOP_WAIT_S))
  pkill -TERM -f -- "$RAY_TMP/" 2>/dev/null
  while pgrep -f -- "$RAY_TMP/" >/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
  pkill -KILL -f -- "$RAY_TMP(/| |$)" 2>/dev/null
  [ "$rc" -eq 0 ] || cp -r "$RAY_TMP/session_latest/logs" "$RUN_DIR/ray-logs-$SLURM_JOB_ID" 2>/dev/null
  rm -rf "$RAY_TMP"
  echo "tidal: job $SLURM_JOB_ID: Ray cluster stopped in $((SECONDS - start)) s (exit $rc)"
  exit "$rc"
}}
trap cleanup EXIT
trap 'exit 143' TERM INT
ray_node() {{  # ray_node INDEX ARGS...: a Ray node as an srun step on node INDEX, for as long as the step lives
  local i=$1; shift
  local gpus=() res=${{RESOURCES[$i]:-}}
  [ "$GPUS" -gt 0 ] && gpus=(--num-gpus="$GPUS")
  [ -n "$res" ] || res='{{}}'
  srun --overlap --nodes=1 --ntasks=1 -w "${{NODES[$i]}}" "$RAY" start --block --temp-dir="$RAY_TMP" \
    --num-cpus="${{SLURM_CPUS_ON_NODE:-1}}" "${{gpus[@]}}" --resources="$res" \
    --disable-usage-stats "$@" &
  STEPS+=($!)
}}
echo "tidal: job $SLURM_JOB_ID: Ray head on $HEAD ($RAY_ADDRESS), ${{#NODES[@]}} node(s), temp dir $RAY_TMP"
ray_node 0 --head --node-ip-address="$HEAD_IP" --port="$PORT" --include-dashboard=false \
  --ray-client-server-port="$(free_port $((PORT + 1)))" --dashboard-agent-listen-port="$(free_port $((PORT + 2)))"
for ((i = 1; i < ${{#NODES[@]}}; i++)); do ray_node "$i" --address="$RAY_ADDRESS"; done
# Health: every node of the job joined, within the timeout.
deadline=$((SECONDS + HEALTH_TIMEOUT_S))
joined() {{ timeout 60 "$RAY" status --address="$RAY_ADDRESS" 2>/dev/null | grep -cE '^ +1 node_'; }}
until [ "$(joined)" -ge ${{#NODES[@]}} ] 2>/dev/null; do
  for pid in "${{STEPS[@]}}"; do
    kill -0 "$pid" 2>/dev/null || {{ echo "tidal: job $SLURM_JOB_ID: a Ray node's step ended before the cluster was up" >&2; exit 1; }}
  done
  if [ $SECONDS -ge $deadline ]; then
    echo "tidal: job $SLURM_JOB_ID: the Ray cluster did not reach ${{#NODES[@]}} node(s) in ${{HEALTH_TIMEOUT_S}}s" >&2
    exit 1
  fi
  sleep 2
done
echo "tidal: job $SLURM_JOB_ID: Ray cluster of ${{#NODES[@]}} node(s) up; starting the driver"
{train} placement.address="$RAY_ADDRESS" &
DRIVER=$!
wait "$DRIVER"
rc=$?
DRIVER=
exit "$rc"
"""
