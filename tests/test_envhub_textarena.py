"""TextArena games through tidal (tidal/envs/adapters/textarena.py): a single-player game played
as TextArena's docs show (reset, observe, step, close), its reward from close(), episodes isolated
from each other's use of the global `random`, and a run through the rollout."""

from __future__ import annotations

import asyncio
import random

import pyarrow.parquet as pq
import pytest

from tidal.config import TaskConfig, load_config
from tidal.envs.base import Action
from tidal.runtime.tasks import build_task

pytest.importorskip("textarena")
GAME = "textarena:GuessTheNumber-v0"


async def _binary_search(env, disturb=None):
    """Play by halving the range on the game's hints; `await disturb()` runs between turns."""
    observations = [(await env.reset())[0]["content"]]
    lo, hi = 1, 20
    for i in range(10):
        guess = (lo + hi) // 2
        if disturb:
            await disturb()
        res = await env.step(Action(f"My guess: [{guess}]", turn=i))
        if res.done:
            return res, observations
        hint = res.messages[0]["content"]
        observations.append(hint)
        lo, hi = (guess + 1, hi) if "higher" in hint else (lo, guess - 1) if "lower" in hint else (lo, hi)
    raise AssertionError("binary search over 1..20 ends within 10 guesses")


def test_a_scripted_player_wins_and_the_reward_comes_from_close():
    t = build_task(TaskConfig(env=GAME, train_size=6, eval_size=3))
    assert t.name == GAME and not t.rewards  # the game's reward is the whole reward
    assert not {r["game_seed"] for r in t.train_rows} & {r["game_seed"] for r in t.eval_rows}
    for row in t.train_rows[:3]:
        res, observations = asyncio.run(_binary_search(t.make_env(row)))
        assert "Guess The Number" in observations[0] and res.reward_parts == {"game": 1.0} and res.reward == 1.0
        assert res.metrics["textarena/finished"] == 1.0 and res.metrics["textarena/invalid_move"] == 0.0
    env = t.make_env(t.train_rows[0])

    async def invalid():
        await env.reset()
        warned = await env.step(Action("[99]"))  # out of range: the game warns once, then ends it
        return warned, await env.step(Action("[99]", turn=1))

    warned, res = asyncio.run(invalid())
    assert not warned.done and "invalid move" in warned.messages[0]["content"]
    assert res.done and res.metrics["textarena/invalid_move"] == 1.0 and res.reward < 1.0


def test_episodes_are_isolated_from_the_global_random():
    t = build_task(TaskConfig(env=GAME, train_size=2, eval_size=1))
    alone = asyncio.run(_binary_search(t.make_env(t.train_rows[0])))[1]
    # Another game (another seed) reset between every turn, and the caller's own use of random:
    other = t.make_env(t.train_rows[1])
    async def disturb():
        await other.reset()
        random.random()

    disturbed = asyncio.run(_binary_search(t.make_env(t.train_rows[0]), disturb=disturb))[1]
    assert disturbed == alone
    # The caller's own random: TextArena's reset seeds the global one (the control), the adapter's does not.
    import textarena

    random.seed(0)
    state = random.getstate()
    textarena.make("GuessTheNumber-v0").reset(num_players=1, seed=8)
    assert random.getstate() != state
    random.seed(0)
    asyncio.run(other.reset())
    assert random.getstate() == state


@pytest.mark.slow
def test_two_steps_through_the_rollout(tmp_path):
    from tidal.models import DEFAULT_MODEL_DIR
    from tidal.runtime.controller import Controller

    cfg = load_config(None, [f"model.path={DEFAULT_MODEL_DIR}", f"run.dir={tmp_path}", "run.progress=false",
                             "train.steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
                             "rollout.max_new_tokens=16", "rollout.max_turns=3", f"task.env={GAME}",
                             "task.train_size=8", "task.eval_size=2", "run.eval_every=0"])
    ctl = Controller(cfg)
    try:
        ctl.train()
    finally:
        ctl.close()
    rows = [r for s in (1, 2) for r in pq.read_table(tmp_path / "episodes" / f"step_{s:06d}.parquet").to_pylist()]
    assert len(rows) == 16 and all(r["env"] == GAME and r["status"] in ("ok", "truncated") for r in rows)
    assert all(set(dict(r["reward_parts"])) == {"game"} for r in rows if r["status"] == "ok")


def test_a_two_player_game_against_the_scripted_opponent():
    t = build_task(TaskConfig(env="textarena:TicTacToe-v0", train_size=2, eval_size=1,
                              env_args={"opponent": "tidal.envs.adapters.textarena:first_available"}))

    def play(moves):
        env = t.make_env(t.train_rows[0])

        async def go():
            await env.reset()
            out = []
            for i, move in enumerate(moves):
                out.append(await env.step(Action(move, turn=i)))
                if out[-1].done:
                    break
            return out

        return asyncio.run(go())

    # The opponent (X) takes the first free cell: 0, then 1; O takes 4, 2, 6, the diagonal.
    won = play(["[4]", "[2]", "[6]"])
    assert [r.done for r in won] == [False, False, True] and won[-1].reward_parts == {"game": 1.0}
    assert "X | X" in won[1].messages[0]["content"]  # the opponent's moves reach the policy
    lost = play(["[4]", "[8]", "[6]"])  # X completes 0-1-2
    assert lost[-1].done and lost[-1].reward_parts == {"game": -1.0}
