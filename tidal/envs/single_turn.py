"""A single-turn environment over one dataset row: the row's `prompt` (text or chat
messages) opens the episode and the policy's first turn ends it. The reward comes from the
task's reward functions (`task.reward`), which see the completion and the row's columns."""

from __future__ import annotations

from typing import Any

from tidal.envs.arithmetic import ArithmeticConfig, make_problems
from tidal.envs.base import Action, Message, StepResult


def prompt_messages(prompt: Any) -> list[Message]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


class SingleTurnEnv:
    name = "single_turn"
    default_reward: str | None = None  # a dataset task names its reward in task.reward

    def __init__(self, row: dict[str, Any], seed: int = 0):
        self.row, self.seed = row, seed

    async def reset(self) -> list[Message]:
        return prompt_messages(self.row["prompt"])

    async def step(self, action: Action) -> StepResult:
        return StepResult(done=True)

    async def close(self) -> None:
        pass


class ArithmeticEnv(SingleTurnEnv):
    """The default task: generated arithmetic problems (tidal/envs/arithmetic.py), scored by
    the exact answer plus a format part. Its `task.env_args` are the problem distribution
    (ArithmeticConfig: min_digits, max_digits, ops); they shape the rows, not the episode."""

    name = "arithmetic"
    default_reward = "tidal.rewards.arithmetic:score"

    def __init__(self, row: dict[str, Any], seed: int = 0, **problem_args: Any):
        ArithmeticConfig(**problem_args)  # a misspelt or out-of-range setting is named at build_task
        super().__init__(row, seed)

    @classmethod
    def rows(cls, split: str, n: int, seed: int, **problem_args: Any) -> list[dict[str, Any]]:
        return make_problems(ArithmeticConfig(**problem_args), split, n, seed)
