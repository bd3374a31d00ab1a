"""Rewards that misbehave against the reward workers (tidal/rewards/pool.py, limits.py): a
reward that segfaults on 1 completion in 8 loses exactly those calls and no other (sync and
async rewards); a leaking reward's worker is recycled; a forking reward leaves no process
alive (same session after each call, a new session at the end); a reward that prints 100 MB
writes a bounded amount into the log and nothing into tidal's stdout. Each failed on main:
35 innocent episodes lost to 18 crashes, 811 MB in 96 calls, 192 children alive, 100 MB on
tidal's stdout."""

from __future__ import annotations

import asyncio
import logging
import os
import textwrap
import time

import pytest

from tidal.config import RewardConfig, RewardSpec
from tidal.rewards.contract import RewardInput
from tidal.rewards.pool import build_scorer
from tidal.sandbox import cgroup

REWARDS = textwrap.dedent('''
    import asyncio, ctypes, os, subprocess, sys, time

    def _crash():
        ctypes.string_at(0)  # SIGSEGV

    def crashy(completion):
        if int(completion) % 8 == 0:
            _crash()
        return 1.0

    async def acrashy(completion):
        await asyncio.sleep(0.01 * (int(completion) % 3))
        if int(completion) % 8 == 0:
            _crash()
        await asyncio.sleep(0.01)
        return 1.0

    _kept = []

    def leaky(completion):
        _kept.append(bytearray(os.urandom(1 << 10)) * (16 << 10))  # 16 MiB, touched, kept
        return 1.0

    def forky(completion, pidfile):
        same = subprocess.Popen(["sleep", "300"])
        other = subprocess.Popen(["sleep", "300"], start_new_session=True)
        with open(pidfile, "a") as f:
            f.write(f"{same.pid} {other.pid}\\n")
        return 1.0

    def hog(completion, mode):
        if mode == "memory":
            kept = b"x" * (1 << 30)  # 1 GiB, every page written
            return float(len(kept))
        if mode == "fork":
            procs = []
            try:
                for _ in range(200):
                    procs.append(subprocess.Popen(["sleep", "30"]))
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
        return 1.0

    def orphaning(completion):  # leaves an exited orphan in a session of its own
        from tidal.rewards.limits import zombies

        before = zombies()
        subprocess.run(["sh", "-c", "setsid -f sh -c 'exit 0'"], check=True)
        # Return once the orphan is this worker's zombie: the sweep after a call ends what is
        # still in the worker's process group, and an orphan slower to reach its setsid than
        # the sweep would be ended there instead (the test would then see no orphan pile up).
        deadline = time.monotonic() + 5
        while zombies() <= before and time.monotonic() < deadline:
            time.sleep(0.002)
        return 1.0

    def chatty(completion):
        line = "x" * 1023 + "\\n"
        for _ in range(1024 * 100 // 4):  # 25 MB a call, 100 MB over the 4 calls
            (sys.stdout if _ % 2 else sys.stderr).write(line)
        return 1.0
''')


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("faulty") / "faulty.py"
    path.write_text(REWARDS)
    return str(path)


def inputs(n: int, **columns) -> list[RewardInput]:
    pm = [{"role": "user", "content": "What?"}]
    return [RewardInput(f"e{i}", f"g{i // 8}", "t0", 3, "<prompt>", pm, str(i), [1, 2], pm, [], dict(columns))
            for i in range(n)]


def score(scorer, batch):
    return asyncio.run(scorer.score(batch))


@pytest.mark.parametrize("fn", ["crashy", "acrashy"])
def test_a_reward_that_segfaults_loses_only_its_own_calls(rewards_file, fn):
    scorer = build_scorer([RewardSpec(fn=f"{rewards_file}:{fn}")], RewardConfig(timeout_s=20, workers=2))
    try:
        t0 = time.monotonic()
        outs = score(scorer, inputs(64))
        elapsed = time.monotonic() - t0
        guilty = [i for i in range(64) if i % 8 == 0]
        assert [i for i, o in enumerate(outs) if o.status != "ok"] == guilty, [o.error for o in outs if o.error]
        for i in guilty:
            assert outs[i].status == "reward_error"
            assert "killed by SIGSEGV" in outs[i].error and "the crash was this call's" in outs[i].error
            assert f"episode e{i} " in outs[i].error
        assert scorer.crashes == len(guilty)
        # A second batch through the replaced workers, the same answer.
        assert [o.status == "ok" for o in score(scorer, inputs(16))] == [i % 8 != 0 for i in range(16)]
        print(f"\n{fn}: 64 calls, {len(guilty)} crashes, {elapsed:.2f} s")  # reported, not asserted
    finally:
        scorer.shutdown()


