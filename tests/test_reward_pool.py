"""The reward pools: user reward code in worker processes (and Ray actors) whose hung calls
are killed. The failure taxonomy end to end: raise, hang (sync, sync holding the GIL, async,
async blocking its loop), a subprocess of a hung reward, wrong type, NaN, None, a worker that
exits; calls lost with a killed worker are sent again; start-up fails fast naming the key;
close stops every worker. Worker start-up is the cost here, so the pools are shared per
module where a test does not need a fresh one (each test repairs what it breaks)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

from tidal.config import RewardConfig, RewardSpec
from tidal.rewards.contract import RewardInput
from tidal.rewards.pool import InlineScorer, ProcessScorer, RewardLoadError, build_scorer
from tidal.rewards.pool_base import GRACE_S

TIMEOUT_S = 1.0
# The brief's bound: a hung call ends within reward.timeout_s plus 2 s. The pool answers by
# timeout_s (the worker's own watchdog) or timeout_s + GRACE_S (the driver's deadline, when
# the hang holds the GIL); the rest of the 2 s is for a loaded machine.
MARGIN_S = 2.0

REWARDS = textwrap.dedent('''
    import asyncio, os, re, subprocess, time

    def behave(completion, mode, pidfile=None):
        if mode == "raise":
            return {"x": 1}["answer"]
        if mode == "hang":
            time.sleep(1000)
        if mode == "gil":  # catastrophic backtracking: C code that never lets go of the GIL
            re.match(r"(a+)+b", "a" * 64)
        if mode == "str":
            return "abc"
        if mode == "nan":
            return float("nan")
        if mode == "none":
            return None
        if mode == "exit":
            os._exit(3)
        if mode == "child":
            p = subprocess.Popen(["sleep", "1000"])
            with open(pidfile, "w") as f:
                f.write(str(p.pid))
            time.sleep(1000)
        if mode == "pid":
            return float(os.getpid())
        return {"correct": 1.0, "format": 0.1}

    async def abehave(completion, mode):
        if mode == "hang":
            await asyncio.sleep(1000)
        if mode == "block":  # blocks the worker's event loop
            time.sleep(1000)
        if mode == "raise":
            raise ValueError("bad")
        if mode == "pid":
            return float(os.getpid())
        await asyncio.sleep(0.05)
        return 1.0

    def group_len(prompts, completions, **kw):  # text prompts: TRL's completions are strings
        return [float(len(c)) for c in completions]
''')


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "behaving.py"
    path.write_text(REWARDS)
    return str(path)


@pytest.fixture(scope="module")
def sync_pool(rewards_file):
    scorer = build_scorer([RewardSpec(fn=f"{rewards_file}:behave")], RewardConfig(timeout_s=TIMEOUT_S, workers=2))
    assert isinstance(scorer, ProcessScorer)
    yield scorer
    scorer.shutdown()


@pytest.fixture(scope="module")
def async_pool(rewards_file):
    scorer = build_scorer([RewardSpec(fn=f"{rewards_file}:abehave")], RewardConfig(timeout_s=TIMEOUT_S, workers=1))
    yield scorer
    scorer.shutdown()


def make_input(i: int, mode: str, completion: str = "c", **columns) -> RewardInput:
    pm = [{"role": "user", "content": "What?"}]
    return RewardInput(f"e{i}", "g0", "t0", 5, "<prompt>", pm, completion, [1, 2], pm, [], {"mode": mode, **columns})


def run(scorer, modes: list[str], **columns):
    t0 = time.monotonic()
    outs = asyncio.run(scorer.score([make_input(i, m, **columns) for i, m in enumerate(modes)]))
    return outs, time.monotonic() - t0


def ready(scorer, n: int, within: float = 30.0) -> set[int]:
    """The pids of `n` ready workers (a replacement may still be starting)."""
    deadline = time.monotonic() + within
    while len(pids := scorer.pids()) < n:
        assert time.monotonic() < deadline, f"only {len(pids)} of {n} reward workers ready after {within:g} s"
        time.sleep(0.02)
    return set(pids)


def gone(pid: int, within: float = 5.0) -> bool:
    """The process no longer runs (reaped, or a zombie waiting for its reaper)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between open and read
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


