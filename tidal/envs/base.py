"""The environment protocol: what a rollout talks to between generations.

An environment speaks chat messages, never tokens: `reset` gives the opening messages,
`step` takes one policy turn (its decoded text and finish reason) and answers with the
messages to append (tool results, a user reply) or ends the episode. The rollout owns
tokenization: tokens of earlier turns are never re-tokenized (docs/architecture.md, "Invariants":
token in, token out). A single-turn task ends at its first `step`; a multi-turn or tool-using one returns
`done=False` with more messages, through the same calls. `close` is always called once the
episode ends, however it ends (done, out of turns or tokens, an error, a timeout), so
sandboxes and sessions are released.

An environment is built from a dataset row and a seed: `MyEnv(row, seed=..., **task.env_args)`
(`task.env: my_pkg.envs:MyEnv` or `path/to/envs.py:MyEnv`). The same seed and the same
actions give the same observations. Optional class attributes and methods, declared in
`OPTIONAL` below (the one place; tidal reads them only through `optional`):

- `tools`: OpenAI function schemas rendered by the chat template (`tools=`), read after reset;
- `sampling`: a `SamplingOverride` for the first turn;
- `close()`: release what the episode held (sandboxes, sessions);
- `rows(split, n, seed, **env_args)` (classmethod): the built-in task's rows, used when
  `task.dataset` is not set ("train" or "test" split);
- `default_reward`: the dotted path of the reward used when `task.reward` is not set
  (None: the environment's own per-turn rewards are the whole reward);
- `agent` / `agent_path`: an agent environment (`AgentEnv`): the rollout runs its whole
  episode with `run_agent` against the gateway instead of `reset`/`step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tidal.types import ToolCallRecord

# A chat message in the OpenAI shape: {"role", "content"} plus, on assistant messages,
# "tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}] and, on tool
# messages, "tool_call_id" and "name".
Message = dict[str, Any]


@dataclass(frozen=True)
class Action:
    """One policy turn as the environment sees it."""

    text: str  # decoded, special tokens skipped
    finish_reason: str = "stop"  # "stop" (stop token or stop string) | "length" (out of tokens)
    token_ids: tuple[int, ...] = ()
    turn: int = 0
    # No further turn follows, whatever the environment answers (rollout.max_turns, or the
    # episode's token budget is spent): an environment that grades or verifies at its end
    # should do it now.
    last_turn: bool = False


@dataclass(frozen=True)
class SamplingOverride:
    """Changes to sampling for the next turn (None: keep the run's setting)."""

    stop: tuple[str, ...] | None = None
    max_new_tokens: int | None = None


@dataclass
class StepResult:
    messages: list[Message] = field(default_factory=list)  # appended before the next turn
    reward: float = 0.0  # this turn's reward: added to the episode's, credited to the turn
    reward_parts: dict[str, float] = field(default_factory=dict)
    done: bool = True
    metrics: dict[str, float] = field(default_factory=dict)  # summed over turns into Episode.metrics
    tool_calls: list[ToolCallRecord] = field(default_factory=list)  # the turn's calls and outcomes
    sampling: SamplingOverride | None = None  # for the next turn
    # How the turn is kept in the conversation the rewards see (e.g. with parsed `tool_calls`
    # in the OpenAI shape); None: {"role": "assistant", "content": the turn's text}. The chat
    # template always renders the turn as generated: tokens are never re-serialized.
    assistant_message: Message | None = None


@runtime_checkable
class Env(Protocol):
    """What every environment has; the optional parts are in `OPTIONAL`."""

    name: str

    async def reset(self) -> list[Message]: ...

    async def step(self, action: Action) -> StepResult: ...


@runtime_checkable
class AgentEnv(Protocol):
    """An environment that is an agent (tidal/envs/openai_agent.py): `run_agent` plays the whole
    episode, calling the policy through the gateway at `base_url` with `api_key`; the rollout
    turns the recorded calls into the episode. `agent` is True; `agent_path` names the agent in
    errors."""

    name: str
    agent: bool
    agent_path: str

    async def run_agent(self, base_url: str, api_key: str) -> Any: ...


_ABSENT = object()
# The optional attributes of an environment (class or instance) and what their absence means.
# `default_reward` absent and None differ: None says "the environment's own rewards are all".
OPTIONAL: dict[str, Any] = {
    "tools": None, "sampling": None, "close": None, "rows": None, "default_reward": _ABSENT,
    "agent": False, "agent_path": None,
}


def optional(env: Any, attribute: str, default: Any = _ABSENT) -> Any:
    """An optional attribute of an environment (or its class), or what its absence means
    (`default`, when given, for `default_reward`). Only the attributes of `OPTIONAL`."""
    if attribute not in OPTIONAL:
        raise AttributeError(f"`{attribute}` is not an optional attribute of an environment (envs/base.py: OPTIONAL)")
    value = getattr(env, attribute, OPTIONAL[attribute])
    if value is _ABSENT:
        return None if default is _ABSENT else default
    return value


def is_agent_env(env: Any) -> bool:
    """Whether an environment (or its class) is an `AgentEnv`: it declares `agent = True`."""
    return bool(optional(env, "agent"))


class RewardError(Exception):
    """The reward failed (raised, returned a bad value): the episode ends `reward_error`,
    never scored 0."""