def test_a_leaking_reward_is_recycled_before_it_grows_past_its_bound(rewards_file):
    cfg = RewardConfig(timeout_s=20, workers=1, worker_max_rss_mb=200)
    scorer = build_scorer([RewardSpec(fn=f"{rewards_file}:leaky")], cfg)
    try:
        first = scorer.pids()
        for _ in range(6):
            outs = score(scorer, inputs(8))  # 128 MiB a batch
            assert all(o.status == "ok" for o in outs), [o.error for o in outs]
        assert scorer.recycled >= 3  # 768 MiB leaked in all, 200 MiB allowed a worker
        pool = scorer._pool
        # Each worker's resident memory stayed within the bound plus one batch's leak (the
        # check follows each answer; a batch of 8 is answered together): 200 + 128 MiB.
        assert all(s.rss <= (200 + 128 + 64) << 20 for s in pool.slots), [s.rss >> 20 for s in pool.slots]
        assert scorer.pids() != first
    finally:
        scorer.shutdown()


def test_exited_orphans_do_not_pile_up_in_a_worker(rewards_file):
    """The worker is the subreaper of what rewards start: orphans that exit stay its zombies
    (it does not reap what a reward's own Popen may wait for), so past MAX_ZOMBIES it is recycled."""
    from tidal.rewards.pool_base import MAX_ZOMBIES

    scorer = build_scorer([RewardSpec(fn=f"{rewards_file}:orphaning")], RewardConfig(timeout_s=20, workers=1))
    try:
        for _ in range(4 * MAX_ZOMBIES // 8):  # an orphan a call; some exit after the count that follows the call
            assert all(o.status == "ok" for o in score(scorer, inputs(8)))
            if scorer.recycled:
                break
        assert scorer.recycled >= 1
        assert all(s.zombies <= MAX_ZOMBIES + 8 for s in scorer._pool.slots)
    finally:
        scorer.shutdown()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_forking_reward_leaves_no_process_alive(rewards_file, tmp_path):
    pidfile = tmp_path / "pids"
    scorer = build_scorer([RewardSpec(fn=f"{rewards_file}:forky")], RewardConfig(timeout_s=20, workers=2))
    try:
        for _ in range(3):
            outs = score(scorer, inputs(8, pidfile=str(pidfile)))
            assert all(o.status == "ok" for o in outs), [o.error for o in outs]
        pairs = [tuple(map(int, line.split())) for line in pidfile.read_text().splitlines()]
        assert len(pairs) == 24
        deadline = time.monotonic() + 5
        while any(_alive(same) for same, _ in pairs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [same for same, _ in pairs if _alive(same)]  # ended with the call that started it
    finally:
        scorer.shutdown()
    # The children in sessions of their own are ended with the worker (its cgroup; where there
    # is none, the worker kills its descendants as it ends).
    deadline = time.monotonic() + 5
    while any(_alive(other) for _, other in pairs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [other for _, other in pairs if _alive(other)]


def test_a_printing_reward_is_logged_bounded_and_never_on_our_stdout(rewards_file, capfd, caplog):
    budget = 64 << 10
    cfg = RewardConfig(timeout_s=20, workers=1, worker_log_bytes=budget)
    caplog.set_level(logging.INFO, logger="tidal.rewards.output")
    scorer = build_scorer([RewardSpec(fn=f"{rewards_file}:chatty")], cfg)
    try:
        outs = score(scorer, inputs(4))
        assert all(o.status == "ok" for o in outs), [o.error for o in outs]
    finally:
        scorer.shutdown()
    out, err = capfd.readouterr()
    assert "xxxx" not in out and "xxxx" not in err  # nothing of it on the driver's stdout or stderr
    lines = [r.getMessage() for r in caplog.records if r.name == "tidal.rewards.output"]
    logged = [m for m in lines if m.endswith("x" * 100)]
    assert logged, "nothing of the reward's output reached the log"
    assert sum(len(m) for m in logged) <= budget + len(logged) * 64  # the budget, plus each line's prefix
    assert any("more bytes of output were dropped" in m for m in lines)
    print(f"\nlogged {len(logged)} lines of the reward's output; {os.getpid()} printed nothing")


NO_CGROUP = cgroup.detect()[1]


@pytest.mark.skipif(bool(NO_CGROUP), reason=f"no cgroup can be made here: {NO_CGROUP}")
def test_memory_and_process_limits_bound_a_worker_and_name_the_limit(rewards_file):
    cfg = RewardConfig(timeout_s=20, workers=1, worker_memory_mb=256, worker_max_processes=48)
    scorer = build_scorer([RewardSpec(fn=f"{rewards_file}:hog")], cfg)
    try:
        (out,) = score(scorer, inputs(1, mode="memory"))
        assert out.status == "reward_error"
        assert "its memory limit (reward.worker_memory_mb=256) was reached" in out.error, out.error
        (out,) = score(scorer, inputs(1, mode="fork"))  # 200 processes where 48 are allowed: its forks fail
        assert out.status == "reward_error" and "BlockingIOError" in out.error, out.error
        assert [o.status for o in score(scorer, inputs(2, mode="ok"))] == ["ok", "ok"]
    finally:
        scorer.shutdown()


# -- Ray reward actors: each runs its rewards in a worker process of its own ---------------------
@pytest.fixture(scope="module")
def ray_local():
    import ray

    from tidal.runtime.placement import keep_on_loopback

    keep_on_loopback()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(_node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


def _ray_scorer(fn: str, cfg: RewardConfig, n: int = 2):
    import ray

    from tidal.runtime.workers import RewardActors, RewardWorker

    cls = ray.remote(RewardWorker).options(num_cpus=0, max_concurrency=64)
    actors = RewardActors(n, lambda i, specs, timeout_s: cls.remote(specs, timeout_s,
                                                                    reward_cfg=cfg.model_dump(mode="json")))
    return build_scorer([RewardSpec(fn=fn)], cfg, ray_handles=actors), actors


@pytest.mark.slow  # Ray's start and two actors (~30 s here)
def test_ray_reward_actors_lose_only_the_crashing_calls_and_keep_output_off_stdout(rewards_file, ray_local,
                                                                                   tmp_path, capfd, caplog):
    caplog.set_level(logging.INFO, logger="tidal.rewards.output")
    scorer, actors = _ray_scorer(f"{rewards_file}:crashy", RewardConfig(timeout_s=20))
    try:
        first = dict(actors.live)
        t0 = time.monotonic()
        outs = score(scorer, inputs(64))
        elapsed = time.monotonic() - t0
        assert [i for i, o in enumerate(outs) if o.status != "ok"] == [i for i in range(64) if i % 8 == 0]
        assert all("killed by SIGSEGV" in o.error and "the crash was this call's" in o.error
                   for o in outs if o.status != "ok")
        assert actors.live == first  # the actors stayed; their worker processes were replaced
        print(f"\nRay actors: 64 calls, 8 crashes, {elapsed:.2f} s")  # reported, not asserted
    finally:
        scorer.shutdown()
    budget = 64 << 10
    scorer, _ = _ray_scorer(f"{rewards_file}:chatty", RewardConfig(timeout_s=20, worker_log_bytes=budget), n=1)
    try:
        assert all(o.status == "ok" for o in score(scorer, inputs(4)))
    finally:
        scorer.shutdown()
    time.sleep(1.0)  # Ray's log monitor would have printed the actor's output by now
    out, err = capfd.readouterr()
    assert "xxxx" not in out and "xxxx" not in err
    logged = [r.getMessage() for r in caplog.records if r.name == "tidal.rewards.output"]
    assert any(m.endswith("x" * 100) for m in logged)  # carried back with the answers into the driver's log
    assert sum(len(m) for m in logged) <= budget + len(logged) * 96