# -- typed outcomes ----------------------------------------------------------------------------
def test_typed_failures_in_workers_match_inline(sync_pool, rewards_file, caplog):
    modes = ["ok", "raise", "str", "nan", "none", "ok"]
    before = ready(sync_pool, 2)
    with caplog.at_level(logging.WARNING, logger="tidal.rewards"):
        outs, _ = run(sync_pool, modes)
    assert [o.status for o in outs] == ["ok", "reward_error", "reward_error", "reward_error", "reward_error", "ok"]
    name = f"reward function `{rewards_file}:behave`"
    assert outs[1].error == f"{name} raised KeyError('answer') on episode e1 (task t0) of step 5"
    assert outs[2].error == (f"{name} returned a str ('abc'), expected a float or a dict of floats "
                             f"on episode e2 (task t0) of step 5")
    assert outs[3].error == f"{name} returned a non-finite reward nan on episode e3 (task t0) of step 5"
    # plain pytest.approx in this file (rel 1e-6): hand values (0.1, 1/3, 18/5) against a few float
    # operations on them, which round alike on every CPU; the margin is decimal representation only
    assert outs[0].parts == {"correct": 1.0, "format": 0.1} and outs[0].reward == pytest.approx(1.1)
    # The traceback from inside the worker process reaches the driver's log.
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert outs[1].error in logged and 'return {"x": 1}["answer"]' in logged
    inline = InlineScorer([{"fn": f"{rewards_file}:behave", "form": "tidal", "weight": 1.0, "name": None, "args": {},
                            "key": "task.reward"}], RewardConfig(isolation="inline"))
    same = asyncio.run(inline.score([make_input(i, m) for i, m in enumerate(modes)]))
    assert [(o.status, o.error, o.parts) for o in same] == [(o.status, o.error, o.parts) for o in outs]
    assert set(sync_pool.pids()) == before  # an error is an answer: no worker was harmed


def test_calls_run_in_the_workers_spread_over_both(sync_pool):
    pids = ready(sync_pool, 2)
    outs, _ = run(sync_pool, ["pid"] * 64)
    seen = {int(o.reward) for o in outs}
    assert seen == pids and os.getpid() not in seen


# -- hangs -------------------------------------------------------------------------------------
def test_sync_hang_is_killed_within_timeout_and_no_call_is_lost(sync_pool, rewards_file):
    before = ready(sync_pool, 2)
    restarts = sync_pool.restarts
    outs, elapsed = run(sync_pool, ["hang"] + ["ok"] * 40)
    assert elapsed < TIMEOUT_S + MARGIN_S
    assert outs[0].status == "timeout"
    assert outs[0].error.startswith(f"reward function `{rewards_file}:behave` did not return within "
                                    f"reward.timeout_s=1s on episode e0 (task t0) of step 5")
    assert [o.status for o in outs[1:]] == ["ok"] * 40  # the calls queued behind it were sent again
    assert sync_pool.restarts == restarts + 1
    after = ready(sync_pool, 2)
    (killed,) = before - after
    assert gone(killed)


def test_hang_holding_the_gil_is_killed_by_the_drivers_deadline(sync_pool):
    before = ready(sync_pool, 2)
    outs, elapsed = run(sync_pool, ["gil", "ok"])
    assert TIMEOUT_S + GRACE_S * 0.9 < elapsed < TIMEOUT_S + MARGIN_S  # the worker could not answer for itself
    assert [o.status for o in outs] == ["timeout", "ok"]
    assert "did not answer by its deadline and was killed" in outs[0].error
    (killed,) = before - ready(sync_pool, 2)
    assert gone(killed)


