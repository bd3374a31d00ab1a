"""Guess the number: a complete multi-turn tidal environment (docs/agents.md).

    tidal train task.env=examples/envs/guess.py:GuessEnv rollout.max_turns=4
"""

import random
import re

from tidal.envs.base import Action, StepResult

GUESS = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


class GuessEnv:
    name = "guess"
    default_reward = None  # the per-turn rewards below are the whole reward

    def __init__(self, row: dict, seed: int = 0, high: int = 99):
        self.row, self.secret, self.high = row, int(row["secret"]), high

    @classmethod
    def rows(cls, split: str, n: int, seed: int, high: int = 99) -> list[dict]:
        """The task's own rows when `task.dataset` is not set; train and test differ by seed."""
        rng = random.Random(f"guess-{split}-{seed}")
        return [{"prompt": f"Guess my number from 0 to {high}. Answer <answer>N</answer>.",
                 "secret": rng.randint(0, high), "task_id": f"guess-{split}-{i}"} for i in range(n)]

    async def reset(self) -> list[dict]:
        return [{"role": "user", "content": self.row["prompt"]}]

    async def step(self, action: Action) -> StepResult:
        found = GUESS.search(action.text)
        if found is None:  # the policy sees what went wrong, and pays a little for it
            return StepResult(messages=[{"role": "user", "content": "Answer <answer>N</answer>."}],
                              reward=-0.1, reward_parts={"penalty": -0.1}, done=False)
        guess = int(found.group(1))
        if guess == self.secret:
            return StepResult(reward=1.0, reward_parts={"correct": 1.0}, done=True)
        hint = "higher" if guess < self.secret else "lower"
        return StepResult(messages=[{"role": "user", "content": f"No, {hint}."}],
                          reward=-0.1, reward_parts={"penalty": -0.1}, done=False)

    async def close(self) -> None:
        pass  # nothing to release; a sandboxed env closes its session here
