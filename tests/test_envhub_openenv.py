"""OpenEnv servers through tidal (tidal/envs/adapters/openenv.py): an environment written as
OpenEnv's docs show (tests/openenv_guess_server.py), served by OpenEnv's own `create_app` under
uvicorn in the Python that has `openenv` (.venv-openenv, scripts/setup_openenv.sh), which tidal
starts on 127.0.0.1 and drives over OpenEnv's WebSocket protocol; a server killed mid-episode
ends the episode with a typed error naming it, and the next episode restarts it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tidal.config import ConfigError, TaskConfig, load_config
from tidal.envs.base import Action
from tidal.runtime.tasks import build_task

pytest.importorskip("websockets")
ROOT = Path(__file__).resolve().parent.parent
PYTHON = os.environ.get("TIDAL_OPENENV_PYTHON") or str(ROOT / ".venv-openenv" / "bin" / "python")
if not Path(PYTHON).is_file():
    if os.environ.get("TIDAL_REQUIRE_OPENENV"):
        raise RuntimeError(f"TIDAL_REQUIRE_OPENENV is set and {PYTHON} is missing: bash scripts/setup_openenv.sh")
    pytest.skip(f"no OpenEnv venv at {PYTHON} (bash scripts/setup_openenv.sh)", allow_module_level=True)
SERVER = f"openenv:{ROOT / 'tests' / 'openenv_guess_server.py'}:app"


def _task(**env_args):
    return build_task(TaskConfig(env=SERVER, train_size=4, eval_size=2, env_args={"python": PYTHON, **env_args}))


async def _binary_search(env):
    """Play by halving 1..20 on the server's hints; the results of every step."""
    first = (await env.reset())[0]["content"]
    assert "Guess my number between 1 and 20" in first  # the default rendering: the one text field
    lo, hi, results = 1, 20, []
    for i in range(6):
        guess = (lo + hi) // 2
        results.append(await env.step(Action(f"I guess {guess}", turn=i)))
        if results[-1].done:
            return results
        hint = results[-1].messages[0]["content"]
        lo, hi = (guess + 1, hi) if "higher" in hint else (lo, guess - 1)
    return results


@pytest.mark.slow  # two server starts: OpenEnv imports gradio, 20-30 s each on this loaded machine
def test_an_openenv_server_is_started_and_played_over_its_protocol():
    from tidal.envs.adapters import openenv

    t = _task()
    assert t.name == SERVER and not t.rewards  # the environment's step rewards are the whole reward
    assert not {r["reset_seed"] for r in t.train_rows} & {r["reset_seed"] for r in t.eval_rows}
    for row in t.train_rows[:3]:
        env = t.make_env(row)
        try:
            results = asyncio.run(_binary_search(env))
        finally:
            asyncio.run(env.close())
        # Binary search over 1..20 finds it within 5 guesses, so the server's reward is 1 on the last step.
        assert results[-1].done and results[-1].reward_parts == {"openenv": 1.0}
        assert all(r.reward == 0.0 and not r.done for r in results[:-1])
        assert results[-1].metrics == {"openenv/finished": 1.0}
    server = next(s for (app, _), s in openenv._SERVERS.items() if app == SERVER.removeprefix("openenv:"))
    assert server.url.startswith("http://127.0.0.1:") and server.starts == 1  # one server, all episodes

    # Killed mid-episode: the step fails with an error naming the server and how it ended.
    env = t.make_env(t.train_rows[0])

    async def killed():
        await env.reset()
        await env.step(Action("I guess 0"))  # 0 is never the secret
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)
        await env.step(Action("I guess 1", turn=1))

    with pytest.raises(openenv.OpenEnvServerError, match=r"OpenEnv server `.*openenv_guess_server.py:app` at "
                       r"http://127.0.0.1:\d+ \(pid \d+, exited with code -9, .*lost the episode at `step`"):
        asyncio.run(killed())
    asyncio.run(env.close())
    # The next episode restarts it.
    env = t.make_env(t.train_rows[1])
    assert asyncio.run(_binary_search(env))[-1].reward == 1.0 and server.starts == 2
    asyncio.run(env.close())

    # Hung (each step sleeps 60 s, past the episode's 3 s timeout): named, and the server killed for a restart.
    hung = _task(timeout_s=3, reset_args={"hang_s": 60})
    env = hung.make_env(hung.train_rows[0])

    async def stuck():
        await env.reset()
        await env.step(Action("I guess 1"))

    with pytest.raises(openenv.OpenEnvServerError, match=r"openenv_guess_server.py:app.* did not answer `step` within 3 s"):
        asyncio.run(stuck())
    asyncio.run(env.close())
    assert server.proc.poll() is not None and server.starts == 2  # killed; the next episode starts it again


