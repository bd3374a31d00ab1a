"""placement.mode=launcher: the trainer ranks are the processes torchrun, mpirun or srun
started, one `tidal train` each; no Ray.

Every process reads its rank and the world size from its launcher (tidal/runtime/ranks.py) and
meets the others on a torch.distributed TCPStore at the rendezvous address (rank 0 hosts it,
or torchrun's agent already does). Rank 0 runs the controller: the rollout, the rewards and
the environments, checkpoints and metrics. Every other rank runs `serve_rank`: one
TrainerWorker, driven by rank 0. The engines live either in rank 0's process (as
placement.mode=local: every rank gathers the weights, rank 0 loads its copy), or, with
placement.colocate, one inside each rank (as Ray's colocated ranks: rank 0's router sends each
rank's engine its share of the requests over the rank's control connection, and each rank
loads the weights it gathered into its own engine, so no weights cross the network beyond the
gather), or, with placement.engine_ranks, one in each of the last ranks, which train nothing
(as Ray's engine actors: an EngineWorker, weights by broadcast from trainer rank 0 or by disk).
The last two scale to several nodes: the generation grows with the ranks instead of waiting
on one process.

The choice for driving the ranks: a control connection per rank (the standard library's
multiprocessing.connection, HMAC-authenticated with a key rank 0 publishes through the store;
it listens on the rendezvous address, loopback on one node), over which rank 0 sends numbered
calls (tidal/runtime/rank_link.py). Through it rank 0's TrainerGroup and router see the ranks
as they see Ray actors (the same Handle, `submit`, `acall` and `gather`), so the controller,
the sharding of batches, the weight sync and the checkpoints are the code of
placement.mode=ray. Why a connection and not the store or a torch collective: a process that
ends closes its socket, so rank 0 learns at once which rank died (the error names it and the
step) instead of waiting for a collective's timeout; and batches larger than the store's 8 MiB
limit pass. The trainer's own collectives (FSDP2) run in a process group on the same store,
with placement.collective_timeout_s; each call has placement.call_timeout_s (a generation,
engine.request_timeout_s); nothing waits forever except a rank waiting for rank 0's next call,
which ends when rank 0's connection closes.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import secrets
import socket
import threading
from multiprocessing.connection import Client, Listener

from torch.distributed import PrefixStore, TCPStore

from tidal.config import ConfigError, TidalConfig
from tidal.models import load_tokenizer, resolve_model_dir
from tidal.runtime import topology
from tidal.runtime.handles import Handle, RoleError, gather
from tidal.runtime.rank_link import LocalRank, RemoteRank, serve_calls
from tidal.runtime.ranks import LaunchEnv
from tidal.runtime.trainer_group import TrainerGroup, TrainerWorker
from tidal.runtime.workers import EngineWorker
from tidal.trainer.distributed import destroy
from tidal.trainer.parallel.mesh import ParallelDims
from tidal.trainer.threads import on_own_thread
from tidal.weightsync import InProcessSync

__all__ = ["LocalRank", "RemoteRank", "config_for", "join_ranks", "serve_rank"]

log = logging.getLogger("tidal")

ADDRESS_KEY, AUTHKEY_KEY, ENGINE_KEY = "control/address", "control/authkey", "control/engine"


def config_for(cfg: TidalConfig, env: LaunchEnv) -> TidalConfig:
    """cfg fitted to the launcher's world: placement.trainer_ranks = its size less
    placement.engine_ranks (validated again: the mesh of train.parallel must fit it), and
    engine.replicas = one per rank with placement.colocate, or placement.engine_ranks. A
    trainer_ranks or engine.replicas given that differs is an error."""
    pl, eng = cfg.placement, cfg.engine
    n_train = env.world_size - pl.engine_ranks
    if n_train < 1:
        raise ConfigError(f"placement.engine_ranks={pl.engine_ranks}, but {env.launcher} started {env.world_size} "
                          f"process(es): at least one must be a trainer rank")
    if "trainer_ranks" in pl.model_fields_set and pl.trainer_ranks != n_train:
        engines = f" less placement.engine_ranks={pl.engine_ranks}" if pl.engine_ranks else ""
        raise ConfigError(f"placement.trainer_ranks={pl.trainer_ranks}, but {env.launcher} started {env.world_size} "
                          f"process(es){engines}: give placement.trainer_ranks={n_train} or leave it out (under "
                          f"placement.mode=launcher the launcher decides)")
    replicas = env.world_size if pl.colocate else pl.engine_ranks or None
    if replicas is not None and "replicas" in eng.model_fields_set and eng.replicas != replicas:
        each = (f"{env.world_size} rank(s), each hosting one replica" if pl.colocate
                else f"placement.engine_ranks={pl.engine_ranks} engine rank(s)")
        raise ConfigError(f"engine.replicas={eng.replicas}, but {env.launcher} started {each}: give "
                          f"engine.replicas={replicas} or leave it out")
    data = cfg.model_dump()
    data["placement"]["trainer_ranks"] = n_train
    if replicas is not None:
        data["engine"]["replicas"] = replicas
    try:
        return TidalConfig.model_validate(data)
    except ValueError as e:
        raise ConfigError(f"placement.mode=launcher with {env.world_size} ranks: {e}") from None


def digest(cfg: TidalConfig) -> str:
    """What every rank must agree on: the whole config."""
    return hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16]


def meet(env: LaunchEnv, timeout_s: float):
    """The job's store: hosted by rank 0 (or torchrun's agent) at the rendezvous address."""
    host_it = env.rank == 0 and not env.agent_store
    try:
        store = TCPStore(env.master_addr, env.master_port, None, host_it, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)
    except RuntimeError as e:  # the port is taken (rank 0), or nothing answers there within the timeout
        raise ConfigError(f"placement.mode=launcher: rank {env.rank} could not {'host' if host_it else 'reach'} the "
                          f"rendezvous store at {env.master_addr}:{env.master_port} within {timeout_s:g} s "
                          f"(placement.start_timeout_s; MASTER_ADDR / MASTER_PORT): {str(e).splitlines()[0]}") from None
    # A torchrun restart meets again in the same agent store: its keys are its own.
    return PrefixStore(f"tidal/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


# -- rank 0's side --------------------------------------------------------------------------------
class Launched:
    """Rank 0's view of the job: its store, its listener, a handle per rank."""

    def __init__(self, env: LaunchEnv, store, ranks: list[Handle], listener):
        self.env, self.store, self.ranks, self.listener = env, store, ranks, listener

    def close(self) -> None:
        for h in self.ranks[1:]:
            h.stop()
        self.listener.close()
        self.ranks[0].target.close_engine()  # rank 0's colocated engine, if any
        alive = all(getattr(h, "dead", None) in (None, "stopped") for h in self.ranks[1:])
        if alive:  # with a rank gone, rank 0 may still be inside a collective: the process ends instead
            destroy()


