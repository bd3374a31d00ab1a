"""The agent as an environment: train an agent written against the OpenAI client, unchanged.

`task.env: openai_agent` with `task.agent: my_pkg.agents:solve`. Each episode calls
`solve(row, client, **task.agent_args)` with a client whose `base_url` is the gateway's
session of that episode (tidal/runtime/gateway.py): every call the agent makes is generated
by the policy being trained and recorded as the engine's tokens, log-probs and versions, and
the rollout assembles them into the episode's turns (tidal/runtime/sessions.py).

`solve` may be a function (it gets an `openai.OpenAI` client and runs on a thread of its own)
or a coroutine function (an `openai.AsyncOpenAI` client, run as a coroutine). What it returns:

- a string: the final answer, scored by the task's rewards (`task.reward`);
- a number, or a dict of numbers: the episode's reward (parts), added to the task's rewards
  (which then score the final call's reply);
- None: the final call's reply is the answer.

An agent that raises ends its episode `env_error` naming the agent and the exception, unless
the session's turn or token budget refused a call first (the episode is then `truncated`). An
agent that hangs is cut by `rollout.episode_timeout_s` (`timeout`); its session closes, so its
further calls fail at once. The client makes no retries: a failed call is the agent's to see.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tidal.envs import BUILTIN_ENVS
from tidal.envs.tools import run_sync_in_thread
from tidal.importing import import_object


@dataclass
class AgentResult:
    answer: str | None = None  # the final answer (None: the last reply)
    reward: float | None = None  # what the agent itself scored (None: nothing)
    parts: dict[str, float] = field(default_factory=dict)


class AgentError(Exception):
    """The agent raised or returned something tidal cannot use."""


def result_of(value: Any, who: str) -> AgentResult:
    if value is None:
        return AgentResult()
    if isinstance(value, str):
        return AgentResult(answer=value)
    if isinstance(value, bool):
        value = float(value)
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise AgentError(f"agent `{who}` returned a non-finite reward {value!r}")
        return AgentResult(reward=float(value))
    if isinstance(value, dict) and value and all(isinstance(k, str) and isinstance(v, (int, float))
                                                 and not isinstance(v, bool) and math.isfinite(v)
                                                 for k, v in value.items()):
        parts = {k: float(v) for k, v in value.items()}
        return AgentResult(reward=sum(parts.values()), parts=parts)
    raise AgentError(f"agent `{who}` returned {type(value).__name__} {str(value)[:80]!r}: return the answer (str), a "
                     "reward (a number or a dict of finite numbers) or None")


class OpenAIAgentEnv:
    """`OpenAIAgentEnv(row, seed, agent=..., agent_args=...)`: one episode of an OpenAI-client agent."""

    name: ClassVar[str] = "openai_agent"
    agent: ClassVar[bool] = True  # the rollout runs `run_agent` against the gateway, not reset/step
    default_reward: ClassVar[str | None] = None

    @classmethod
    def rows(cls, split: str, n: int, seed: int, rows_from: str | None = None, **env_args: Any) -> list[dict[str, Any]]:
        """Without `task.dataset`: the rows of a built-in environment's task (`env_args.rows_from`,
        e.g. tool_arith), so an agent can be tried on a generated task."""
        if rows_from is None:
            raise ValueError("task.env=openai_agent has no rows of its own: name task.dataset, or "
                             "task.env_args.rows_from (a built-in env whose generated rows to use, e.g. tool_arith)")
        if rows_from not in BUILTIN_ENVS or rows_from in ("openai_agent", "tidal.envs.openai_agent"):
            raise ValueError(f"task.env_args.rows_from={rows_from!r}: not a built-in env with rows "
                             f"({', '.join(k for k in BUILTIN_ENVS if '.' not in k and k != 'openai_agent')})")
        other = import_object(BUILTIN_ENVS[rows_from], "task.env_args.rows_from")
        return other.rows(split, n, seed)

    def __init__(self, row: dict[str, Any], seed: int = 0, *, agent: str, agent_args: dict[str, Any] | None = None,
                 client_timeout_s: float = 600.0, rows_from: str | None = None):
        self.row, self.seed = row, seed
        self.agent_path = agent
        self.fn = import_object(agent, "task.agent")
        if not callable(self.fn):
            raise TypeError(f"`task.agent`: `{agent}` is not callable")
        self.agent_args = dict(agent_args or {})
        self.client_timeout_s = client_timeout_s
        self.is_async = inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(
            type(self.fn).__call__)  # an instance whose __call__ is async

    async def run_agent(self, base_url: str, api_key: str) -> AgentResult:
        import openai

        kwargs = {"base_url": base_url, "api_key": api_key, "max_retries": 0, "timeout": self.client_timeout_s}
        if self.is_async:
            client = openai.AsyncOpenAI(**kwargs)
            try:
                value = await self.fn(self.row, client, **self.agent_args)
            finally:
                await client.close()
        else:
            client = openai.OpenAI(**kwargs)

            def call() -> Any:
                try:
                    return self.fn(self.row, client, **self.agent_args)
                finally:
                    client.close()

            value = await run_sync_in_thread(call, {})
            if inspect.isawaitable(value):  # a sync function that returned a coroutine
                value = await value
        return result_of(value, self.agent_path)

    async def reset(self):
        raise AgentError("an agent environment is run by the rollout through `run_agent`, not reset/step")

    async def step(self, action):
        raise AgentError("an agent environment is run by the rollout through `run_agent`, not reset/step")

    async def close(self) -> None:
        return None