def test_a_hung_rewards_subprocess_dies_with_its_worker(sync_pool, tmp_path):
    ready(sync_pool, 2)
    pidfile = tmp_path / "child.pid"
    outs, elapsed = run(sync_pool, ["child"], pidfile=str(pidfile))
    assert outs[0].status == "timeout" and elapsed < TIMEOUT_S + MARGIN_S
    assert gone(int(pidfile.read_text()))  # SIGKILL went to the worker's whole process group


def test_async_hang_is_cancelled_in_the_worker_without_a_kill(async_pool, rewards_file):
    (pid,) = ready(async_pool, 1)
    outs, elapsed = run(async_pool, ["hang", "ok", "raise", "ok"])
    assert elapsed < TIMEOUT_S + MARGIN_S
    assert [o.status for o in outs] == ["timeout", "ok", "reward_error", "ok"]
    assert outs[0].error == (f"reward function `{rewards_file}:abehave` did not return within reward.timeout_s=1s "
                             f"on episode e0 (task t0) of step 5")
    assert outs[2].error.startswith(f"reward function `{rewards_file}:abehave` raised ValueError('bad')")
    assert async_pool.pids() == [pid]  # cancelled in its event loop: the worker lives on


def test_async_calls_overlap_in_one_worker(async_pool):
    ready(async_pool, 1)
    outs, elapsed = run(async_pool, ["ok"] * 40)  # each sleeps 0.05 s
    assert [o.status for o in outs] == ["ok"] * 40
    assert elapsed < 40 * 0.05 / 2  # one after another would take 2 s; concurrently about 0.05 s


def test_async_reward_that_blocks_its_loop_is_killed(async_pool):
    (pid,) = ready(async_pool, 1)
    outs, elapsed = run(async_pool, ["block", "ok"])
    assert elapsed < TIMEOUT_S + MARGIN_S + 3.0  # + the replacement's start-up: the `ok` call waits for it
    assert [o.status for o in outs] == ["timeout", "ok"]
    assert gone(pid) and ready(async_pool, 1) != {pid}


# -- deaths, start-up and close ----------------------------------------------------------------
def test_worker_that_exits_is_replaced_and_its_call_retried_once(sync_pool, rewards_file):
    ready(sync_pool, 2)
    restarts = sync_pool.restarts
    outs, _ = run(sync_pool, ["exit", "ok", "ok", "ok"])
    assert [o.status for o in outs] == ["reward_error", "ok", "ok", "ok"]
    assert outs[0].error == (f"reward function `{rewards_file}:behave` could not be scored on episode e0 (task t0) "
                             f"of step 5: its reward worker died (exit code 3) while running it, also on its retry")
    assert sync_pool.restarts == restarts + 2  # once for the first run, once for the retry
    ready(sync_pool, 2)
    assert [o.status for o in run(sync_pool, ["ok"] * 4)[0]] == ["ok"] * 4


def test_a_worker_killed_from_outside_is_replaced_and_no_call_is_lost(sync_pool, rewards_file):
    """kill -9 of a reward worker (the OOM killer, an operator): the next calls it would have
    taken go to the others or to its replacement; every one is answered."""
    victim = min(ready(sync_pool, 2))
    restarts = sync_pool.restarts
    os.kill(victim, signal.SIGKILL)
    assert gone(victim)
    outs, _ = run(sync_pool, ["ok"] * 6)
    assert [o.status for o in outs] == ["ok"] * 6 and all(o.reward == 1.1 for o in outs)
    assert victim not in ready(sync_pool, 2) and sync_pool.restarts == restarts + 1


def test_a_reward_that_cannot_be_imported_fails_the_start_naming_its_key(rewards_file):
    t0 = time.monotonic()
    with pytest.raises(RewardLoadError, match=r"`task.rewards\[1\].fn`: cannot import module `tidal.nope` of "
                                              r"`tidal.nope:score`"):
        build_scorer([RewardSpec(fn=f"{rewards_file}:behave"), RewardSpec(fn="tidal.nope:score")],
                     RewardConfig(workers=1))
    assert time.monotonic() - t0 < 30  # at once, not after the start timeout


