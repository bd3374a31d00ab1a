"""A single-turn environment over one dataset row, scored by a reward function.

The row's `prompt` (text or chat messages) opens the episode; every other column reaches
the reward function as a keyword argument (the TRL convention), e.g.
`score(completion, answer="42", task_id="...")`.
"""

from __future__ import annotations

from typing import Any

from tidal.envs.base import Message, RewardError, StepResult
from tidal.rewards import RewardFn, call_reward_async, reward_name


def prompt_messages(prompt: Any) -> list[Message]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]


class SingleTurnEnv:
    def __init__(self, row: dict[str, Any], reward_fn: RewardFn, name: str = "single_turn"):
        self.row = row
        self.reward_fn = reward_fn
        self.name = name

    async def reset(self) -> list[Message]:
        return prompt_messages(self.row["prompt"])

    async def step(self, action: str) -> StepResult:
        extra = {k: v for k, v in self.row.items() if k != "prompt"}
        try:
            total, parts = await call_reward_async(self.reward_fn, action, extra)
        except Exception as e:  # noqa: BLE001 - any failure of user code is typed, not fatal
            raise RewardError(f"reward function `{reward_name(self.reward_fn)}` raised {type(e).__name__}({e})") from e
        correct = parts["correct"] if "correct" in parts else float(total > 0)
        return StepResult(reward=total, reward_parts=parts, done=True, metrics={"correct": correct})
