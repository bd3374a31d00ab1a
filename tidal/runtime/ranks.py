"""Who started this process: the rank, the world size and the rendezvous address of
`placement.mode=launcher`, read from the launcher's environment (a pure function of it).

The choice: the launcher's own variables, not a flag per launcher. The first launcher whose
rank variable is present decides, and then every variable of that launcher must be there and
agree (a partial or contradictory set is an error naming the variable, never a fallback to
another launcher or to one process):

    launcher            rank                  world size            local rank
    torchrun            RANK                  WORLD_SIZE            LOCAL_RANK
    Open MPI (mpirun)   OMPI_COMM_WORLD_RANK  OMPI_COMM_WORLD_SIZE  OMPI_COMM_WORLD_LOCAL_RANK
    MPICH (Hydra)       PMI_RANK              PMI_SIZE              MPI_LOCALRANKID
    Slurm (srun)        SLURM_PROCID          SLURM_NTASKS          SLURM_LOCALID

The rendezvous (where rank 0 hosts torch.distributed's store): MASTER_ADDR / MASTER_PORT when
set (torchrun always sets them; `mpirun -x MASTER_ADDR=...` passes them on); otherwise, when
every rank is on one node, 127.0.0.1 (loopback, nothing leaves the machine), and on several
Slurm nodes the first host of the step's node list. The port, where none is given, is derived
from the job's id (Slurm's job and step id, Open MPI's job id; under MPICH's Hydra, which
gives none, on one node the pid of its proxy, the parent of every rank) so two jobs on one node
do not meet, as `tidal launch slurm` derives Ray's port.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tidal.config import ConfigError

LOOPBACK = "127.0.0.1"
PORT_BASE, PORT_SPAN = 30000, 10000  # derived ports; above `tidal launch slurm`'s Ray ports (20000-29999)

# launcher → (rank, world size, local rank, local world size or None, job id variables)
LAUNCHERS: dict[str, tuple[str, str, str, str | None, tuple[str, ...]]] = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", ("TORCHELASTIC_RUN_ID",)),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE", ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", ("PMI_KVSNAME",)),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None, ("SLURM_JOB_ID", "SLURM_STEP_ID")),
}


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job, as its launcher says."""

    launcher: str  # a key of LAUNCHERS
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool = False  # torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT already

    @property
    def is_controller(self) -> bool:
        return self.rank == 0


def _int(environ: Mapping[str, str], name: str, launcher: str) -> int:
    raw = environ.get(name)
    if raw is None:
        raise ConfigError(f"placement.mode=launcher: {launcher} set some of its variables but not {name}")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"placement.mode=launcher: {name}={raw!r} is not an integer") from None


def which_launcher(environ: Mapping[str, str]) -> str:
    """The launcher whose rank variable is set (in LAUNCHERS order: torchrun's RANK first, so a
    torchrun inside a Slurm allocation is torchrun)."""
    for name, (rank_var, *_rest) in LAUNCHERS.items():
        if rank_var in environ:
            return name
    raise ConfigError("placement.mode=launcher: no launcher's rank variable is set (RANK for torchrun, "
                      "OMPI_COMM_WORLD_RANK for Open MPI's mpirun, PMI_RANK for MPICH, SLURM_PROCID for srun): "
                      "start `tidal train` with one of them, or use placement.mode=local or ray")


def derived_port(launcher: str, environ: Mapping[str, str], fallback: str = "") -> int:
    """A port from the job's id, the same on every rank of the job (`fallback`: an id of the job
    found elsewhere, used where the launcher's variables give none)."""
    ids = LAUNCHERS[launcher][4]
    job = "/".join(environ.get(v, "") for v in ids)
    if not job.strip("/"):
        job = fallback
    if not job:
        raise ConfigError(f"placement.mode=launcher: {launcher} gave no job id ({', '.join(ids)}) to derive the "
                          f"rendezvous port from: set MASTER_PORT")
    return PORT_BASE + zlib.crc32(job.encode()) % PORT_SPAN


def first_slurm_host(nodelist: str, timeout_s: float = 30.0) -> str:
    """The first host of a Slurm node list (`scontrol show hostnames`, Slurm's own expansion)."""
    scontrol = shutil.which("scontrol")
    if not scontrol:
        raise ConfigError("placement.mode=launcher under srun on several nodes: `scontrol` is not on PATH to expand "
                          f"SLURM_STEP_NODELIST={nodelist!r}; set MASTER_ADDR")
    out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                         timeout=timeout_s, check=False)
    hosts = out.stdout.split()
    if out.returncode != 0 or not hosts:
        raise ConfigError(f"placement.mode=launcher: `scontrol show hostnames {nodelist}` failed: {out.stderr.strip()}")
    return hosts[0]


def detect(environ: Mapping[str, str], first_host: Callable[[str], str] = first_slurm_host,
           parent_pid: Callable[[], int] = os.getppid) -> LaunchEnv:
    """This process's LaunchEnv from `environ` (os.environ). `first_host` expands a Slurm node
    list, `parent_pid` gives this process's parent (parameters so the rules are testable without
    Slurm or MPICH)."""
    launcher = which_launcher(environ)
    rank_var, size_var, local_var, local_size_var, _ = LAUNCHERS[launcher]
    rank, world = _int(environ, rank_var, launcher), _int(environ, size_var, launcher)
    local_rank = _int(environ, local_var, launcher) if local_var in environ or launcher != "mpich" else 0
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"placement.mode=launcher: {rank_var}={rank} is not a rank of {size_var}={world}")
    if launcher == "torchrun" and not {"MASTER_ADDR", "MASTER_PORT"} <= set(environ):
        raise ConfigError("placement.mode=launcher: torchrun set RANK but not MASTER_ADDR / MASTER_PORT")
    addr = environ.get("MASTER_ADDR")
    one_node = (_int(environ, local_size_var, launcher) == world) if local_size_var and local_size_var in environ \
        else launcher == "slurm" and environ.get("SLURM_STEP_NUM_NODES", environ.get("SLURM_NNODES")) == "1"
    if addr is None:
        if one_node:
            addr = LOOPBACK
        elif launcher == "slurm" and environ.get("SLURM_STEP_NODELIST"):
            addr = first_host(environ["SLURM_STEP_NODELIST"])
        else:
            raise ConfigError(f"placement.mode=launcher: the {world} ranks of {launcher} span several nodes and "
                              f"MASTER_ADDR is not set: give rank 0's host (e.g. mpirun -x MASTER_ADDR=HOST)")
    # MPICH's Hydra (4.0) puts no job id in the ranks' environment; on one node its proxy process
    # is the parent of every rank of the job (each rank a session of its own), so its pid is one.
    fallback = f"hydra-proxy-{parent_pid()}" if launcher == "mpich" and one_node else ""
    port = _int(environ, "MASTER_PORT", launcher) if "MASTER_PORT" in environ else \
        derived_port(launcher, environ, fallback)
    if not 0 < port < 65536:
        raise ConfigError(f"placement.mode=launcher: MASTER_PORT={port} is not a port")
    return LaunchEnv(launcher, rank, world, local_rank, addr, port,
                     agent_store=launcher == "torchrun" and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
