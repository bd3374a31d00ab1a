"""placement.mode=launcher: the trainer ranks are the processes torchrun, mpirun or srun
started, one `tidal train` each; no Ray.

Every process reads its rank and the world size from its launcher (tidal/runtime/ranks.py) and
meets the others on a torch.distributed TCPStore at the rendezvous address (rank 0 hosts it,
or torchrun's agent already does). Rank 0 runs the controller: the rollout, the engines
(in its own process, as placement.mode=local: weights move in process), the rewards and the
environments, checkpoints and metrics. Every other rank runs `serve_rank`: one TrainerWorker,
driven by rank 0.

The choice for driving the ranks: a control connection per rank (the standard library's
multiprocessing.connection, HMAC-authenticated with a key rank 0 publishes through the store;
it listens on the rendezvous address, loopback on one node), over which rank 0 sends each
call and the rank answers in order. Through it rank 0's TrainerGroup sees the ranks as it sees
Ray actors (the same Handle, `submit` and `gather`), so the controller, the sharding of
batches and the checkpoints are the code of placement.mode=ray. Why a connection and not the
store or a torch collective: a process that ends closes its socket, so rank 0 learns at once
which rank died (the error names it and the step) instead of waiting for a collective's
timeout; and batches larger than the store's 8 MiB limit pass. The trainer's own
collectives (FSDP2) run in a process group on the same store, with
placement.collective_timeout_s; each call has placement.call_timeout_s; nothing waits
forever except a rank waiting for rank 0's next call, which ends when rank 0's connection
closes.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import pickle
import secrets
import socket
import threading
from concurrent.futures import Future
from multiprocessing.connection import Client, Listener

from torch.distributed import PrefixStore, TCPStore

from tidal.config import ConfigError, TidalConfig
from tidal.models import load_tokenizer, resolve_model_dir
from tidal.runtime import topology
from tidal.runtime.handles import Handle, Pending, RoleDied, RoleError, gather
from tidal.runtime.ranks import LaunchEnv
from tidal.runtime.trainer_group import TrainerGroup, TrainerWorker
from tidal.trainer.distributed import destroy
from tidal.trainer.parallel.mesh import ParallelDims
from tidal.trainer.threads import on_own_thread
from tidal.weightsync import InProcessSync

log = logging.getLogger("tidal")

ADDRESS_KEY, AUTHKEY_KEY = "control/address", "control/authkey"


def config_for(cfg: TidalConfig, env: LaunchEnv) -> TidalConfig:
    """cfg with placement.trainer_ranks = the launcher's world size (validated again: the mesh
    of train.parallel must fit it). A trainer_ranks given that differs is an error."""
    pl = cfg.placement
    if "trainer_ranks" in pl.model_fields_set and pl.trainer_ranks != env.world_size:
        raise ConfigError(f"placement.trainer_ranks={pl.trainer_ranks}, but {env.launcher} started {env.world_size} "
                          f"process(es): give placement.trainer_ranks={env.world_size} or leave it out (under "
                          f"placement.mode=launcher the launcher decides)")
    data = cfg.model_dump()
    data["placement"]["trainer_ranks"] = env.world_size
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
class LocalRank(Handle):
    """Rank 0's own TrainerWorker: each call on a thread that ends with it, so that it runs while
    the other ranks are sent theirs (the call is a collective) and keeps no OpenMP team alive
    on a long-lived thread (tidal/trainer/threads.py says why)."""

    def __init__(self, worker):
        super().__init__("trainer rank 0", worker, remote=True)

    def submit(self, call: str, *args, **kwargs) -> Pending:
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(getattr(self.target, call)(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to gather
                future.set_exception(e)

        threading.Thread(target=run, name=f"tidal-rank0-{call}", daemon=True).start()
        return Pending(self, call, future=future)

    def kill(self) -> None:
        pass


class RemoteRank(Handle):
    """Rank r > 0 over its control connection. Calls are sent in order and answered in order;
    one reader thread resolves them. The connection closing (the process ended) fails every
    call pending and every later one with RoleDied, naming the rank."""

    def __init__(self, rank: int, conn, pid: int):
        super().__init__(f"trainer rank {rank}", None, remote=True)
        self.rank, self.conn, self.rank_pid = rank, conn, pid
        self._send_lock = threading.RLock()  # _died runs under it from submit
        self._pending: list[Future] = []
        self.dead: str | None = None
        threading.Thread(target=self._read, name=f"tidal-rank{rank}-reader", daemon=True).start()

    def submit(self, call: str, *args, **kwargs) -> Pending:
        future: Future = Future()
        with self._send_lock:
            if self.dead is None:
                try:
                    self._pending.append(future)
                    self.conn.send(("call", call, args, kwargs))
                except (OSError, EOFError, ValueError) as e:
                    self._died(f"its control connection failed ({type(e).__name__}: {e})")
            if self.dead is not None:
                return Pending(self, call, error=RoleDied(self.dead))
        return Pending(self, call, future=future)

    def _read(self) -> None:
        while True:
            try:
                kind, value = self.conn.recv()
            except (OSError, EOFError, ValueError):
                self._died(f"its process (pid {self.rank_pid}) ended: its control connection closed")
                return
            with self._send_lock:
                future = self._pending.pop(0) if self._pending else None
            if future is None:
                continue
            if kind == "ok":
                future.set_result(value)
            else:  # the rank's own exception (or its text, where it did not pickle)
                future.set_exception(value if isinstance(value, BaseException) else RuntimeError(value))

    def _died(self, why: str) -> None:
        with self._send_lock:
            if self.dead is None:
                self.dead = why
                # at once, though the run stops only at its next call to the trainer (a rollout may be under way)
                log.error("launcher: trainer rank %d (pid %d) ended: %s", self.rank, self.rank_pid, why)
            pending, self._pending = self._pending, []
        for f in pending:
            if not f.done():
                f.set_exception(RoleDied(self.dead))

    def stop(self) -> None:
        """Ask the rank to exit (it leaves its loop), then close the connection."""
        if self.dead is None:
            try:
                with self._send_lock:
                    self.conn.send(("exit", None, (), {}))
            except (OSError, EOFError, ValueError):
                pass
        self.dead = self.dead or "stopped"
        self.conn.close()

    def kill(self) -> None:
        self.stop()


class Launched:
    """Rank 0's view of the job: its store, its listener, a handle per rank."""

    def __init__(self, env: LaunchEnv, store, ranks: list[Handle], listener):
        self.env, self.store, self.ranks, self.listener = env, store, ranks, listener

    def close(self) -> None:
        for h in self.ranks[1:]:
            h.stop()
        self.listener.close()
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
            found[rank] = RemoteRank(rank, conn, pid)

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


