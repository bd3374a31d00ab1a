"""placement.mode=launcher, the fast parts: which launcher started us and where the ranks meet
(a pure function of the environment), the config it refuses, and rank 0's handle of another
rank over a real control connection (a rank that ends is named with the call and the step).
The runs under torchrun, mpirun and srun are in tests/test_launcher_runs.py (slow)."""

from __future__ import annotations

import asyncio
import threading
import time
from multiprocessing import Pipe

import pytest

from tidal.config import ConfigError, load_config
from tidal.runtime import handles
from tidal.runtime.handles import Handle, Pending, RoleDied, RoleError, gather
from tidal.runtime.launcher import LocalRank, RemoteRank, config_for, role_of
from tidal.runtime.rank_link import serve_calls
from tidal.runtime.ranks import LOOPBACK, PORT_BASE, PORT_SPAN, detect

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "x"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "569114625"}
SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0",
         "SLURM_STEP_NUM_NODES": "1"}


def no_scontrol(nodelist: str) -> str:
    raise AssertionError(f"one node needs no node list, got {nodelist}")


def test_torchrun_gives_everything_and_its_agent_hosts_the_store():
    env = detect(TORCHRUN, no_scontrol)
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("torchrun", 1, 2, 1)
    assert (env.master_addr, env.master_port, env.agent_store) == ("127.0.0.1", 29500, True)
    assert not env.is_controller


def test_openmpi_on_one_node_meets_on_loopback_at_a_port_of_its_job():
    env = detect(OPENMPI, no_scontrol)
    assert (env.launcher, env.rank, env.world_size, env.master_addr) == ("openmpi", 0, 2, LOOPBACK)
    assert PORT_BASE <= env.master_port < PORT_BASE + PORT_SPAN and not env.agent_store
    other_job = detect({**OPENMPI, "OMPI_MCA_ess_base_jobid": "569114626"}, no_scontrol)
    assert other_job.master_port != env.master_port  # two jobs on one node do not meet
    assert detect({**OPENMPI, "MASTER_PORT": "31234"}, no_scontrol).master_port == 31234


# What MPICH 4.0's Hydra (Debian's mpich, `mpiexec.mpich -n 2`) put in rank 1's environment, measured: no job id.
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "8"}


def test_mpich_on_one_node_meets_at_a_port_of_its_hydra_proxy():
    env = detect(MPICH, no_scontrol, parent_pid=lambda: 28940)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.master_addr) == ("mpich", 1, 2, 1, LOOPBACK)
    assert PORT_BASE <= env.master_port < PORT_BASE + PORT_SPAN
    assert detect({**MPICH, "PMI_RANK": "0", "MPI_LOCALRANKID": "0"}, no_scontrol,
                  parent_pid=lambda: 28940).master_port == env.master_port  # the job's ranks share the proxy
    assert detect(MPICH, no_scontrol, parent_pid=lambda: 28941).master_port != env.master_port  # another job
    several = {**MPICH, "MPI_LOCALNRANKS": "1", "MASTER_ADDR": "10.0.0.5"}  # no proxy shared: the port is asked for
    with pytest.raises(ConfigError, match=r"mpich gave no job id \(PMI_KVSNAME\).*set MASTER_PORT"):
        detect(several, no_scontrol, parent_pid=lambda: 28940)


