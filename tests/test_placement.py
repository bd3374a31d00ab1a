"""placement.mode=ray: roles as Ray actors on loopback, one handle type, bounded calls,
weight sync by every transport, a dead engine replaced without losing or doubling an
episode, and a trainer rank that dies reported by role, call and step."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
from engine_checks import LOGPROB_TOL

from tidal.config import ConfigError, load_config
from tidal.runtime.controller import Controller
from tidal.runtime.handles import Handle, RoleError, gather
from tidal.runtime.placement import keep_on_loopback


def config(tmp_path: Path, *overrides: str, name: str = "run"):
    return load_config(overrides=[
        f"run.dir={tmp_path / name}", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.steps=2",
        "run.eval_every=0", "run.progress=false", "run.save_every=0", "placement.trainer.num_cpus=0.5",
        "placement.engine.num_cpus=0.5", "placement.call_timeout_s=120", *overrides])


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def same_training(a: dict, b: dict, tol: float = 1e-5) -> None:
    """The run's numbers, not its timings (nor the bytes its weight transport moved), agree. Ray vs local runs one trainer's code in one
    process either way (only torch's thread count may differ): measured bit-equal here, so 1e-5
    is slack for thread-count summation order; 2 FSDP ranks vs 1 process pass tol=1e-4 (below)."""
    for k, v in a.items():
        if k.startswith(("time/", "engines/", "weight_sync/")) or k.endswith("per_s") or k in ("logprob_abs_diff", "mismatch_kl",
                                                                               "logprob_max_abs_diff"):
            continue
        assert b[k] == pytest.approx(v, rel=tol, abs=tol), k


@pytest.fixture(scope="module")
def ray_local():
    """One Ray instance on loopback for the module (each run then joins it)."""
    keep_on_loopback()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(_node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


# -- config -----------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, key", [
    (["placement.trainer_ranks=2"], "placement.trainer_ranks"),
    (["placement.colocate=true"], "placement.colocate"),
    (["placement.mode=ray", "placement.colocate=true", "engine.replicas=2"], "engine.replicas"),
    (["placement.weight_sync=broadcast"], "placement.weight_sync"),
    (["placement.mode=cluster"], "placement.mode"),
    (["placement.env_workers=1"], "placement.env_workers"),
])
def test_bad_placement_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(overrides=overrides)


# -- handles ----------------------------------------------------------------------------------
class _Local:
    def ok(self, x):
        return x + 1

    def bad(self):
        raise KeyError("answer")


def test_local_handle_reports_role_call_and_step():
    h = Handle("trainer rank 0", _Local())
    assert gather([h.submit("ok", 1), h.submit("ok", 2)]) == [2, 3]
    with pytest.raises(RoleError, match=r"trainer rank 0: `bad` at step 7 raised KeyError: 'answer'"):
        h.call("bad", step=7)


def test_remote_handle_timeout_death_and_error(ray_local):
    @ray.remote(num_cpus=0)
    class Slow:
        def nap(self, s):
            time.sleep(s)
            return s

        def die(self):
            os._exit(1)

        def bad(self):
            raise ValueError("no column `answer`")

    h = Handle("reward worker 3", Slow.options(max_concurrency=4).remote(), remote=True)  # the nap goes on
    assert h.call("nap", 0) == 0
    t0 = time.monotonic()
    with pytest.raises(RoleError, match=r"reward worker 3: `nap` at step 2 did not answer within 1 s"):
        h.call("nap", 30, step=2, timeout_s=1)
    assert time.monotonic() - t0 < 10
    with pytest.raises(RoleError, match=r"reward worker 3: `bad` at step 4 raised ValueError: no column `answer`"):
        h.call("bad", step=4)
    h2 = Handle("reward worker 4", Slow.remote(), remote=True)
    with pytest.raises(RoleError, match=r"reward worker 4 died during `die` at step 5") as e:
        h2.call("die", step=5, timeout_s=60)
    assert e.value.kind == "died"


# -- Ray on loopback --------------------------------------------------------------------------
def _listening(pids: set[int]) -> list[str]:
    """Addresses the given processes listen on (TCP, IPv4 and IPv6), from /proc."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                raw = bytes.fromhex(f[1].split(":")[0])
                # the kernel prints each 32-bit word in host (little-endian) order
                addr = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
                mapped = getattr(addr, "ipv4_mapped", None)
                out.append(mapped or addr)
    return out


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [root]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += children.get(p, [])
    return out


def test_ray_and_its_services_listen_on_loopback_only(ray_local):
    @ray.remote(num_cpus=0)
    class Probe:
        def pid(self):
            return os.getpid()

    probe = Probe.remote()
    ray.get(probe.pid.remote())
    addrs = _listening(_descendants(os.getpid()))
    assert len(addrs) >= 3, addrs  # GCS, raylet, workers: the check sees them
    assert all(a.is_loopback for a in addrs), [str(a) for a in addrs]


# -- training in ray mode ---------------------------------------------------------------------
def _train(cfg) -> Controller:
    ctl = Controller(cfg)
    try:
        ctl.train()
    finally:
        ctl.close()
    return ctl


def test_colocated_ray_run_equals_local_run(tmp_path, ray_local):
    _train(config(tmp_path, name="local"))
    ctl = Controller(config(tmp_path, "placement.mode=ray", "placement.colocate=true", name="ray"))
    try:
        ctl.train()
        assert ctl.trainer.ranks[0].call("sleeps") == 2  # the engine slept while its rank trained, each step
    finally:
        ctl.close()
    local, remote = metrics(tmp_path / "local"), metrics(tmp_path / "ray")
    assert len(local) == len(remote) == 2
    for a, b in zip(local, remote):
        same_training(a, b)
    assert (tmp_path / "ray" / "checkpoints" / "step_000002" / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("transport", ["broadcast", "disk"])
def test_disaggregated_engines_get_every_version(tmp_path, ray_local, transport):
    cfg = config(tmp_path, "placement.mode=ray", "engine.replicas=2", f"placement.weight_sync={transport}",
                 "placement.weight_sync_checksum=true", "train.steps=3")
    ctl = Controller(cfg)
    try:
        ctl.train()
        assert ctl.trainer.version == 3
        assert [r.version for r in ctl.engine.replicas] == [3, 3]
        # What the engines hold is what the trainer holds: same greedy answers as a local engine.
        assert [h.call("engine_version") for h in ctl.pusher.engine_handles] == [3, 3]
        assert sum(ctl.engine.served) == 3 * 16
    finally:
        ctl.close()
    local = _train(config(tmp_path, "train.steps=3", name="local"))
    assert local.trainer.version == 3
    for a, b in zip(metrics(tmp_path / "local"), metrics(tmp_path / "run")):
        same_training(a, b)


def test_two_fsdp_ranks_train_as_one_process(tmp_path, ray_local):
    """The TrainerGroup splits each batch across 2 FSDP ranks (balanced by tokens, global
    denominators) and puts per-position answers back in order: two mini-batches a step make
    the PPO anchor a `logprobs` call across ranks."""
    common = ("train.mini_batches=2", "train.steps=2")
    _train(config(tmp_path, *common, name="local"))
    ctl = _train(config(tmp_path, "placement.mode=ray", "placement.trainer_ranks=2", *common))
    assert ctl.trainer.world_size == 2 and ctl.trainer.version == 4
    for a, b in zip(metrics(tmp_path / "local"), metrics(tmp_path / "run")):
        # sharded sums over 4 optimizer steps: measured ≤ 3.4e-7 on grad_norm ~0.5 (0.34% of 1e-4);
        # a mis-ordered or dropped shard moves loss and grad_norm by percents
        same_training(a, b, tol=1e-4)


def test_reward_workers_score_every_episode(tmp_path, ray_local):
    cfg = config(tmp_path, "placement.mode=ray", "placement.colocate=true", "placement.reward_workers=2",
                 "placement.reward.num_cpus=0.25")
    ctl = Controller(cfg)
    try:
        ctl.train()
        served = ctl.scorer.served  # calls answered per reward actor: one per episode (a per-sample reward)
        assert sum(served) == 2 * 16 and min(served) > 0  # both workers scored
        pids = set(ctl.scorer.pids())
        assert os.getpid() not in pids and len(pids) == 2 and len(ctl.roles.reward_handles.live) == 2
    finally:
        ctl.close()
    _train(config(tmp_path, name="local"))
    for a, b in zip(metrics(tmp_path / "local"), metrics(tmp_path / "run")):
        same_training(a, b)


def test_env_workers_host_every_episode(tmp_path, ray_local):
    """Environments (and the rewards they compute) run on env workers; training equals local."""
    ctl = Controller(config(tmp_path, "placement.mode=ray", "placement.colocate=true", "placement.env_workers=2",
                            "placement.env.num_cpus=0.25"))
    try:
        ctl.train()
        assert sum(ctl.roles.envs.served) == 2 * 16 and min(ctl.roles.envs.served) > 0
        assert ctl.roles.envs.live == [0, 0]  # every episode's environment was let go
        assert [h.call("live") for h in ctl.roles.env_handles] == [0, 0]
    finally:
        ctl.close()
    _train(config(tmp_path, name="local"))
    for a, b in zip(metrics(tmp_path / "local"), metrics(tmp_path / "run")):
        same_training(a, b)


def test_reward_worker_error_names_the_function_and_episode(tmp_path, ray_local):
    """A reward function that raises on a worker ends the episode `reward_error` with the
    function's name and its own exception, as in the driver; nothing is trained on it."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?"}) + "\n" for i in range(8)))  # no `answer`
    cfg = config(tmp_path, "placement.mode=ray", "placement.colocate=true", "placement.reward_workers=1",
                 "placement.reward.num_cpus=0.25", f"task.dataset={data}", "task.reward=tidal.rewards.arithmetic:score",
                 "train.steps=1")
    ctl = Controller(cfg)
    try:
        episodes, *_ = ctl._sample(1)
    finally:
        ctl.close()
    assert {e.status.value for e in episodes} == {"reward_error"}
    assert "reward function `tidal.rewards.arithmetic:score` raised TypeError" in episodes[0].error
    assert "answer" in episodes[0].error and episodes[0].episode_id in episodes[0].error


def _kill_when_busy(router, i: int, pid: int, killed: threading.Event, stop: threading.Event) -> None:
    while not stop.is_set():
        if router.inflight[i] > 0:
            os.kill(pid, signal.SIGKILL)
            killed.set()
            return
        time.sleep(0.001)


@pytest.mark.slow  # ~27 s each here: with them the default suite neared its 10 minutes (CI runs them)
def test_engine_killed_mid_step_is_replaced_and_no_episode_is_lost(tmp_path, ray_local, caplog):
    cfg = config(tmp_path, "placement.mode=ray", "engine.replicas=2", "train.steps=3")
    ctl = Controller(cfg)
    try:
        ctl.train_step()
        pid = ctl.pusher.engine_handles[1].call("pid")
        killed, stop = threading.Event(), threading.Event()
        watcher = threading.Thread(target=_kill_when_busy, args=(ctl.engine, 1, pid, killed, stop), daemon=True)
        watcher.start()
        with caplog.at_level(logging.WARNING, logger="tidal"):
            m = ctl.train_step()  # replica1 dies with requests in flight
        stop.set()
        assert killed.is_set(), "the watcher never saw replica1 busy"
        assert m["episodes"] == 16 and m["episodes/ok"] + m["episodes/truncated"] == 16  # each episode exactly once
        assert m["engines/restarted"] == 1
        assert ctl.engine.resent > 0
        text = caplog.text
        assert "engine replica1 marked down" in text and "died during generate" in text
        assert "replaced by a new actor" in text and "is back with weights v2" in text
        assert all(ctl.engine.up) and ctl.pusher.engine_handles[1].call("pid") != pid
        before = list(ctl.engine.served)
        m3 = ctl.train_step()  # the new replica serves again
        assert m3["episodes"] == 16 and ctl.engine.served[1] > before[1]
        assert ctl.pusher.engine_handles[1].call("engine_version") == 3
    finally:
        ctl.close()


@pytest.mark.slow  # ~27 s each here: with them the default suite neared its 10 minutes (CI runs them)
def test_engine_dead_after_its_rollout_is_replaced_at_the_weight_sync(tmp_path, ray_local):
    """An engine that dies after returning its requests is caught by the liveness check
    before the sync (a dead member would stall the broadcast), replaced, and given the weights."""
    ctl = Controller(config(tmp_path, "placement.mode=ray", "engine.replicas=2", "train.steps=3"))
    try:
        sampled = ctl._produce(1)
        os.kill(ctl.pusher.engine_handles[0].call("pid"), signal.SIGKILL)
        m = ctl._learn(sampled)
        assert m["engines/restarted"] == 1 and m["episodes"] == 16
        assert all(ctl.engine.up) and [h.call("engine_version") for h in ctl.pusher.engine_handles] == [1, 1]
        assert "found dead before the weight sync of step 1" in ctl.pusher.events[-1]
        events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
        assert [(e["kind"], e["role"], e["step"]) for e in events] == [("restart", "engine replica0", 1)]
        assert ctl.train_step()["episodes"] == 16
    finally:
        ctl.close()


def test_dead_trainer_rank_stops_the_run_with_role_call_and_step(tmp_path, ray_local):
    cfg = config(tmp_path, "placement.mode=ray", "placement.colocate=true", "train.steps=4", "run.save_every=1")
    ctl = Controller(cfg)
    try:
        ctl.train_step()
        os.kill(ctl.trainer.ranks[0].call("pid"), signal.SIGKILL)
        with pytest.raises(RoleError, match=r"trainer rank 0 died during `\w+` at step 2"):
            ctl.train_step()
    finally:
        ctl.close()
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "controller.json").is_file()  # the checkpoint is intact


@pytest.mark.slow
@pytest.mark.parametrize("transport, colocate", [("broadcast", "false"), ("disk", "false"), ("inprocess", "true")])
def test_each_transport_brings_the_engines_to_the_trainers_weights(tmp_path, ray_local, transport, colocate):
    ctl = Controller(config(tmp_path, "placement.mode=ray", f"placement.weight_sync={transport}",
                            f"placement.colocate={colocate}"))
    try:
        assert ctl.pusher.describe == transport
        ctl.train()
        handle = ctl.pusher.engine_handles[0] if colocate == "false" else ctl.trainer.ranks[0]
        assert handle.call("engine_version") == 2 and ctl.engine.version == 2
    finally:
        ctl.close()
    for m in metrics(tmp_path / "run"):  # the engine sampled with the trainer's weights of the step before
        assert m["logprob_max_abs_diff"] < LOGPROB_TOL, m  # the engine contract's bound (LOGPROB_TOL says why)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_engine_actor_gets_weights_by_broadcast(tmp_path, ray_local):
    """vLLM in process inside an engine actor: weights arrive by checksummed broadcast and the
    engine's log-probs agree with the trainer's (the mismatch metrics of every step)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None and not os.environ.get("TIDAL_REQUIRE_VLLM"):
        pytest.skip("vLLM is not installed (`make setup-vllm`)")
    ctl = Controller(config(tmp_path, "placement.mode=ray", "engine.kind=vllm", "placement.weight_sync_checksum=true"))
    try:
        ctl.train()
        assert ctl.pusher.engine_handles[0].call("engine_version") == 2
    finally:
        ctl.close()
    for m in metrics(tmp_path / "run"):
        # vLLM vs the trainer: the engine contract's bound (tests/engine_checks.py LOGPROB_TOL, which says why)
        assert m["logprob_max_abs_diff"] < LOGPROB_TOL and m["episodes/engine_error"] == 0