def warn_split_groups(cfg: TidalConfig, env: LaunchEnv, hosts: dict[int, str]) -> list[str]:
    """The launcher placed the ranks: say which tp × cp × ep group spans nodes (topology.py)."""
    dims = ParallelDims.from_config(cfg.train.parallel, env.world_size)
    size = topology.group_size(dims.tp, dims.cp, dims.ep)
    split = topology.split_groups(topology.node_groups(env.world_size, size), hosts)
    for message in split:
        log.warning("launcher: %s; start each node's ranks together, a multiple of %d per node (torchrun "
                    "--nproc-per-node, srun --ntasks-per-node, mpirun --map-by ppr:N:node)", message, size)
    return split


# -- the other ranks' side -------------------------------------------------------------------------
def serve_rank(cfg: TidalConfig, env: LaunchEnv) -> int:
    """Rank r > 0: meet, connect to rank 0, set up its TrainerWorker when told, then answer
    rank 0's calls in order until told to exit (0) or rank 0's connection closes (1)."""
    pl = cfg.placement
    store = meet(env, pl.start_timeout_s)
    try:  # published by rank 0 once its run has started (its inputs checked, its run directory open)
        host, port = store.get(ADDRESS_KEY).decode().rsplit(":", 1)
        authkey = bytes.fromhex(store.get(AUTHKEY_KEY).decode())
    except RuntimeError as e:  # the store's timeout, or rank 0 (its host) gone
        raise ConfigError(f"placement.mode=launcher: rank {env.rank}: rank 0 did not publish its control address "
                          f"within {pl.start_timeout_s:g} s (placement.start_timeout_s); it may have stopped at its "
                          f"start (see its output): {str(e).splitlines()[0]}") from None
    conn = Client((host, int(port)), authkey=authkey)
    conn.send(("hello", env.rank, os.getpid(), digest(cfg), socket.gethostname()))
    model_dir = resolve_model_dir(cfg.model.path)
    worker = TrainerWorker(cfg, str(model_dir), load_tokenizer(model_dir).pad_token_id, rank=env.rank,
                           world_size=env.world_size)
    worker.store = PrefixStore("trainer", store)
    log.info("launcher: rank %d of %d (%s) serving rank 0 at %s:%s", env.rank, env.world_size, env.launcher, host, port)
    while True:
        try:
            kind, call, args, kwargs = conn.recv()
        except (OSError, EOFError):
            log.error("launcher: rank %d: rank 0 (the controller) went away; stopping", env.rank)
            return 1
        if kind == "exit":
            conn.close()
            destroy()
            return 0
        try:
            reply = ("ok", getattr(worker, call)(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - sent to rank 0, which names this rank and the step
            reply = ("err", e)
        try:
            try:
                conn.send(reply)
            except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle: its text
                conn.send(("err", f"{type(reply[1]).__name__}: {reply[1]}"))
        except (OSError, EOFError):
            log.error("launcher: rank %d: rank 0 (the controller) went away; stopping", env.rank)
            return 1


# -- rank 0's trainer and weight sync (placement.py builds the roles from them) ------------------
def join_ranks(cfg: TidalConfig, model_dir, pad_token_id: int, env: LaunchEnv):
    """Rank 0's TrainerGroup over every rank of the job, set up (the process group formed), and
    the job (closed with the roles)."""
    pl = cfg.placement
    store = meet(env, pl.start_timeout_s)
    worker = TrainerWorker(cfg, str(model_dir), pad_token_id, rank=0, world_size=env.world_size)
    worker.store = PrefixStore("trainer", store)
    job = connect_ranks(env, store, worker, cfg, pl.start_timeout_s)
    try:
        gather([h.submit("setup", env.master_addr) for h in job.ranks], timeout_s=pl.start_timeout_s)
    except BaseException:
        job.close()
        raise
    dims = ParallelDims.from_config(cfg.train.parallel, env.world_size)
    return TrainerGroup(job.ranks, timeout_s=pl.call_timeout_s,
                        dp_index=[dims.dp_index(r) for r in range(env.world_size)]), job


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