def test_close_stops_every_worker_and_later_calls_are_typed(rewards_file):
    scorer = build_scorer([RewardSpec(fn=f"{rewards_file}:behave")], RewardConfig(timeout_s=TIMEOUT_S, workers=2))
    pids = ready(scorer, 2)
    asyncio.run(scorer.close())
    assert all(gone(p) for p in pids)
    outs, elapsed = run(scorer, ["ok"])
    assert outs[0].status == "reward_error" and "the reward scorer was closed" in outs[0].error and elapsed < 1


# -- forms and combination through the pool ----------------------------------------------------
def test_per_sample_and_batched_rewards_combine_in_workers(rewards_file):
    specs = [RewardSpec(fn="tidal.rewards.arithmetic:score", weight=0.5),
             RewardSpec(fn=f"{rewards_file}:group_len", form="trl", weight=0.1, name="len")]
    scorer = build_scorer(specs, RewardConfig(timeout_s=10, workers=2),
                          keys=["task.rewards[0].fn", "task.rewards[1].fn"])
    try:
        assert scorer.per_group
        group = [make_input(i, "", completion=c, answer="12")
                 for i, c in enumerate(["<answer>12</answer>", "<answer>3</answer>"])]
        outs = asyncio.run(scorer.score(group))
    finally:
        scorer.shutdown()
    assert [o.status for o in outs] == ["ok", "ok"]
    assert outs[0].parts == pytest.approx({"score/correct": 0.5, "score/format": 0.05, "len": 1.9})
    assert outs[1].parts == pytest.approx({"score/correct": 0.0, "score/format": 0.05, "len": 1.8})
    assert [o.reward for o in outs] == [sum(o.parts.values()) for o in outs]


# -- Ray reward actors -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_local():
    import ray

    from tidal.runtime.placement import keep_on_loopback

    keep_on_loopback()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(_node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


@pytest.mark.slow  # Ray's start-up and an actor's (it imports torch) take 10-30 s here; the fast suite
# drives the same pool through reward actors in tests/test_placement.py
def test_ray_actors_type_failures_and_replace_a_hung_actor(rewards_file, ray_local):
    import ray

    from tidal.runtime.workers import RewardActors, RewardWorker

    cls = ray.remote(RewardWorker).options(num_cpus=0, max_concurrency=64)
    actors = RewardActors(1, lambda i, specs, timeout_s: cls.remote(specs, timeout_s))
    scorer = build_scorer([RewardSpec(fn=f"{rewards_file}:behave")], RewardConfig(timeout_s=TIMEOUT_S),
                          ray_handles=actors)
    try:
        (pid,) = ready(scorer, 1)
        outs, _ = run(scorer, ["ok", "raise", "nan", "pid"])
        assert [o.status for o in outs] == ["ok", "reward_error", "reward_error", "ok"]
        assert outs[1].error == (f"reward function `{rewards_file}:behave` raised KeyError('answer') "
                                 f"on episode e1 (task t0) of step 5")
        assert int(outs[3].reward) == pid != os.getpid()
        first = actors.live[0]
        outs, elapsed = run(scorer, ["hang"])
        assert outs[0].status == "timeout" and elapsed < TIMEOUT_S + MARGIN_S
        assert actors.live[0] is not first  # killed, and a new actor put in its slot
        assert gone(pid)
        (new_pid,) = ready(scorer, 1, within=120)
        assert new_pid != pid
        assert run(scorer, ["ok"])[0][0].status == "ok"
        with pytest.raises(RewardLoadError, match=r"`task.reward`: cannot import module `tidal.nope`"):
            build_scorer([RewardSpec(fn="tidal.nope:score")], RewardConfig(), ray_handles=RewardActors(
                1, lambda i, specs, timeout_s: cls.remote(specs, timeout_s)))
    finally:
        scorer.shutdown()
