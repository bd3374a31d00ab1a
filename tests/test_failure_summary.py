"""Repeated failures are summarized: a reward that fails the same way on many episodes logs
its traceback once per step and distinct error (the others: a line each in train.log only),
and the step's warning counts the distinct errors. A flaky reward printed a traceback per
failed episode on the console before (137 in 6 steps)."""

from __future__ import annotations

import asyncio
import logging
import textwrap

import pytest

from tidal.config import RewardConfig, RewardSpec, TidalConfig
from tidal.rewards.contract import RewardInput
from tidal.rewards.pool import build_scorer
from tidal.runtime.health import Health
from tidal.types import Episode, Status

REWARDS = textwrap.dedent('''
    def flaky(completion, **kw):
        if completion == "down":
            raise ConnectionError("the grading service went away")
        if completion == "bad":
            return {"x": 1}["answer"]
        if completion.startswith("parse"):  # a message that names the episode's data: the same error
            raise ValueError(f"cannot parse {completion!r}")
        return 1.0
''')


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "flaky.py"
    path.write_text(REWARDS)
    return str(path)


def inputs(step: int, completions: list[str]) -> list[RewardInput]:
    pm = [{"role": "user", "content": "?"}]
    return [RewardInput(f"s{step}-e{i}", f"g{i}", "t0", step, "?", pm, c, [1], pm, [], {})
            for i, c in enumerate(completions)]


def tracebacks(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "Traceback" in r.getMessage()]


@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_a_traceback_per_distinct_error_and_step(rewards_file, caplog, isolation):
    scorer = build_scorer([RewardSpec(fn=f"{rewards_file}:flaky")], RewardConfig(isolation=isolation, workers=1))
    try:
        with caplog.at_level(logging.INFO, logger="tidal.rewards"):
            outs = asyncio.run(scorer.score(inputs(1, ["down"] * 20 + ["ok"])))
            assert [o.status for o in outs] == ["reward_error"] * 20 + ["ok"]
            assert len(tracebacks(caplog)) == 1  # not 20
            same = [r for r in caplog.records if "the same error as logged above" in r.getMessage()]
            assert len(same) == 19 and all(r.levelno == logging.INFO for r in same)  # train.log, not the console
            asyncio.run(scorer.score(inputs(1, ["down"] * 5 + ["bad"] * 5)))  # the same step: one more, for `bad`
            assert len(tracebacks(caplog)) == 2 and "KeyError" in tracebacks(caplog)[1]
            asyncio.run(scorer.score(inputs(2, ["down"] * 5)))  # the next step: its own, once
            assert len(tracebacks(caplog)) == 3
            asyncio.run(scorer.score(inputs(2, [f"parse {i}" for i in range(6)])))  # one error, 6 messages
            assert len(tracebacks(caplog)) == 4 and "cannot parse 'parse 0'" in tracebacks(caplog)[3]
    finally:
        asyncio.run(scorer.close())


def test_the_steps_warning_counts_the_distinct_errors(tmp_path, caplog):
    def ep(i: int, error: str, status: Status = Status.REWARD_ERROR) -> Episode:
        return Episode(f"s3-e{i}", "g", "t", "env", status=status, reward=float("nan"),
                       error=f"{error} on episode s3-e{i} (task t{i}) of step 3")

    down = "reward function `r.py:flaky` raised ConnectionError('the grading service went away')"
    bad = "reward function `r.py:flaky` raised KeyError('answer')"
    eps = [ep(i, down) for i in range(12)] + [ep(12 + i, bad) for i in range(3)]
    eps += [Episode(f"ok{i}", "g", "t", "env", reward=1.0) for i in range(45)]
    health = Health(TidalConfig(), tmp_path, lambda: None)
    with caplog.at_level(logging.WARNING, logger="tidal"):
        health.before_update(3, eps, {"episodes/failed_frac": 15 / 60}, lambda *a: None)
    (line,) = [r.getMessage() for r in caplog.records if "not trained on" in r.getMessage()]
    assert line == (f"step 3: 15 of 60 episodes ended reward_error (not trained on); first: {down} on episode s3-e0 "
                    f"(task t0) of step 3 (12 x that error; also 3 x {bad})")


INTERRUPTED = '''
import asyncio, gc, sys
from tidal.envs import loop_scoped

async def episode(i):
    try:
        await asyncio.sleep(0.01 if i == 7 else 100)
        if i == 7:
            raise KeyboardInterrupt()  # where the CLI's SIGINT handler raises: inside a task's code
    finally:
        await asyncio.sleep(0)  # an episode's cleanup awaits (closing its environment)

async def step():
    return await asyncio.gather(*(episode(i) for i in range(50)))

async def main():
    return await asyncio.gather(step())

try:
    loop_scoped.run(main())
except KeyboardInterrupt:
    print("tidal: stopped by an interrupt", file=sys.stderr)
gc.collect()
'''


def test_an_interrupt_inside_a_step_prints_only_the_stop_message(tmp_path):
    """Ctrl-C lands in an episode's task; the interrupt passes up through the step's gather.
    asyncio.run's shutdown stopped there and left the other episodes to be destroyed pending:
    a "Task was destroyed but it is pending!" pair of lines per episode (56 lines here, ~1000
    for a 256-episode step). Now: the stop message alone."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env, check=True)
    assert done.stderr.splitlines() == ["tidal: stopped by an interrupt"], done.stderr[:2000]
