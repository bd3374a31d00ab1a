"""The environment protocol: what a rollout talks to between generations.

An environment speaks chat messages, never tokens: `reset` gives the opening messages,
`step` takes the decoded text of one policy turn and answers with the messages to append
(tool results, a user reply) or ends the episode. The rollout worker owns tokenization, so
tokens of earlier turns are never re-tokenized (DESIGN.md, token in, token out). A
single-turn task ends at its first `step`; a multi-turn or tool-using one returns
`done=False` with more messages, through the same two calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

Message = dict[str, str]  # {"role": ..., "content": ...}


@dataclass
class StepResult:
    messages: list[Message] = field(default_factory=list)  # appended before the next turn
    reward: float = 0.0  # added to the episode's reward
    reward_parts: dict[str, float] = field(default_factory=dict)
    done: bool = True
    metrics: dict[str, float] = field(default_factory=dict)


class Env(Protocol):
    name: str

    async def reset(self) -> list[Message]: ...

    async def step(self, action: str) -> StepResult: ...


class RewardError(Exception):
    """The reward function raised: the episode ends `reward_error`, never scored 0."""
