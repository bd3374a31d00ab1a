"""ToolEnv: a multi-turn environment in which the policy calls tools until it answers.

Each policy turn is parsed for `<tool_call>` blocks (tidal.envs.tools). A turn with calls is
executed and answered with one `tool` message per call (`done=False`); the first turn
without a call is the final answer and ends the episode — the task's reward scores it
(`default_reward`, or `task.reward`), and a subclass may add a per-turn reward by overriding
`final_turn`. Every turn carries the same tool metrics (`tools/calls`, `tools/errors/*`, 0 when
none), its `ToolCallRecord`s, and the turn in OpenAI shape (`assistant_message`, with
`tool_calls`), which is how the rewards see the conversation (the chat template renders the
turn as generated).

Subclass it and list the tools as a class attribute, `tool_functions = (fn, ...)` (functions or
`Tool`s), or pass `tools=` to the constructor. `tools = [fn, ...]` as a class attribute is taken
as the tool functions too (it is what people write); on an instance `tools` is the list of OpenAI
schemas the chat template renders, derived from the functions. A class that sets both, or sets
`tools` to anything but functions and `Tool`s (schemas without functions, say), is refused when
it is defined. `env_args` configure it: `tool_timeout_s`, `max_tool_output_chars`,
`max_calls_per_turn`, `system_prompt` (examples/envs/unit_convert.py is a complete one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from tidal.envs.base import Action, Message, StepResult
from tidal.envs.single_turn import prompt_messages
from tidal.envs.tools import Tool, as_tools, assistant_message, empty_metrics, execute, parse_tool_calls


class ToolEnv:
    name: ClassVar[str] = "tool_env"
    tool_functions: ClassVar[Sequence[Tool | Callable[..., Any]]] = ()  # the env's tools
    default_system_prompt: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        listed = cls.__dict__.get("tools")
        if listed is None:
            return
        where = f"{cls.__module__}.{cls.__qualname__}"
        if "tool_functions" in cls.__dict__:
            raise TypeError(f"{where} sets both `tools` and `tool_functions`: list the tool functions once")
        if isinstance(listed, (str, bytes, dict)) or not isinstance(listed, Sequence) or not all(
                isinstance(t, Tool) or (callable(t) and not isinstance(t, type)) for t in listed):
            raise TypeError(f"{where}.tools must list the tool functions (or `Tool`s), got {listed!r}: the schemas "
                            "are derived from the functions' signatures and docstrings (tidal/envs/tools.py)")
        cls.tool_functions = tuple(listed)
        del cls.tools  # on an instance, `tools` is the schemas (set in __init__)

    def __init__(self, row: dict[str, Any], seed: int = 0, *, tools: Sequence[Tool | Callable[..., Any]] | None = None,
                 system_prompt: str | None = None, tool_timeout_s: float = 10.0, max_tool_output_chars: int = 2000,
                 max_calls_per_turn: int = 8):
        if "prompt" not in row:
            raise ValueError(f"{type(self).__name__}: the row has no `prompt` column (columns: {sorted(row)})")
        if tool_timeout_s <= 0:
            raise ValueError(f"{type(self).__name__}: env_args.tool_timeout_s must be > 0, got {tool_timeout_s}")
        if max_tool_output_chars < 1 or max_calls_per_turn < 1:
            raise ValueError(f"{type(self).__name__}: env_args.max_tool_output_chars ({max_tool_output_chars}) and "
                             f"max_calls_per_turn ({max_calls_per_turn}) must be >= 1")
        self.row = row
        self.seed = seed
        self._tools = as_tools(self.tool_functions if tools is None else tools)
        self.tools: list[dict[str, Any]] = [t.schema for t in self._tools.values()]
        self.system_prompt = self.default_system_prompt if system_prompt is None else system_prompt
        self.tool_timeout_s = tool_timeout_s
        self.max_tool_output_chars = max_tool_output_chars
        self.max_calls_per_turn = max_calls_per_turn
        self.turn = 0
        self.closed = False

    async def reset(self) -> list[Message]:
        self.turn = 0
        messages = prompt_messages(self.row["prompt"])
        if self.system_prompt and not (messages and messages[0]["role"] == "system"):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    async def step(self, action: Action | str) -> StepResult:
        text = action.text if isinstance(action, Action) else str(action)
        turn = self.turn
        self.turn += 1
        parsed = parse_tool_calls(text, id_prefix=f"call_{turn}")
        if not parsed.calls:
            result = await self.final_turn(action if isinstance(action, Action) else Action(text, turn=turn))
            result.metrics = {**empty_metrics(), **result.metrics}
            return result
        ex = await execute(parsed.calls, self._tools, self.tool_timeout_s, self.max_tool_output_chars,
                           self.max_calls_per_turn)
        return StepResult(messages=ex.messages, done=False, metrics=ex.metrics, tool_calls=ex.records,
                          assistant_message=assistant_message(parsed))

    async def final_turn(self, action: Action) -> StepResult:
        """The turn without tool calls: the episode ends. Override to add a per-turn reward
        (the task's reward functions score the answer either way)."""
        return StepResult(done=True)

    _session = None  # a sandbox session a subclass opens (code, shell): closed with the env

    async def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def close(self) -> None:
        """Release what the env holds: its sandbox session, if it opened one. Idempotent."""
        await self._close_session()
        self.closed = True
