"""OpenEnv environments as tidal multi-turn environments: `task.env: openenv:SERVER`.

An OpenEnv environment (`openenv.core.env_server`: an `Environment` with `reset`, `step(action)`
and `state`, its typed `Action` and `Observation`, served by `create_app`) runs as its own HTTP
server. SERVER is either the URL of a server the user runs (`openenv:http://127.0.0.1:8000`), or
the server's app, `pkg.module:app` or `path/to/server.py:app`, which tidal starts itself on
127.0.0.1 (a free port) with uvicorn in `env_args.python` (the Python that has the `openenv`
package; OpenEnv's dependencies conflict with tidal's venv, so this is usually another venv:
scripts/setup_openenv.sh makes `.venv-openenv`).

The choice: tidal does not import `openenv`. The adapter speaks OpenEnv's WebSocket protocol at
`/ws`, what OpenEnv's own `EnvClient` speaks (JSON frames `{"type": "reset"|"step"|"close",
"data": ...}`, answered by `{"type": "observation", "data": {"observation", "reward", "done"}}` or
`{"type": "error", "data": {"message", "code"}}`): one WebSocket per episode is one server-side
environment instance, which is OpenEnv's session. (Its plain HTTP `/reset` and `/step` make a
fresh environment per request, so they cannot carry an episode.)

What maps to what:
- rows: one reset seed each (`task.train_size` train seeds from `task.seed`, `task.eval_size`
  held-out ones from a distinct range), sent as `reset(seed=, **env_args.reset_args)`;
- the observation reaches the policy as a user message, rendered by `env_args.render` (a function
  `render(observation: dict) -> str`; by default its one text field, else its fields as JSON);
- the policy's turn becomes the action by `env_args.action` (a function `action(text) -> dict`;
  by default `{env_args.action_field: text}`, `action_field` "message" by default);
- each step's reward is the turn's reward, as the part `openenv`.

Failures: a server that exits, refuses, or does not answer within `env_args.timeout_s` raises
`OpenEnvServerError` naming the server (its URL, and for one tidal started its pid, exit code and
log tail), which the rollout records as an `env_error` episode (never a score). A server tidal
started is restarted by the next episode that finds it dead (a hung one is killed first).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import httpx

from tidal.envs.base import Action, Message, StepResult
from tidal.importing import import_object

PREFIX = "openenv:"
EVAL_SEED_OFFSET = 1_000_003


class OpenEnvServerError(RuntimeError):
    """The OpenEnv server failed (exited, refused, timed out, answered an error frame)."""


def env_class(server: str) -> type:
    """The tidal environment class that drives the OpenEnv server `server` (a URL or an app)."""
    return type("OpenEnv", (OpenEnvEnv,), {"server": server, "name": f"{PREFIX}{server}"})


class _Server:
    """An OpenEnv server tidal starts (uvicorn in a subprocess on 127.0.0.1) and restarts when dead."""

    def __init__(self, app: str, python: str, timeout_s: float):
        target, _, attr = app.rpartition(":")
        if not target or not attr:
            raise ValueError(f"`task.env: {PREFIX}{app}`: not a URL, nor an app `pkg.module:app` or `path/server.py:app`")
        if target.endswith(".py") or "/" in target:
            file = Path(target).expanduser().resolve()
            if not file.is_file():
                raise ValueError(f"`task.env: {PREFIX}{app}`: file `{target}` does not exist (relative to {Path.cwd()})")
            self.app_dir, self.target = str(file.parent), f"{file.stem}:{attr}"
        else:
            self.app_dir, self.target = str(Path.cwd()), app
        if not Path(python).is_file():
            raise ValueError(f"`task.env_args.python`: `{python}` does not exist (the Python with the `openenv` "
                             "package: bash scripts/setup_openenv.sh makes .venv-openenv)")
        self.app, self.python, self.timeout_s = app, python, timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.starts = 0
        self.log = Path(tempfile.mkdtemp(prefix="tidal-openenv-")) / "server.log"
        self._lock = threading.Lock()

    def describe(self) -> str:
        if self.proc is None:
            return f"OpenEnv server `{self.app}` (not started)"
        code = self.proc.poll()
        state = f"exited with code {code}" if code is not None else "running"
        return f"OpenEnv server `{self.app}` at {self.url} (pid {self.proc.pid}, {state}, log {self.log})"

    def log_tail(self, n: int = 600) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:].strip()
        except OSError:
            return ""

    def ensure(self) -> str:
        """The URL of a live server: started now if it never was or has died."""
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                return self.url
            self._start()
            return self.url

    def kill(self) -> None:
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def _start(self) -> None:
        with socket.socket() as s:  # a free port, released just before uvicorn binds it
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [self.python, "-m", "uvicorn", self.target, "--host", "127.0.0.1", "--port", str(port),
               "--app-dir", self.app_dir, "--log-level", "warning"]
        with open(self.log, "ab") as log:
            # Spawned from one long-lived thread: the death signal follows the thread that spawned it.
            self.proc = _SPAWNER.submit(subprocess.Popen, cmd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent).result()
        self.starts += 1
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise OpenEnvServerError(f"{self.describe()} did not start: {self.log_tail()}")
            try:  # OpenEnv's /health, not a bare connect: a connect to a free loopback port can reach itself
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise OpenEnvServerError(f"{self.describe()} did not listen within {self.timeout_s:g} s: {self.log_tail()}")


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM when the thread that spawned it dies (Linux's
    death signal is per thread: `_SPAWNER`'s lives as long as the process, the rollout worker)."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


_SERVERS: dict[tuple[str, str], _Server] = {}  # one per (app, python) per process
_SERVERS_LOCK = threading.Lock()
_SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="tidal-openenv-spawn")


@atexit.register
def _stop_servers() -> None:
    for server in list(_SERVERS.values()):
        server.kill()


def _server(app: str, python: str, timeout_s: float) -> _Server:
    with _SERVERS_LOCK:
        if (app, python) not in _SERVERS:
            _SERVERS[(app, python)] = _Server(app, python, timeout_s)
        return _SERVERS[(app, python)]


def render_observation(observation: dict[str, Any]) -> str:
    """The default rendering: the observation's one text field, else its fields as JSON."""
    fields = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
    texts = [v for v in fields.values() if isinstance(v, str)]
    return texts[0] if len(texts) == 1 and len(fields) == 1 else json.dumps(fields, sort_keys=True)


