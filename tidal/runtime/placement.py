"""Placement: build the roles of a run in the driver (local), as Ray actors (ray), or over
the processes of a launcher (launcher: tidal/runtime/launcher.py).

local: one `TrainerWorker` in this process and the engine replicas beside it; weights
move in process. ray: Ray is started on loopback (or joins `placement.address`), one
placement group holds a bundle per trainer rank and per engine replica, trainer ranks
form a torch.distributed group (FSDP2 when more than one) and engines are actors of
their own (disaggregated) or live inside the trainer ranks (`placement.colocate`).
Either way the controller gets the same three things: a TrainerGroup, one Engine (a
router over the replicas when there are several) and a WeightPusher.

This module is the only place that knows about Ray (with workers.py and handles.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from tidal.config import TidalConfig
from tidal.engines.router import Router
from tidal.net import is_loopback
from tidal.runtime import launcher, ranks, ray_watchdog, topology
from tidal.runtime.handles import Handle, RoleError, gather
from tidal.runtime.sync import WeightPusher, choose_transport
from tidal.runtime.trainer_group import TrainerGroup, TrainerWorker
from tidal.runtime.workers import (
    EngineWorker,
    EnvWorker,
    RemoteEngine,
    RemoteEnvs,
    RewardActors,
    RewardWorker,
    make_engine,
)
from tidal.trainer.parallel.mesh import ParallelDims

log = logging.getLogger("tidal")


def keep_on_loopback() -> None:
    """Ray resolves "its" address to the machine's external interface unless it believes it
    runs a single-machine cluster; then every service it starts binds to loopback (measured:
    docs/architecture.md, "Ray"). Set before Ray starts; the processes it starts inherit it.

    The one use of Ray's private modules in tidal, confined here: Ray 2.60 has no public switch.
    The environment variable is what Ray reads, but it reads it once, into
    `ray_constants.ENABLE_RAY_CLUSTER`, when `ray` is first imported, which may have happened
    already in this process; so the constant is set too. Ray is pinned (pyproject.toml) for it."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def start_ray(cfg: TidalConfig, needed_cpus: float) -> tuple[bool, object]:
    """Join `placement.address`, or start a local Ray instance bound to `placement.host`.
    Returns whether this call started Ray (and so must shut it down), and the watchdog that
    ends its processes should this process die without doing so (tidal/runtime/ray_watchdog.py)."""
    import ray

    pl = cfg.placement
    if ray.is_initialized():
        return False, None
    host = pl.address.rsplit(":", 1)[0] if pl.address and pl.address != "auto" else pl.host
    if is_loopback(host):
        keep_on_loopback()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if pl.address:
        with _keeping_sigterm():
            ray.init(address=pl.address, logging_level=logging.WARNING, log_to_driver=True)
        return True, None  # a cluster of its own: not this run's to end
    cpus = max(float(os.cpu_count() or 1), needed_cpus)
    if needed_cpus > (os.cpu_count() or 1):
        log.warning("placement: the roles reserve %.1f CPUs and this machine has %d: the local Ray instance offers %.1f "
                    "(they will share cores)", needed_cpus, os.cpu_count() or 1, cpus)
    with _keeping_sigterm():
        ray.init(_node_ip_address=pl.host, include_dashboard=False, num_cpus=int(-(-cpus // 1)),
                 _temp_dir=pl.ray_temp_dir, logging_level=logging.WARNING, log_to_driver=True)
    try:
        raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    except (AttributeError, KeyError, IndexError) as e:  # Ray's internals moved: run without the watchdog
        log.warning("placement: no watchdog for the local Ray instance (its raylet was not found: %r)", e)
        return True, None
    return True, ray_watchdog.start(raylet)


@contextlib.contextmanager
def _keeping_sigterm():
    """ray.init replaces the driver's SIGTERM handler with its own `sys.exit(15)`; a handler the
    program set itself (tidal train's: stop cleanly naming the last checkpoint, exit 143) is put
    back after it. A program that set none keeps Ray's."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    except SystemExit as e:
        # A SIGTERM while ray.init runs met Ray's handler (`sys.exit(15)`): what Ray had started is
        # shut down, and the program's own handler gets the signal, as after ray.init.
        if not (callable(previous) and e.code == signal.SIGTERM):
            raise
        import ray

        signal.signal(signal.SIGTERM, previous)
        with contextlib.suppress(Exception):
            ray.shutdown()
        previous(signal.SIGTERM, None)
        raise
    finally:
        if callable(previous):
            signal.signal(signal.SIGTERM, previous)


@dataclass
class Roles:
    trainer: TrainerGroup
    engine: object  # an Engine: one replica, or a Router over several
    pusher: WeightPusher
    started_ray: bool = False
    placement_group: object = None
    # The reward actors' slots (placement.reward_workers > 0): pass to build_scorer(ray_handles=...).
    reward_handles: RewardActors | None = None
    env_handles: list[Handle] = field(default_factory=list)
    envs: object = None  # RemoteEnvs: environments on the env workers; None: in the driver
    watchdog: object = None  # the local Ray instance's watchdog (tidal/runtime/ray_watchdog.py), if started
    node_groups: list = field(default_factory=list)  # Ray: the trainer ranks' STRICT_PACK groups (topology.py)
    launched: object = None  # placement.mode=launcher: the job's ranks (tidal/runtime/launcher.py)

    def close(self) -> None:
        try:
            self._close()
        finally:
            ray_watchdog.stop(self.watchdog)  # Ray closed (or closing raised): nothing for it to end

    def _close(self) -> None:
        if self.placement_group is not None and not gcs_answers():
            # Ray's GCS died (its node went down, `ray stop`): every call below would wait on it
            # and Ray ends the process after 60 s of that. The actors go with their raylets:
            # ray.shutdown() stops what this run started, and the run's own outcome stands.
            log.warning("placement: Ray's GCS does not answer; the actors are not killed one by one")
            if self.started_ray:
                ray_shutdown_quietly()
            return
        try:
            for engine in self.engine.replicas if isinstance(self.engine, Router) else [self.engine]:
                engine.close()
        finally:
            if self.launched is not None:  # the other ranks leave their loops
                self.launched.close()
        if self.placement_group is None:
            return
        import ray

        for h in self.trainer.ranks + self.pusher.engine_handles + self.env_handles:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(h.target, no_restart=True)
        if self.reward_handles is not None:
            self.reward_handles.kill_all()
        for group in [*self.node_groups, self.placement_group]:
            ray.util.remove_placement_group(group)
        if self.started_ray:
            ray.shutdown()


def gcs_answers(timeout_s: float = 2.0) -> bool:
    """Whether Ray's GCS answers a trivial call within `timeout_s`."""
    import ray

    try:
        ray._private.worker.global_worker.gcs_client.internal_kv_exists(b"tidal-ping", b"tidal", timeout=timeout_s)
    except Exception:  # noqa: BLE001 - any failure to answer is the answer
        return False
    return True


def ray_shutdown_quietly() -> None:
    import ray

    try:
        ray.shutdown()
    except Exception as e:  # noqa: BLE001 - the cluster is already gone
        log.warning("placement: ray.shutdown() raised %s: %s", type(e).__name__, e)


def build_roles(cfg: TidalConfig, model_dir: Path, pad_token_id: int, engine_kind: str, run_dir: Path) -> Roles:
    if cfg.placement.mode == "local":
        return _local_roles(cfg, model_dir, pad_token_id, engine_kind, run_dir)
    if cfg.placement.mode == "launcher":
        return _launcher_roles(cfg, model_dir, pad_token_id, engine_kind, run_dir)
    return _ray_roles(cfg, model_dir, pad_token_id, engine_kind, run_dir)


def _router(cfg: TidalConfig, engines: list, names: list[str]):
    if len(engines) == 1:
        return engines[0]
    return Router(engines, names=names, max_inflight=cfg.engine.max_inflight, timeout_s=cfg.engine.request_timeout_s)


def _local_roles(cfg, model_dir, pad_token_id, engine_kind, run_dir) -> Roles:
    worker = TrainerWorker(cfg, str(model_dir), pad_token_id)
    worker.setup()
    trainer = TrainerGroup([Handle("trainer", worker)], timeout_s=cfg.placement.call_timeout_s,
                           routing_replay=cfg.train.moe.routing_replay)
    engines = [make_engine(cfg, engine_kind, model_dir, pad_token_id, run_dir / "engine") for _ in range(cfg.engine.replicas)]
    engine = _router(cfg, engines, [f"replica{i}" for i in range(len(engines))])
    return Roles(trainer, engine, WeightPusher.in_driver(trainer, engine))


def _launcher_roles(cfg, model_dir, pad_token_id, engine_kind, run_dir) -> Roles:
    """Rank 0 of a launcher's job: a TrainerGroup over the trainer ranks (tidal/runtime/launcher.py),
    and the engines in this process (as local mode: weights gathered on every rank and loaded
    here), or with placement.colocate one in each rank, reached as Ray's colocated ranks are
    (weights loaded by each rank into its own engine), or with placement.engine_ranks one in each
    engine rank, reached as Ray's engine actors are (weights by placement.weight_sync)."""
    env = ranks.detect(os.environ)
    pl = cfg.placement
    trainer, engine_ranks, job = launcher.join_ranks(cfg, model_dir, pad_token_id, env, engine_kind, run_dir)
    if pl.colocate or engine_ranks:
        handles = job.ranks if pl.colocate else engine_ranks
        names = [f"engine replica{i} (in trainer rank {i})" for i in range(env.world_size)] if pl.colocate else \
            [h.role for h in engine_ranks]
        remotes = [RemoteEngine(h, n, timeout_s=cfg.engine.request_timeout_s) for h, n in zip(handles, names)]
        engine = Router(remotes, names=names, max_inflight=cfg.engine.max_inflight, timeout_s=cfg.engine.request_timeout_s)
        transport = choose_transport(pl.weight_sync, pl.colocate, cfg.engine.tensor_parallel, cfg.engine.kind,
                                     lora=cfg.train.lora.rank > 0)
        sync_dir = Path(pl.weight_sync_dir) if pl.weight_sync_dir else run_dir / "weights"
        try:
            pusher = WeightPusher.remote(cfg, trainer, engine, handles, transport, sync_dir)
            pusher.prepare()
        except BaseException:
            job.close()
            raise
        where = "each rank hosts 1 engine replica" if pl.colocate else \
            f"ranks {pl.trainer_ranks}-{env.world_size - 1} host 1 engine replica each, weights by {transport}"
    else:
        try:
            engines = [make_engine(cfg, engine_kind, model_dir, pad_token_id, run_dir / "engine")
                       for _ in range(cfg.engine.replicas)]
        except BaseException:
            job.close()
            raise
        engine = _router(cfg, engines, [f"replica{i}" for i in range(len(engines))])
        pusher = WeightPusher(launcher.push_in_process(trainer, engine, cfg.placement.call_timeout_s),
                              f"in process (rank 0 of {env.launcher})")
        where = f"rank 0 hosts {len(engines)} engine replica(s)"
    log.info("placement: launcher (%s), %d trainer rank(s), rank 0 at %s:%d, %s", env.launcher, pl.trainer_ranks,
             env.master_addr, env.master_port, where)
    return Roles(trainer, engine, pusher, launched=job)


def _bundle(res, gpus_extra: float = 0.0) -> dict[str, float]:
    b = {"CPU": res.num_cpus, **res.resources}
    if res.num_gpus + gpus_extra:
        b["GPU"] = res.num_gpus + gpus_extra
    return {k: v for k, v in b.items() if v}


def _ray_roles(cfg, model_dir, pad_token_id, engine_kind, run_dir) -> Roles:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pl = cfg.placement
    n_train, n_eng = pl.trainer_ranks, cfg.engine.replicas
    colocated = pl.colocate
    others = [] if colocated else [_bundle(pl.engine) for _ in range(n_eng)]
    first_reward = len(others)
    others += [_bundle(pl.reward) for _ in range(pl.reward_workers)]
    first_env = len(others)
    others += [_bundle(pl.env) for _ in range(pl.env_workers)]
    dims = ParallelDims.from_config(cfg.train.parallel, n_train)
    trainer_bundle = _bundle(pl.trainer, pl.engine.num_gpus if colocated else 0.0)
    strict, rest, slots = topology.bundle_layout(n_train, topology.group_size(dims.tp, dims.cp, dims.ep),
                                                 trainer_bundle, others)
    started, watchdog = start_ray(cfg, sum(b.get("CPU", 0.0) for b in [*(b for g in strict for b in g), *rest]))
    groups = _placement_groups(pl, strict, rest)
    pg, offset = groups[-1], 0 if strict else n_train  # the other roles' group (if any); where they start in it

    def actor(cls, index: int, res, **opts):  # the other roles' bundle `index`
        group = opts.pop("group", pg)
        return ray.remote(cls).options(
            num_cpus=res.num_cpus, num_gpus=res.num_gpus + opts.pop("gpus_extra", 0.0), max_concurrency=64,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index), **opts)

    engine_log = str(run_dir / "engine")
    ranks = []
    for r in range(n_train):
        group, index = slots[r]
        cls = actor(TrainerWorker, index, pl.trainer, gpus_extra=pl.engine.num_gpus if colocated else 0.0,
                    group=groups[group])
        ranks.append(Handle(f"trainer rank {r}", cls.remote(
            cfg, str(model_dir), pad_token_id, rank=r, world_size=n_train,
            engine_kind=engine_kind if colocated else None, log_dir=engine_log, num_cpus=pl.trainer.num_cpus), remote=True))
    addr, port = ranks[0].call("where", timeout_s=pl.start_timeout_s)
    gather([h.submit("setup", addr, port) for h in ranks], timeout_s=pl.start_timeout_s)
    trainer = TrainerGroup(ranks, timeout_s=pl.call_timeout_s, dp_index=[dims.dp_index(r) for r in range(n_train)],
                           routing_replay=cfg.train.moe.routing_replay)

    def spawn_engine(i: int) -> Handle:
        if colocated:
            return ranks[i]
        cls = actor(EngineWorker, offset + i, pl.engine)
        h = Handle(f"engine replica{i}", cls.remote(cfg, engine_kind, str(model_dir), pad_token_id,
                                                     log_dir=engine_log, num_cpus=pl.engine.num_cpus), remote=True)
        h.call("pid", timeout_s=pl.start_timeout_s)  # constructed: the model is loaded
        return h

    handles = [spawn_engine(i) for i in range(n_eng)]
    names = [f"engine replica{i}" + (f" (in trainer rank {i})" if colocated else "") for i in range(n_eng)]
    remotes = [RemoteEngine(h, n, timeout_s=cfg.engine.request_timeout_s) for h, n in zip(handles, names)]
    engine = Router(remotes, names=names, max_inflight=cfg.engine.max_inflight, timeout_s=cfg.engine.request_timeout_s)

    def start_reward_actor(i: int, specs: list, timeout_s: float):  # the scorer starts them (it knows the rewards)
        return actor(RewardWorker, offset + first_reward + i, pl.reward).remote(specs, timeout_s, num_cpus=pl.reward.num_cpus,
                                                                      reward_cfg=cfg.reward.model_dump(mode="json"))

    rewards = RewardActors(pl.reward_workers, start_reward_actor) if pl.reward_workers else None
    envs, remote_envs = _env_workers(cfg, lambda i: actor(EnvWorker, offset + first_env + i, pl.env))

    transport = choose_transport(pl.weight_sync, colocated, cfg.engine.tensor_parallel, cfg.engine.kind,
                                 lora=cfg.train.lora.rank > 0)
    sync_dir = Path(pl.weight_sync_dir) if pl.weight_sync_dir else run_dir / "weights"
    pusher = WeightPusher.remote(cfg, trainer, engine, handles, transport, sync_dir,
                                 respawn=None if colocated or not pl.restart_engines else spawn_engine)
    log.info("placement: ray, %d trainer rank(s), %d engine replica(s) (%s), weight sync %s",
             n_train, n_eng, "colocated" if colocated else "disaggregated", transport)
    pusher.prepare()  # weight_sync=shard: the group forms and the transfer plan is logged now
    return Roles(trainer, engine, pusher, started_ray=started, watchdog=watchdog, placement_group=pg,
                 node_groups=groups[:-1],
                 reward_handles=rewards, env_handles=envs, envs=remote_envs)


def _placement_groups(pl, strict: list[list[dict]], rest: list[dict]) -> list:
    """One STRICT_PACK placement group per group of trainer ranks that must share a node
    (tidal/runtime/topology.py), then the group of the other bundles (`placement.strategy`),
    all ready within placement.start_timeout_s, or every one removed again and the start
    failed, naming what could not be placed and what a node must offer for it."""
    import ray
    from ray.util.placement_group import placement_group

    groups = [placement_group(b, strategy="STRICT_PACK", name="") for b in strict]
    if rest:  # absent where every bundle is a grouped trainer rank's (colocated, no workers)
        groups.append(placement_group(rest, strategy=pl.strategy, name=""))
    ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=pl.start_timeout_s)
    if len(ready) == len(groups):
        return groups
    waiting = [i for i, g in enumerate(groups) if g.ready() not in ready]
    for g in groups:
        ray.util.remove_placement_group(g)
    first = waiting[0]
    if first < len(strict):
        size = len(strict[first])
        what = (f"trainer ranks {first * size}-{first * size + size - 1} (one tp × cp × ep group, kept on one node) "
                f"need one node offering {topology.total(strict[first])}")
    else:
        what = f"the cluster cannot hold the bundles {rest}"
    raise RoleError("placement", "placement_group", None, "timeout",
                    f"{pl.start_timeout_s:g} s: {what} (the cluster offers {ray.cluster_resources()} in all)")


def _env_workers(cfg: TidalConfig, actor_of) -> tuple[list[Handle], RemoteEnvs | None]:
    """The env workers (`placement.env_workers`), started, and the `make_env` over them that
    replaces a dead one (None without workers). `actor_of(i)` is the actor class of slot i."""
    pl = cfg.placement

    def spawn_env(i: int) -> Handle:
        return Handle(f"env worker {i}", actor_of(i).remote(cfg, num_cpus=pl.env.num_cpus), remote=True)

    envs = [spawn_env(i) for i in range(pl.env_workers)]
    gather([h.submit("pid") for h in envs], timeout_s=pl.start_timeout_s)

    def respawn_env(i: int) -> Handle:  # a dead env worker's replacement, constructed
        h = spawn_env(i)
        h.call("pid", timeout_s=pl.start_timeout_s)
        return h

    if not envs:
        return envs, None
    return envs, RemoteEnvs(envs, cfg.task.name, timeout_s=cfg.rollout.episode_timeout_s, agent=cfg.task.agent,
                            respawn=respawn_env, max_restarts=cfg.run.max_restarts, ping_s=pl.ping_s)
