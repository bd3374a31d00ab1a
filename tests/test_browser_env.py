"""The `browser` environment in real headless Chromium: every task family end to end with a
scripted policy (1 for the solution, 0 for a wrong sequence), error observations for
impossible actions, determinism of observations and screenshot bytes across browser
restarts, crash containment (a renderer, a whole browser), recycling, and a clean close.
The isolation of the network is tests/test_browser_isolation.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal

import pytest
from browser_support import require_chromium

from tidal.envs.base import Action
from tidal.envs.browser import BrowserConfig, BrowserEnv, BrowserPool
from tidal.envs.browser.scripted import resolve_ref, run_episode
from tidal.envs.browser.tasks import FAMILIES, make_tasks
from tidal.recipes.tool_model import call_text


@pytest.fixture(autouse=True)
def _chromium():
    require_chromium()


def call(name: str, **arguments) -> str:
    return call_text(name, arguments)


BUTTONS = """<!doctype html><html><head><meta charset="utf-8"><title>Buttons</title></head><body>
<form action="/submit"><button name="choice" value="a">Alpha</button><button name="choice" value="b">Beta</button>
<button name="choice" value="c" disabled>Gamma</button></form>
<label for="n">Name</label><input id="n" name="n"><a href="/next">Next page</a></body></html>"""
NEXT = """<!doctype html><html><head><meta charset="utf-8"><title>Next</title></head><body><p>Second page</p>
<a href="/">Home</a></body></html>"""
ROW = {"task_id": "hand-1", "prompt": [{"role": "user", "content": "Click Beta."}],
       "pages": json.dumps({"/": BUTTONS, "/next": NEXT}), "start": "/",
       "verifier": json.dumps({"kind": "submit", "expect": {"choice": "b"}})}


ref = resolve_ref  # the ref of the one element of a role and name in an observation


def small_pool(**kw) -> BrowserPool:
    return BrowserPool(BrowserConfig(**{"browsers": 1, "contexts_per_browser": 4, **kw}))


# -- the task families, end to end -------------------------------------------------------------

@pytest.mark.parametrize("split", ["train", "test"])
def test_every_family_scores_1_for_its_solution_and_0_for_a_wrong_sequence(split):
    rows = make_tasks(split, 2 * len(FAMILIES), seed=3)
    assert {r["family"] for r in rows} == set(FAMILIES)

    async def go():
        pool = small_pool()
        try:
            good = await asyncio.gather(*(run_episode(BrowserEnv(r, 0, pool=pool), r, "solution") for r in rows))
            bad = await asyncio.gather(*(run_episode(BrowserEnv(r, 0, pool=pool), r, "wrong") for r in rows))
        finally:
            await pool.close()
        return good, bad, pool

    good, bad, pool = asyncio.run(go())
    for r, g, b in zip(rows, good, bad):
        assert g[0] == 1.0, (r["family"], r["task_id"], g)
        assert b[0] == 0.0, (r["family"], r["task_id"], b)
    assert not pool.processes()


# -- actions ------------------------------------------------------------------------------------

def test_impossible_actions_are_error_observations_and_the_episode_goes_on():
    async def go():
        pool = small_pool()
        env = BrowserEnv(ROW, 0, pool=pool, max_turns=20)
        try:
            first = (await env.reset())[-1]["content"]
            beta, name, gamma = ref(first, "button", "Beta"), ref(first, "textbox", "Name"), ref(first, "button", "Gamma")
            out = []
            for text in [call("click", ref="e999"), call("click", ref="#main"), call("press", key="Control+W"),
                         call("type", ref=beta, text="x"), call("select", ref=name, option="a"),
                         call("scroll", direction="sideways"), '<tool_call>{"name": "click", "arguments": {</tool_call>',
                         call("click", ref=gamma), call("type", ref=name, text="Ann")]:
                out.append(await env.step(Action(text)))
            done = await env.step(Action(call("click", ref=beta) + call("done")))
        finally:
            await env.close()
            await pool.close()
        return first, out, done

    first, out, done = asyncio.run(go())
    assert "Page: Buttons (/)" in first and "Click Beta." in first
    contents = [o.messages[0]["content"] for o in out]
    assert all(c.startswith("error:") for c in contents[:8]), contents
    assert "no element has ref e999" in contents[0]
    assert "like e5" in contents[1]
    assert "key must be one of" in contents[2]
    assert "disabled" in contents[7] or "not enabled" in contents[7] or "Timeout" in contents[7]
    assert not any(o.done for o in out)
    assert contents[8].startswith("Page: Buttons (/)") and 'textbox "Name"' in contents[8]
    assert out[0].metrics["browser/action_errors"] == 1.0 and out[8].metrics["browser/action_errors"] == 0.0
    assert done.done and done.reward == 1.0 and done.metrics["browser/out_of_turns"] == 0.0


def test_navigation_go_back_and_out_of_turns():
    async def go():
        pool = small_pool()
        env = BrowserEnv(ROW, 0, pool=pool, max_turns=3)
        try:
            first = (await env.reset())[-1]["content"]
            second = await env.step(Action(call("click", ref=ref(first, "link", "Next page"))))
            back = await env.step(Action(call("go_back")))
            last = await env.step(Action(call("scroll", direction="down")))
        finally:
            await env.close()
            await pool.close()
        return second, back, last

    second, back, last = asyncio.run(go())
    assert second.messages[0]["content"].startswith("Page: Next (/next)")
    assert back.messages[0]["content"].startswith("Page: Buttons (/)")
    assert last.done and last.reward == 0.0 and last.metrics["browser/out_of_turns"] == 1.0


def test_bad_rows_and_config_name_the_problem():
    with pytest.raises(ValueError, match="(?s)browser: env_args.browser is not a valid browser config.*contexts"):
        BrowserEnv(ROW, 0, browser={"contexts": 3})
    with pytest.raises(ValueError, match="row hand-1: `start` '/nope'"):
        BrowserEnv({**ROW, "start": "/nope"}, 0)
    with pytest.raises(ValueError, match="row hand-1: `verifier`"):
        BrowserEnv({**ROW, "verifier": json.dumps({"kind": "guess"})}, 0)
    with pytest.raises(ValueError, match="env_args.families has unknown families"):
        BrowserEnv(ROW, 0, families=["nope"])
    with pytest.raises(ValueError, match="env_args.actions"):
        BrowserEnv(ROW, 0, actions=["click"])
    assert [t["function"]["name"] for t in BrowserEnv(ROW, 0, actions=["done", "click"]).tools] == ["click", "done"]


# -- determinism --------------------------------------------------------------------------------

def test_same_seed_same_observations_and_screenshot_bytes_across_browser_restarts():
    rows = make_tasks("train", len(FAMILIES), seed=11)

    async def once():
        pool = small_pool()
        seen = []
        try:
            for r in rows:
                env = BrowserEnv(r, 0, pool=pool)
                first = (await env.reset())[-1]["content"]
                seen.append((first, await env.screenshot()))
                await env.close()
        finally:
            await pool.close()
        return seen

    a, b = asyncio.run(once()), asyncio.run(once())  # two pools: two browser processes
    assert [x[0] for x in a] == [x[0] for x in b]
    assert [x[1] for x in a] == [x[1] for x in b]
    assert all(png.startswith(b"\x89PNG") for _, png in a)
    assert len({png for _, png in a}) == len(rows)  # the families' pages differ


# -- crashes, recycling, close ------------------------------------------------------------------

def test_a_crashed_renderer_ends_only_its_episode():
    async def go():
        pool = small_pool()
        envs = [BrowserEnv(ROW, i, pool=pool) for i in range(3)]
        try:
            firsts = [(await e.reset())[-1]["content"] for e in envs]
            cdp = await envs[1]._tab.context.new_cdp_session(envs[1]._tab.page)
            # The renderer dies before it can answer, so the call never returns: give it 2 s.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(cdp.send("Page.crash"), 2.0)
            assert envs[1]._tab.crashed == "the page's renderer crashed"
            with pytest.raises(RuntimeError, match="renderer crashed"):
                await envs[1].step(Action(call("click", ref=ref(firsts[1], "button", "Beta"))))
            others = [await e.step(Action(call("click", ref=ref(f, "button", "Beta")) + call("done")))
                      for e, f in ((envs[0], firsts[0]), (envs[2], firsts[2]))]
            after = await run_episode(BrowserEnv(ROW, 9, pool=pool), ROW, steps=[
                {"action": "click", "role": "button", "name": "Beta"}, {"action": "done"}])
        finally:
            for e in envs:
                await e.close()
            await pool.close()
        return others, after, pool

    others, after, pool = asyncio.run(go())
    assert [o.reward for o in others] == [1.0, 1.0]
    assert after[0] == 1.0
    assert pool.stats["died"] == 0 and not pool.processes()


def test_a_killed_browser_ends_its_episodes_and_is_replaced():
    async def go():
        pool = small_pool(browsers=2, contexts_per_browser=1)
        envs = [BrowserEnv(ROW, i, pool=pool) for i in range(2)]
        try:
            firsts = [(await e.reset())[-1]["content"] for e in envs]
            victim = envs[0]._tab.slot
            os.kill(victim.pid, signal.SIGKILL)
            for _ in range(100):  # the driver notices the pipe close within milliseconds
                if victim.dead:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(RuntimeError, match="browser process died"):
                await envs[0].step(Action(call("click", ref=ref(firsts[0], "button", "Beta"))))
            other = await envs[1].step(Action(call("click", ref=ref(firsts[1], "button", "Beta")) + call("done")))
            await envs[0].close()
            after = [await run_episode(BrowserEnv(ROW, 9, pool=pool), ROW, steps=[
                {"action": "click", "role": "button", "name": "Beta"}, {"action": "done"}]) for _ in range(2)]
        finally:
            for e in envs:
                await e.close()
            await pool.close()
        return other, after, pool

    other, after, pool = asyncio.run(go())
    assert other.reward == 1.0
    assert [a[0] for a in after] == [1.0, 1.0]
    assert pool.stats["died"] == 1 and pool.stats["launched"] == 3
    assert not pool.processes()


def test_browsers_are_recycled_and_close_leaves_no_process():
    steps = [{"action": "click", "role": "button", "name": "Beta"}, {"action": "done"}]

    async def go():
        pool = small_pool(recycle_after=3, contexts_per_browser=2)
        try:
            rewards = await asyncio.gather(*(run_episode(BrowserEnv(ROW, i, pool=pool), ROW, steps=steps)
                                             for i in range(10)))
            live = pool.processes()
        finally:
            await pool.close()
        return rewards, live, pool

    rewards, live, pool = asyncio.run(go())
    assert [r[0] for r in rewards] == [1.0] * 10
    # 10 episodes, a browser per 3 contexts: 3 recycled, a 4th browser for the 10th episode
    assert pool.stats == {"launched": 4, "recycled": 3, "died": 0, "contexts": 10}
    assert live and not pool.processes()
