"""Rewards run concurrently and each step is bounded: hung synchronous calls time out
together, not one after another (sync lanes, reward.sync_concurrency), and a step whose
rewards fail past reward.failure_budget stops waiting for the rest (tidal/rewards/step_budget.py).
Real worker processes; the GIL-holding and crashing cases keep their exact charging with
several lanes running."""

from __future__ import annotations

import asyncio
import json
import textwrap
import time

import pytest

from tidal.config import RewardConfig, RewardSpec, load_config
from tidal.rewards.contract import RewardInput
from tidal.rewards.pool import build_scorer
from tidal.runtime.controller import Controller, RunFailed

TIMEOUT_S = 1.0
# Slack over the bound for the workers' replacement start-up and a loaded 2-core machine
# (other test sessions share it); far below the one timeout more a serial pool would take.
SLACK_S = 1.0

REWARDS = textwrap.dedent('''
    import os, re, time

    def behave(completion, mode):
        if mode == "hang":
            time.sleep(1000)
        if mode == "gil":  # catastrophic backtracking: C code that never lets go of the GIL
            re.match(r"(a+)+b", "a" * 64)
        if mode == "exit":
            os._exit(3)
        if mode == "slow":
            time.sleep(0.2)
        return 1.0

    def always_hangs(completion, **kw):
        time.sleep(1000)
''')


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "hanging.py"
    path.write_text(REWARDS)
    return str(path)


def make_input(i: int, mode: str) -> RewardInput:
    pm = [{"role": "user", "content": "What?"}]
    return RewardInput(f"e{i}", f"g{i // 8}", "t0", 1, "<prompt>", pm, "c", [1, 2], pm, [], {"mode": mode})


def score(rewards_file, modes: list[str], within: float | None = None, **cfg) -> tuple[list | None, float, object]:
    """The outcomes, the seconds they took and the scorer; outcomes None when not all came `within`."""
    scorer = build_scorer([RewardSpec(fn=f"{rewards_file}:behave")], RewardConfig(timeout_s=TIMEOUT_S, **cfg))
    try:
        t0 = time.monotonic()
        try:
            outs = asyncio.run(asyncio.wait_for(scorer.score([make_input(i, m) for i, m in enumerate(modes)]), within))
        except TimeoutError:
            outs = None
        return outs, time.monotonic() - t0, scorer
    finally:
        scorer.shutdown()


def test_a_step_with_ten_percent_hanging_rewards_takes_at_most_two_timeouts(rewards_file):
    """64 episodes (8 prompts x 8 samples, the issue's step), every tenth reward hangs: the
    step takes at most ~2 x reward.timeout_s at the default concurrency. Positive control:
    one synchronous call at a time per worker (main's pool) takes one timeout per hang per
    worker (4 here, and a restart each): it misses the bound."""
    modes = ["hang" if i % 10 == 0 else "ok" for i in range(64)]  # 7 hangs
    bound = 2 * TIMEOUT_S + SLACK_S
    outs, elapsed, _ = score(rewards_file, modes, workers=2)
    assert outs is not None and [o.status for o in outs] == ["timeout" if m == "hang" else "ok" for m in modes]
    assert elapsed < bound, elapsed
    serial, _, _ = score(rewards_file, modes, within=bound, workers=2, sync_concurrency=1)
    assert serial is None  # not done within the bound


def test_many_lanes_keep_healthy_calls_flowing_past_a_hang(rewards_file):
    """One worker, 4 lanes: the slow calls run 4 at a time, and a hang strands none of them."""
    modes = ["hang"] + ["slow"] * 16
    outs, elapsed, scorer = score(rewards_file, modes, workers=1, sync_concurrency=4)
    assert [o.status for o in outs] == ["timeout"] + ["ok"] * 16
    assert elapsed < TIMEOUT_S + SLACK_S + 16 * 0.2 / 3  # 16 x 0.2 s over the 3 free lanes, beside the hang
    assert scorer.restarts == 1  # the hung worker retired (killed once its other calls were answered)


def test_a_gil_hang_beside_other_lanes_charges_only_itself(rewards_file):
    """The worker cannot answer while one lane holds the GIL, so the driver's deadline cannot
    tell the hog from the calls it froze: each runs again alone, and only the hog ends timeout."""
    modes = ["gil"] + ["slow"] * 3
    outs, elapsed, _ = score(rewards_file, modes, workers=1, sync_concurrency=4)
    assert [o.status for o in outs] == ["timeout", "ok", "ok", "ok"], [o.error for o in outs]
    # The hog holds the worker to the driver's deadline twice (first among the others, then
    # alone), the 3 suspects rerun alone one after another (0.2 s each), and 2 replacements
    # start (up to 2 s each on this loaded machine).
    assert elapsed < 2 * (TIMEOUT_S + 0.5) + 3 * 0.2 + 4 * SLACK_S, elapsed


def test_a_crash_beside_other_lanes_is_charged_to_its_call_alone(rewards_file):
    modes = ["slow", "exit", "slow", "slow"]
    outs, _, scorer = score(rewards_file, modes, workers=1, sync_concurrency=4)
    assert [o.status for o in outs] == ["ok", "reward_error", "ok", "ok"]
    assert "the crash was this call's" in outs[1].error and scorer.crashes == 1


@pytest.mark.slow  # a whole training step of the tiny model, with its hung workers' replacements: ~15 s here
def test_a_step_whose_rewards_fail_past_the_budget_stops_waiting(rewards_file, tiny_model_dir, tmp_path, caplog):
    """An always-hanging reward, 16 episodes, 2 workers of 2 sync lanes: waiting out every
    episode takes 4 waves of 4 hung calls; with reward.failure_budget=0.2 the step gives up
    once more than 3 have failed (after the first wave), its other episodes end reward_error
    saying why, and the run stops."""
    timeout_s = 2.0  # long beside generation and a worker's start, which a loaded machine stretches
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}", "train.steps=3",
                             "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=4",
                             "run.eval_every=0", "run.progress=false", "run.save_every=0",
                             f"task.reward={rewards_file}:always_hangs", f"reward.timeout_s={timeout_s}",
                             "reward.workers=2", "reward.sync_concurrency=2", "reward.failure_budget=0.2",
                             "reward.failure_steps=1"])
    ctl = Controller(cfg)
    try:
        t0 = time.monotonic()
        with pytest.raises(RunFailed, match=r"stopping at step 1: 100% of this step's episodes failed"):
            ctl.train_step()
        elapsed = time.monotonic() - t0
    finally:
        ctl.close()
    rows = [json.loads(line) for line in (ctl.paths.root / "metrics.jsonl").read_text().splitlines()]
    assert (rows[0]["episodes/timeout"], rows[0]["episodes/reward_error"]) == (4, 12)  # 4 > 0.2 x 16, then no wait
    # Not waiting is what the counts show (waited out, all 16 end timeout); the time is logged
    # and not asserted: on this shared machine generation alone ranged from 2 s to 10 s.
    print(f"the step stopped after {elapsed:.1f} s; waiting out 4 waves takes {4 * timeout_s:g} s at the least")
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "12 of 16 episodes ended reward_error (not trained on); first: not scored: 4 of the step's 16 episodes " \
           "had failed, over reward.failure_budget=0.2" in said