def test_openmpi_on_several_nodes_needs_master_addr():
    several = {**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    with pytest.raises(ConfigError, match="MASTER_ADDR is not set"):
        detect(several, no_scontrol)
    assert detect({**several, "MASTER_ADDR": "10.0.0.5"}, no_scontrol).master_addr == "10.0.0.5"


def test_srun_on_several_nodes_meets_on_the_first_host():
    env = detect({**SLURM, "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[3-4]"},
                 lambda nodelist: {"gpu[3-4]": "gpu3"}[nodelist])
    assert (env.launcher, env.rank, env.world_size, env.master_addr) == ("slurm", 1, 4, "gpu3")
    assert detect(SLURM, no_scontrol).master_addr == LOOPBACK


def test_torchrun_inside_a_slurm_allocation_is_torchrun():
    assert detect({**SLURM, **TORCHRUN}, no_scontrol).launcher == "torchrun"


@pytest.mark.parametrize("environ, message", [
    ({}, "no launcher's rank variable is set"),
    ({k: v for k, v in OPENMPI.items() if k != "OMPI_COMM_WORLD_SIZE"}, "not OMPI_COMM_WORLD_SIZE"),
    ({**SLURM, "SLURM_PROCID": "4"}, "SLURM_PROCID=4 is not a rank of SLURM_NTASKS=4"),
    ({**SLURM, "SLURM_NTASKS": "two"}, "SLURM_NTASKS='two' is not an integer"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, "MASTER_ADDR / MASTER_PORT"),
    ({**OPENMPI, "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port"),
])
def test_a_partial_or_wrong_environment_is_named(environ, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        detect(environ, no_scontrol)


@pytest.mark.parametrize("override, key", [
    ("placement.reward_workers=1", "placement.reward_workers"),
    ("placement.env_workers=1", "placement.env_workers"),
    ("placement.address=127.0.0.1:6379", "placement.address"),
    ("placement.weight_sync=broadcast", "placement.weight_sync"),
])
def test_what_needs_ray_is_refused_by_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(overrides=["placement.mode=launcher", override])


def test_the_launcher_decides_the_number_of_ranks():
    env = detect({**SLURM, "SLURM_NTASKS": "2"}, no_scontrol)
    assert config_for(load_config(overrides=["placement.mode=launcher"]), env).placement.trainer_ranks == 2
    assert config_for(load_config(overrides=["placement.mode=launcher", "placement.trainer_ranks=2"]),
                      env).placement.trainer_ranks == 2
    with pytest.raises(ConfigError, match="trainer_ranks=3, but slurm started 2"):
        config_for(load_config(overrides=["placement.mode=launcher", "placement.trainer_ranks=3"]), env)
    with pytest.raises(ConfigError, match="with 2 ranks"):  # the mesh must fit the world size
        config_for(load_config(overrides=["placement.mode=launcher", "train.parallel.tp=4"]), env)


def test_colocated_engines_are_one_per_rank():
    env = detect({**SLURM, "SLURM_NTASKS": "2"}, no_scontrol)
    cfg = config_for(load_config(overrides=["placement.mode=launcher", "placement.colocate=true"]), env)
    assert (cfg.engine.replicas, cfg.placement.trainer_ranks) == (2, 2)
    with pytest.raises(ConfigError, match="engine.replicas=3, but slurm started 2"):
        config_for(load_config(overrides=["placement.mode=launcher", "placement.colocate=true", "engine.replicas=3"]),
                   env)
    # without colocate the replicas stay in rank 0, as many as configured
    assert config_for(load_config(overrides=["placement.mode=launcher", "engine.replicas=3"]), env).engine.replicas == 3


def test_engine_ranks_are_the_last_ranks_and_the_rest_train():
    env = detect({**SLURM, "SLURM_NTASKS": "3"}, no_scontrol)
    cfg = config_for(load_config(overrides=["placement.mode=launcher", "placement.engine_ranks=1"]), env)
    assert (cfg.placement.trainer_ranks, cfg.engine.replicas) == (2, 1)
    assert [role_of(cfg, r) for r in range(3)] == ["trainer rank 0", "trainer rank 1", "engine replica0 (rank 2)"]
    with pytest.raises(ConfigError, match="engine_ranks=3, but slurm started 3 process.*at least one must be a trainer"):
        config_for(load_config(overrides=["placement.mode=launcher", "placement.engine_ranks=3"]), env)
    with pytest.raises(ConfigError, match="trainer_ranks=3, but slurm started 3 process.*less placement.engine_ranks=1"):
        config_for(load_config(overrides=["placement.mode=launcher", "placement.engine_ranks=1",
                                          "placement.trainer_ranks=3"]), env)
    with pytest.raises(ConfigError, match="engine.replicas=2, but slurm started placement.engine_ranks=1"):
        config_for(load_config(overrides=["placement.mode=launcher", "placement.engine_ranks=1", "engine.replicas=2"]),
                   env)


@pytest.mark.parametrize("overrides, message", [
    (["placement.mode=ray", "placement.engine_ranks=1"], "placement.engine_ranks=1 needs placement.mode=launcher"),
    (["placement.mode=launcher", "placement.engine_ranks=1", "placement.colocate=true"], "not both"),
    (["placement.mode=launcher", "placement.engine_ranks=1", "placement.weight_sync=inprocess"],
     "weight_sync=inprocess with placement.engine_ranks"),
    (["placement.mode=launcher", "placement.weight_sync=disk"], "need engines on ranks of their own"),
])
def test_engine_ranks_refuse_what_cannot_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)
    assert load_config(overrides=["placement.mode=launcher", "placement.engine_ranks=1", "placement.weight_sync=disk"])


# -- rank 0's handle of another rank, over a real connection: the rank's own loop (serve_calls) ------
class Worker:
    """What a rank serves: plain calls (a trainer's: in order, one at a time) and an async one
    (a colocated engine's generate: at once, many together)."""

    def __init__(self, answers: dict):
        self.answers, self.order, self.overlap = answers, [], 0
        self._running = 0

    def __getattr__(self, call):
        if call not in self.__dict__.get("answers", {}):
            raise AttributeError(call)

        def run(*_args):
            self._running += 1
            self.overlap = max(self.overlap, self._running)
            time.sleep(0.05)
            self._running -= 1
            self.order.append(call)
            value = self.answers[call]
            if isinstance(value, BaseException):
                raise value
            return value
        return run

    async def generate(self, seconds: float, tag: str):
        await asyncio.sleep(seconds)
        return tag


def serve(conn, worker) -> None:
    """serve_calls, on a thread; "die" / "die_later" close its end as an ended process does."""
    class Closing:
        def __init__(self, c):
            self.c = c

        def recv(self):
            msg = self.c.recv()
            if msg[2] in ("die", "die_later"):
                time.sleep(0.3 if msg[2] == "die_later" else 0.0)
                self.c.close()
                raise EOFError
            return msg

        def send(self, obj):
            self.c.send(obj)

        def close(self):
            self.c.close()

    serve_calls(Closing(conn), worker, 1)


def remote_rank(answers: dict, worker: Worker | None = None) -> RemoteRank:
    ours, theirs = Pipe()
    threading.Thread(target=serve, args=(theirs, worker or Worker(answers)), daemon=True).start()
    return RemoteRank(1, ours, pid=1234)


def test_a_remote_rank_answers_in_order_and_its_errors_keep_their_type():
    worker = Worker({"version": 7, "pid": 1234, "bad": ValueError("shard 3 is empty")})
    h = remote_rank({}, worker)
    assert gather([h.submit("version"), h.submit("pid"), h.submit("version")], timeout_s=10) == [7, 1234, 7]
    assert worker.order == ["version", "pid", "version"] and worker.overlap == 1  # one at a time, in order
    with pytest.raises(RoleError, match=r"trainer rank 1: `bad` at step 5 raised ValueError: shard 3 is empty"):
        gather([h.submit("bad")], step=5, timeout_s=10)
    with pytest.raises(RoleError, match=r"`nothing` raised AttributeError: Worker has no call 'nothing'"):
        gather([h.submit("nothing")], timeout_s=10)
    h.stop()


def test_async_calls_run_together_and_are_not_held_behind_a_trainer_call():
    h = remote_rank({"slow": "trained"})

    async def main():
        t0 = time.monotonic()
        slow = h.submit("slow")  # 0.05 s on the rank's in-order thread
        tags = await asyncio.gather(*(h.acall("generate", 0.5, f"r{i}", timeout_s=10) for i in range(8)))
        took = time.monotonic() - t0
        assert gather([slow], timeout_s=10) == ["trained"]
        return tags, took

    tags, took = asyncio.run(main())
    assert tags == [f"r{i}" for i in range(8)]  # each answer matched to its own call
    assert took < 2.0  # together: 8 × 0.5 s one after another would be 4 s
    with pytest.raises(TimeoutError, match="trainer rank 1 did not answer generate within 0.1 s"):
        asyncio.run(h.acall("generate", 1.0, "late", timeout_s=0.1))
    assert gather([h.submit("slow")], timeout_s=10) == ["trained"]  # the late answer was dropped, not misdelivered
    h.stop()


def test_a_rank_that_ends_is_named_with_the_call_and_step_at_once():
    h = remote_rank({"version": 7})
    t0 = time.monotonic()
    with pytest.raises(RoleError, match=r"trainer rank 1 died during `die` at step 3: its process \(pid 1234\) ended"):
        gather([h.submit("die")], step=3, timeout_s=60)
    assert time.monotonic() - t0 < 10  # the closed connection, not the 60 s bound
    with pytest.raises(RoleError, match=r"trainer rank 1 died during `version`"):  # and every later call
        gather([h.submit("version")], timeout_s=60)


def test_a_generation_pending_on_a_rank_that_ends_fails_naming_it():
    h = remote_rank({})

    async def main():
        pending = asyncio.ensure_future(h.acall("generate", 30.0, "never", timeout_s=60))
        await asyncio.sleep(0.1)
        h.submit("die")
        await pending

    with pytest.raises(RoleDied, match=r"its process \(pid 1234\) ended"):
        asyncio.run(main())


class Collective:
    """Rank 0's worker in a collective whose peer is going: gloo fails it first."""

    def forward_backward(self):
        raise RuntimeError("gloo: Connection closed by peer")


@pytest.mark.parametrize("grace", [2.0, 0.0])
def test_the_dead_rank_is_reported_over_the_failure_it_caused_in_its_peer(monkeypatch, grace):
    monkeypatch.setattr(handles, "FAILURE_GRACE_S", grace)
    rank0, rank1 = LocalRank(Collective()), remote_rank({})
    # rank 1's process ends 0.3 s into the call; rank 0's collective fails at once because of it
    calls = [rank0.submit("forward_backward"), rank1.submit("die_later")]
    if grace:
        with pytest.raises(RoleError, match="trainer rank 1 died during `die_later` at step 2"):
            gather(calls, step=2, timeout_s=30)
    else:  # the control: without the grace, the peer's failure is what is reported
        with pytest.raises(RoleError, match="trainer rank 0: `forward_backward` at step 2 raised RuntimeError: gloo"):
            gather(calls, step=2, timeout_s=30)


def test_a_hung_rank_is_a_timeout_naming_it():
    ours, _theirs = Pipe()  # nobody answers
    h = RemoteRank(1, ours, pid=99)
    with pytest.raises(RoleError, match=r"trainer rank 1: `version` at step 4 did not answer within 0.5 s"):
        gather([h.submit("version")], step=4, timeout_s=0.5)


def test_local_handles_still_raise_at_once():
    p = Handle("trainer", object()).submit("missing")
    assert isinstance(p, Pending) and p.error is not None


def test_train_without_a_launcher_says_so_before_anything_is_written(tmp_path, monkeypatch, capsys):
    from tidal.cli import main
    from tidal.runtime.ranks import LAUNCHERS

    for rank_var, size_var, local_var, *_ in LAUNCHERS.values():
        for var in (rank_var, size_var, local_var):
            monkeypatch.delenv(var, raising=False)
    assert main(["train", "placement.mode=launcher", f"run.dir={tmp_path / 'run'}"]) == 2
    assert "no launcher's rank variable is set" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