def connect_ranks(env: LaunchEnv, store, worker, cfg: TidalConfig, timeout_s: float) -> Launched:
    """Publish the control address, accept one connection per other rank (within `timeout_s`,
    else the missing ranks are named), check that every rank runs the same config."""
    host = env.master_addr
    authkey = secrets.token_bytes(32)
    listener = Listener((host, 0), authkey=authkey)
    store.set(AUTHKEY_KEY, authkey.hex())
    store.set(ADDRESS_KEY, f"{listener.address[0]}:{listener.address[1]}")
    found: dict[int, RemoteRank] = {}
    hosts = {0: socket.gethostname()}
    problems: list[str] = []
    mine = digest(cfg)

    def accept_all() -> None:
        while len(found) + len(problems) < env.world_size - 1:
            try:
                conn = listener.accept()
            except OSError:  # closed: the deadline passed
                return
            except Exception as e:  # noqa: BLE001 - a wrong key, a stray connection: named, not fatal alone
                log.warning("launcher: a connection to rank 0's control address was refused: %s", e)
                continue
            _, rank, pid, theirs, host = conn.recv()
            hosts[rank] = host
            if theirs != mine:
                problems.append(f"rank {rank} runs another config (digest {theirs}, rank 0's {mine}): every rank "
                                "must be started with the same config and overrides")
            found[rank] = RemoteRank(rank, conn, pid, role=role_of(cfg, rank))

    thread = threading.Thread(target=accept_all, name="tidal-accept", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive() or problems:
        listener.close()
        for h in found.values():
            h.stop()
        if problems:
            raise ConfigError("placement.mode=launcher: " + "; ".join(problems))
        missing = [r for r in range(1, env.world_size) if r not in found]
        raise RoleError(f"trainer rank {missing[0]}", "connect", None, "timeout",
                        f"{timeout_s:g} s (placement.start_timeout_s): ranks {missing} of {env.world_size} did not "
                        f"reach rank 0 at {listener.address[0]}:{listener.address[1]}")
    ranks: list[Handle] = [LocalRank(worker), *(found[r] for r in range(1, env.world_size))]
    warn_split_groups(cfg, env, hosts)
    return Launched(env, store, ranks, listener)


def role_of(cfg: TidalConfig, rank: int) -> str:
    """What rank `rank` is: a trainer rank, or (placement.engine_ranks, the last ranks) an engine replica."""
    n_train = cfg.placement.trainer_ranks
    return f"trainer rank {rank}" if rank < n_train else f"engine replica{rank - n_train} (rank {rank})"


def warn_split_groups(cfg: TidalConfig, env: LaunchEnv, hosts: dict[int, str]) -> list[str]:
    """The launcher placed the ranks: say which tp × cp × ep group spans nodes (topology.py)."""
    n_train = cfg.placement.trainer_ranks  # the engine ranks, if any, come after them
    dims = ParallelDims.from_config(cfg.train.parallel, n_train)
    size = topology.group_size(dims.tp, dims.cp, dims.ep)
    split = topology.split_groups(topology.node_groups(n_train, size), hosts)
    for message in split:
        log.warning("launcher: %s; start each node's ranks together, a multiple of %d per node (torchrun "
                    "--nproc-per-node, srun --ntasks-per-node, mpirun --map-by ppr:N:node)", message, size)
    return split


# -- the other ranks' side -------------------------------------------------------------------------
def serve_rank(cfg: TidalConfig, env: LaunchEnv) -> int:
    """Rank r > 0: meet, connect to rank 0, set up its TrainerWorker (and, placement.colocate,
    its engine) when told, or as one of the last placement.engine_ranks ranks load its
    EngineWorker, then answer rank 0's calls (tidal/runtime/rank_link.py) until told to exit
    (0) or rank 0's connection closes (1)."""
    pl = cfg.placement
    store = meet(env, pl.start_timeout_s)
    try:  # published by rank 0 once its run has started (its inputs checked, its run directory open)
        host, port = store.get(ADDRESS_KEY).decode().rsplit(":", 1)
        authkey = bytes.fromhex(store.get(AUTHKEY_KEY).decode())
        engine = json.loads(store.get(ENGINE_KEY).decode())  # set before the address: there already
    except RuntimeError as e:  # the store's timeout, or rank 0 (its host) gone
        raise ConfigError(f"placement.mode=launcher: rank {env.rank}: rank 0 did not publish its control address "
                          f"within {pl.start_timeout_s:g} s (placement.start_timeout_s); it may have stopped at its "
                          f"start (see its output): {str(e).splitlines()[0]}") from None
    conn = Client((host, int(port)), authkey=authkey)
    conn.send(("hello", env.rank, os.getpid(), digest(cfg), socket.gethostname()))
    model_dir = resolve_model_dir(cfg.model.path)
    pad_token_id = load_tokenizer(model_dir).pad_token_id
    role = role_of(cfg, env.rank)
    if env.rank >= pl.trainer_ranks:  # an engine rank: its engine loads now (rank 0 waits for it)
        worker = EngineWorker(cfg, engine["engine_kind"], str(model_dir), pad_token_id, log_dir=engine["log_dir"])
    else:
        worker = TrainerWorker(cfg, str(model_dir), pad_token_id, rank=env.rank, world_size=pl.trainer_ranks,
                               **(engine if pl.colocate else {}))
        worker.store = PrefixStore("trainer", store)
    hosting = f", hosting engine replica{env.rank} ({engine['engine_kind']})" if pl.colocate else ""
    log.info("launcher: rank %d of %d (%s) serving rank 0 at %s:%s as %s%s", env.rank, env.world_size, env.launcher,
             host, port, role, hosting)
    try:
        code = serve_calls(conn, worker, env.rank)
    finally:
        worker.close_engine()
    if code == 0:
        destroy()
    return code


# -- rank 0's trainer and weight sync (placement.py builds the roles from them) ------------------
def join_ranks(cfg: TidalConfig, model_dir, pad_token_id: int, env: LaunchEnv, engine_kind: str, run_dir):
    """Rank 0's TrainerGroup over the trainer ranks of the job, set up (the process group
    formed, and with placement.colocate each rank's engine loaded), the engine ranks' handles
    (placement.engine_ranks; their engines loaded), and the job (closed with the roles)."""
    pl = cfg.placement
    n_train = pl.trainer_ranks
    store = meet(env, pl.start_timeout_s)
    engine = {"engine_kind": engine_kind, "log_dir": str(run_dir / "engine")}
    store.set(ENGINE_KEY, json.dumps(engine))  # before the control address, which the ranks wait for
    worker = TrainerWorker(cfg, str(model_dir), pad_token_id, rank=0, world_size=n_train,
                           **(engine if pl.colocate else {}))
    worker.store = PrefixStore("trainer", store)
    worker.host = env.master_addr  # weight-sync groups meet at the rendezvous host, reachable from every node
    job = connect_ranks(env, store, worker, cfg, pl.start_timeout_s)
    try:
        gather([h.submit("setup", env.master_addr) for h in job.ranks[:n_train]]
               + [h.submit("pid") for h in job.ranks[n_train:]], timeout_s=pl.start_timeout_s)
    except BaseException:
        job.close()
        raise
    dims = ParallelDims.from_config(cfg.train.parallel, n_train)
    return TrainerGroup(job.ranks[:n_train], timeout_s=pl.call_timeout_s,
                        dp_index=[dims.dp_index(r) for r in range(n_train)]), job.ranks[n_train:], job


def push_in_process(trainer, engine, timeout_s: float):
    """The weight sync of a launcher's job: every rank gathers the full weights (a collective
    under FSDP2), rank 0 loads its copy into the engines of its process."""
    sync = InProcessSync([engine], verify=True)

    def push(step: int | None) -> dict[str, float]:
        named = gather([h.submit("full_weights") for h in trainer.ranks], step=step, timeout_s=timeout_s)[0]
        # copied into the engines on a thread that ends with it (tidal/trainer/threads.py)
        out = on_own_thread(lambda: sync.push(trainer.version, named))
        return {"time/weight_sync_s": out["seconds"], "weight_sync/bytes": out["bytes"]}

    return push
