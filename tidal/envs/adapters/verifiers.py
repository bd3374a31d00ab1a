"""verifiers environments in tidal's rollout: `task.env: verifiers:MODULE_OR_ID`.

The classic verifiers API (0.3.1, pinned by the `verifiers` extra): `load_environment(**env_args)`
of the environment's module (verifiers' own loader, `vf.load_environment`) returns a
`SingleTurnEnv`, `ToolEnv` or other `MultiTurnEnv` scored by a `Rubric`. What maps to what:

- its dataset (`get_dataset`) is the train rows and its eval split (`get_eval_dataset`, which
  falls back to the train set when it has none) the held-out rows; its `prompt` column already
  holds its system prompt and few-shot, so they reach the policy as written;
- a `ToolEnv`'s tools become tidal tools (tidal/envs/tools.py): the same Hermes `<tool_call>`
  parsing, schemas from the functions, typed errors (parse, unknown, args, timeout, raised);
- a `MultiTurnEnv` that is neither runs as its own rollout loop runs it: `setup_state` at reset,
  then after each turn its stop conditions (`is_completed`), then its `env_response(messages,
  state)`; a `final_env_response` in the state or an empty answer ends the episode too;
- its rubric is the reward: each reward function of the rubric (of each rubric of a
  `RubricGroup`) is a reward part, its value times its weight; a function of weight 0 (verifiers'
  monitor metrics) is a metric. Scoring happens here, at the episode's last turn, with verifiers'
  own score objects (prompt, completion, answer, info, state, its parser), calling each function
  as verifiers does (only the arguments it names). verifiers itself logs a raising reward
  function and scores it 0; here it ends the episode `reward_error`, naming the function.
- token-in/token-out is tidal's: the environment sees decoded text and answers with messages.

The new API of verifiers 0.4 (`verifiers.v1`: Taskset, harness, an MCP toolset, its own model
proxy) is not supported: docs/envhub.md says why.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any, ClassVar

from tidal.envs.base import Action, Message, RewardError, StepResult
from tidal.envs.single_turn import prompt_messages
from tidal.envs.tool_env import ToolEnv

PREFIX = "verifiers:"
_LOADED: dict[tuple[str, str], Any] = {}  # one loaded environment per (id, env_args) per process


def load(env_id: str, env_args: dict[str, Any]) -> Any:
    """The verifiers environment `env_id` built with `env_args`, loaded once per process."""
    key = (env_id, json.dumps(env_args, sort_keys=True, default=str))
    if key not in _LOADED:
        import verifiers as vf

        try:
            env = vf.load_environment(env_id, **env_args)
        except (ImportError, ValueError, TypeError) as e:
            raise ValueError(f"`task.env: {PREFIX}{env_id}`: verifiers cannot load it with env_args {env_args}: {e}") from e
        if not isinstance(env, vf.MultiTurnEnv):
            raise ValueError(f"`task.env: {PREFIX}{env_id}`: load_environment returned {type(env).__name__}, not a "
                             "SingleTurnEnv, ToolEnv or MultiTurnEnv (the classic verifiers API)")
        _LOADED[key] = env
    return _LOADED[key]


def reward_functions(rubric: Any) -> list[tuple[Any, float]]:
    """(function, weight) of every reward function of `rubric`, a `RubricGroup`'s flattened."""
    if hasattr(rubric, "rubrics"):
        return [fw for r in rubric.rubrics for fw in reward_functions(r)]
    return list(zip(rubric.funcs, rubric.weights, strict=True))


def env_class(env_id: str) -> type:
    """The tidal environment class that runs verifiers environment `env_id`."""
    return type(f"Verifiers_{env_id}", (VerifiersEnv,), {"vf_id": env_id, "name": f"{PREFIX}{env_id}"})