def test_bad_servers_are_named_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"`task.env_args.python`: `/nonexistent/python` does not exist"):
        build_task(TaskConfig(env=SERVER, train_size=2, eval_size=1, env_args={"python": "/nonexistent/python"}))
    with pytest.raises(ConfigError, match=r"file `nowhere/server.py` does not exist"):
        build_task(TaskConfig(env="openenv:nowhere/server.py:app", train_size=2, eval_size=1))
    # A server that cannot start: its own error is named when the first episode starts it.
    bad = tmp_path / "broken_server.py"
    bad.write_text("raise RuntimeError('no such environment')\n")
    t = build_task(TaskConfig(env=f"openenv:{bad}:app", train_size=2, eval_size=1,
                              env_args={"python": PYTHON, "timeout_s": 30}))
    from tidal.envs.adapters.openenv import OpenEnvServerError

    with pytest.raises(OpenEnvServerError, match=r"(?s)broken_server.py:app.*exited with code 1.*did not start.*no such environment"):
        asyncio.run(t.make_env(t.train_rows[0]).reset())


@pytest.mark.slow
def test_grpo_steps_on_an_openenv_server_and_a_server_that_dies(tmp_path):
    from tidal.models import DEFAULT_MODEL_DIR
    from tidal.runtime.controller import Controller

    marker = tmp_path / "died"  # the server kills itself at the first step that finds no marker
    cfg = load_config(None, [f"model.path={DEFAULT_MODEL_DIR}", f"run.dir={tmp_path / 'run'}", "run.progress=false",
                             "train.steps=3", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
                             "rollout.max_new_tokens=12", "rollout.max_turns=3", f"task.env={SERVER}",
                             f"task.env_args={{python: {PYTHON}, reset_args: {{die_once: {marker}}}}}",
                             "task.train_size=8", "task.eval_size=2", "run.eval_every=0"])
    ctl = Controller(cfg)
    try:
        ctl.train()
    finally:
        ctl.close()
    assert marker.exists()  # the server did die
    steps = {s: pq.read_table(tmp_path / "run" / "episodes" / f"step_{s:06d}.parquet").to_pylist() for s in (1, 2, 3)}
    rows = [r for s in steps.values() for r in s]
    assert len(rows) == 24 and all(r["env"] == SERVER for r in rows)
    failed = [r for r in rows if r["status"] == "env_error"]
    # The episodes in flight on the server when it died (at least the one that killed it) are env_error,
    # naming it; the others ran: the server was restarted and the run went on to its last step.
    assert failed and all("OpenEnv server" in r["error"] and "openenv_guess_server.py:app" in r["error"] for r in failed)
    assert any(r["status"] in ("ok", "truncated") for r in steps[3])
    played = [r for r in rows if r["status"] in ("ok", "truncated")]
    assert played and all(set(dict(r["reward_parts"])) == {"openenv"} for r in played)
    assert any(len(r["turns"]) >= 2 for r in played)  # multi-turn: the server's hints came back as turns
    metrics = {m["step"]: m for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert "grad_norm" in metrics[3]  # the last step trained