class OpenEnvEnv:
    server: ClassVar[str] = ""
    default_reward: ClassVar[str | None] = None  # the environment's step rewards are the whole reward

    def __init__(self, row: dict[str, Any], seed: int = 0, python: str | None = None, render: str | None = None,
                 action: str | None = None, action_field: str = "message", reset_args: dict | None = None,
                 timeout_s: float = 60.0):
        self.render = import_object(render, "task.env_args.render") if render else render_observation
        self.to_action = (import_object(action, "task.env_args.action") if action
                          else lambda text: {action_field: text})
        self.reset_args = dict(reset_args or {})
        self.timeout_s = float(timeout_s)
        self.seed = int(row.get("reset_seed", seed))
        if self.server.startswith(("http://", "https://", "ws://", "wss://")):
            self.managed = None
            self.url = self.server
        else:
            python = python or os.environ.get("TIDAL_OPENENV_PYTHON") or sys.executable
            self.managed = _server(self.server, python, self.timeout_s)
        self.ws = None

    @classmethod
    def rows(cls, split: str, n: int, seed: int, /, **env_args: Any) -> list[dict[str, Any]]:
        base = seed if split == "train" else seed + EVAL_SEED_OFFSET
        return [{"prompt": "", "reset_seed": base + i, "task_id": f"openenv-{base + i}"} for i in range(n)]

    def _where(self) -> str:
        return self.managed.describe() if self.managed else f"OpenEnv server {self.url}"

    async def _call(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        from websockets.exceptions import WebSocketException

        try:
            await asyncio.wait_for(self.ws.send(json.dumps({"type": kind, "data": data})), self.timeout_s)
            answer = json.loads(await asyncio.wait_for(self.ws.recv(), self.timeout_s))
        except TimeoutError:
            if self.managed:  # hung: killed, so the next episode restarts it
                await asyncio.to_thread(self.managed.kill)
            raise OpenEnvServerError(f"{self._where()} did not answer `{kind}` within {self.timeout_s:g} s") from None
        except (OSError, WebSocketException) as e:
            await asyncio.sleep(0.2)  # let a dying server's exit code be seen
            tail = f": {self.managed.log_tail(300)}" if self.managed else ""
            raise OpenEnvServerError(f"{self._where()} lost the episode at `{kind}`: {type(e).__name__}: {e}{tail}") from None
        if answer.get("type") == "error":
            err = answer.get("data") or {}
            raise OpenEnvServerError(f"{self._where()} answered `{kind}` with error {err.get('code', '?')}: "
                                     f"{err.get('message', answer)}")
        return answer.get("data") or {}

    async def reset(self) -> list[Message]:
        from websockets.asyncio.client import connect

        url = await asyncio.to_thread(self.managed.ensure) if self.managed else self.url
        ws_url = url.replace("http://", "ws://", 1).replace("https://", "wss://", 1).rstrip("/") + "/ws"
        try:
            self.ws = await asyncio.wait_for(connect(ws_url, max_size=None), self.timeout_s)
        except (OSError, TimeoutError) as e:
            raise OpenEnvServerError(f"{self._where()}: cannot open {ws_url}: {type(e).__name__}: {e}") from None
        data = await self._call("reset", {"seed": self.seed, **self.reset_args})
        return [{"role": "user", "content": self.render(data.get("observation") or {})}]

    async def step(self, action: Action) -> StepResult:
        data = await self._call("step", self.to_action(action.text))
        reward = float(data.get("reward") or 0.0)
        done = bool(data.get("done"))
        metrics = {"openenv/finished": float(done)} if done or action.last_turn else {}
        messages = [] if done else [{"role": "user", "content": self.render(data.get("observation") or {})}]
        return StepResult(messages=messages, reward=reward, reward_parts={"openenv": reward}, done=done,
                          metrics=metrics)

    async def close(self) -> None:
        if self.ws is not None:
            ws, self.ws = self.ws, None
            try:  # OpenEnv's client says goodbye before closing; a dead server cannot hear it
                await asyncio.wait_for(ws.send(json.dumps({"type": "close"})), 5)
                await asyncio.wait_for(ws.close(), 5)
            except Exception:  # noqa: BLE001, S110 - the session is gone either way
                pass