class VerifiersEnv(ToolEnv):
    vf_id: ClassVar[str] = ""
    default_reward: ClassVar[str | None] = None  # the rubric, scored here, is the whole reward

    def __init__(self, row: dict[str, Any], seed: int = 0, **env_args: Any):
        import verifiers as vf

        self.vf = load(self.vf_id, env_args)
        tools = list(getattr(self.vf, "tool_map", {}).values()) if isinstance(self.vf, vf.ToolEnv) else []
        super().__init__(row, seed, tools=tools)
        self.is_tool_env = isinstance(self.vf, vf.ToolEnv)
        self.is_single_turn = isinstance(self.vf, vf.SingleTurnEnv)
        self.completion: list[Message] = []
        self.state: Any = None

    @classmethod
    def rows(cls, split: str, n: int, seed: int, /, **env_args: Any) -> list[dict[str, Any]]:
        # positional-only: env_args are load_environment's and may well include an `n`
        env = load(cls.vf_id, env_args)
        data = env.get_dataset() if split == "train" else env.get_eval_dataset()
        return [{**row, "task_id": f"{cls.vf_id}-{split}-{row.get('example_id', i)}"}
                for i, row in zip(range(n), data)]  # at most n: task.train_size / task.eval_size

    async def reset(self) -> list[Message]:
        from verifiers.types import State, flatten_task_input
        from verifiers.utils.message_utils import normalize_messages

        self.turn, self.completion = 0, []
        messages = prompt_messages(self.row["prompt"])
        task = flatten_task_input({k: v for k, v in self.row.items() if k != "task_id"})
        self.state = State(input=task)
        self.state.update(task=task, prompt=normalize_messages(messages, field_name="prompt"), trajectory=[],
                          completion=None, reward=None, metrics=None, error=None, final_env_response=None,
                          is_completed=False, is_truncated=False)
        state = await self.vf.setup_state(self.state)  # its own per-episode fields
        self.state = self.state if state is None else state
        return messages

    async def step(self, action: Action) -> StepResult:
        if self.is_tool_env:
            result = await super().step(action)  # tidal's tool calling; a turn without calls is final_turn
            if not result.done:
                self.completion += [result.assistant_message or {"role": "assistant", "content": action.text},
                                    *result.messages]
                if action.last_turn:
                    await self._score(result)
            return result
        self.completion.append({"role": "assistant", "content": action.text})
        if self.is_single_turn:
            return await self.final_turn(action)
        return await self._env_turn(action)

    async def _env_turn(self, action: Action) -> StepResult:
        """A MultiTurnEnv's turn as its own rollout loop takes it: the turn joins the trajectory, its
        stop conditions (`@vf.stop`, `is_completed`) are asked, then its `env_response` answers."""
        from verifiers.utils.message_utils import normalize_messages

        history = normalize_messages(prompt_messages(self.row["prompt"]) + self.completion, field_name="messages")
        self.state["trajectory"].append({"prompt": history[:-1], "completion": history[-1:]})
        self.state["completion"] = normalize_messages(self.completion, field_name="completion")
        if action.last_turn or await self.vf.is_completed(self.state):
            return await self.final_turn(action)
        reply = await self.vf.env_response(history, self.state)
        answer = [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in reply or []]
        if not answer or self.state.get("final_env_response") is not None:
            return await self.final_turn(action)
        self.completion.extend(answer)
        return StepResult(messages=answer, done=False)

    async def final_turn(self, action: Action) -> StepResult:
        if self.is_tool_env:  # ToolEnv.step calls this for the turn without calls, before step returns
            self.completion.append({"role": "assistant", "content": action.text})
        result = StepResult(done=True)
        await self._score(result)
        return result

    async def _score(self, result: StepResult) -> None:
        """The rubric: each function a part (value x weight), weight 0 a metric; a raise is a RewardError."""
        from verifiers.utils.message_utils import normalize_messages

        self.state["completion"] = normalize_messages(self.completion, field_name="completion")
        for fn, weight in reward_functions(self.vf.rubric):
            value = await self._call(fn)
            name = getattr(fn, "__name__", "reward")
            if weight:
                result.reward_parts[name] = result.reward_parts.get(name, 0.0) + weight * value
            else:
                result.metrics[f"verifiers/{name}"] = value
        result.reward = sum(result.reward_parts.values())

    async def _call(self, fn: Any) -> float:
        objects = self.vf.rubric.score_objects(self.state) if not hasattr(self.vf.rubric, "rubrics") else None
        name = getattr(fn, "__name__", repr(fn))
        try:
            if objects is None:  # a RubricGroup: the function's own rubric gives its objects
                owner = next(r for r in self.vf.rubric.rubrics if any(f is fn for f in r.funcs))
                objects = owner.score_objects(self.state)
            params = inspect.signature(fn).parameters
            if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                objects = {k: v for k, v in objects.items() if k in params}
            value = fn(**objects)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, timeout=60.0)
            return float(value)
        except Exception as e:
            raise RewardError(f"verifiers environment `{self.vf_id}`: rubric function `{name}` raised "
                              f"{type(e).__name__}: {e}") from e
