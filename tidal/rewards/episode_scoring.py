"""Scoring a finished episode: its RewardInput, the meeting point of a group whose reward is
batched, the outcome folded into the Episode, and its accuracy.

The rollout (tidal/runtime/rollout.py) calls these once an episode's environment is done. The
choice: a reward that fails, times out or is given up on by the step's failure budget
(step_budget.py) types the episode (`timeout`, `reward_error`, with the reason) and is never
scored 0; accuracy is read from a `correct` part only, so a reward that has none (a reward
model, a judge) says nothing of correctness.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import Any

from tidal.monitor import trace
from tidal.rewards import step_budget
from tidal.rewards.contract import RewardInput, RewardOutcome
from tidal.types import Episode, Status


class GroupScoring:
    """The members of one group meet here when a batched (TRL-form) reward scores them
    together: scoring starts once every member has either arrived or left (failed earlier)."""

    def __init__(self, size: int):
        self.size = size
        self.arrived: list[tuple[RewardInput, asyncio.Future]] = []
        self.submitted: set[str] = set()  # episode ids that reached scoring (the others leave)
        self.left = 0
        self.task: asyncio.Task | None = None  # held: the loop keeps only a weak reference to tasks

    def _maybe_start(self, scorer) -> None:
        if len(self.arrived) + self.left == self.size and self.arrived:
            self.task = asyncio.get_running_loop().create_task(self._score(scorer, list(self.arrived)))
            self.arrived = []

    async def _score(self, scorer, members) -> None:
        try:
            outcomes = await scorer.score([i for i, _ in members])
        except Exception as e:  # noqa: BLE001 - a scorer bug types the episodes, never hangs them
            outcomes = [RewardOutcome("reward_error", error=f"reward scorer failed: {type(e).__name__}({e})")] * len(members)
        for (_, fut), out in zip(members, outcomes):
            if not fut.done():
                fut.set_result(out)

    async def submit(self, scorer, inp: RewardInput) -> RewardOutcome:
        fut = asyncio.get_running_loop().create_future()
        self.arrived.append((inp, fut))
        self._maybe_start(scorer)
        return await fut

    def leave(self, scorer) -> None:
        self.left += 1
        self._maybe_start(scorer)


def reward_input(ep: Episode, row: dict[str, Any], prompt_text: str, prompt_messages: list[dict[str, Any]],
                 history: list[dict[str, Any]], last_text: str) -> RewardInput:
    """What the rewards see of `ep`, an episode of the dataset row `row`."""
    policy_ids = [t for tr in ep.turns for t in ep.tokens[tr.start:tr.end]]
    turns = [{"index": t.index, "text": t.text, "finish_reason": t.finish_reason, "reward": t.reward,
              "tool_calls": [asdict(c) for c in t.tool_calls]} for t in ep.turns]
    columns = {k: v for k, v in row.items() if k != "prompt"}
    return RewardInput(ep.episode_id, ep.group_id, ep.task_id, ep.step, prompt_text, prompt_messages, last_text,
                       policy_ids, list(history), turns, columns)


async def score_episode(scorer, ep: Episode, inp: RewardInput, group: GroupScoring | None) -> tuple[Status, str] | None:
    """The task's rewards on `ep` (through its group's meeting point when the reward is batched),
    added to its reward, reward parts and metrics; or the (status, reason) its failure types it
    with, its reward left unset."""
    t3 = time.perf_counter()
    async with trace.async_span("reward", ep.episode_id):
        if group is not None:
            group.submitted.add(ep.episode_id)
            outcome = await step_budget.unless_spent(group.submit(scorer, inp))
        else:
            outcomes = await step_budget.unless_spent(scorer.score([inp]))
            outcome = None if outcomes is None else outcomes[0]
    ep.metrics["reward_s"] = time.perf_counter() - t3
    if outcome is None:  # the step's rewards failed past reward.failure_budget: not waited for
        budget = step_budget.current()
        return Status.REWARD_ERROR, budget.why() if budget else "not scored"
    if outcome.status != "ok":
        return Status.TIMEOUT if outcome.status == "timeout" else Status.REWARD_ERROR, outcome.error
    ep.outcome_reward = outcome.reward
    ep.reward += outcome.reward
    for k, v in outcome.parts.items():
        ep.reward_parts[k] = ep.reward_parts.get(k, 0.0) + v
    ep.metrics.update(outcome.metrics)
    return None


def set_accuracy(ep: Episode, scored: bool) -> None:
    """`ep.metrics["correct"]`: the reward functions' unweighted `correct` (parts are stored
    weighted), else the `correct` part of the environment's rewards, else, for an environment
    that is its own reward (`scored` False: no task rewards ran), whether the reward is
    positive. Rewards without a `correct` part (a reward model, a judge) say nothing of
    correctness: the episode has no `correct` then."""
    correct = ep.metrics.get("correct") if "correct" in ep.metrics else correct_part(ep.reward_parts)
    if correct is None and not scored:
        correct = float(ep.reward > 0)
    if correct is not None:
        ep.metrics["correct"] = correct


def correct_part(parts: dict[str, float]) -> float | None:
    """The reward part that defines accuracy: `correct`, else the first `<name>/correct`."""
    if "correct" in parts:
        return parts["correct"]
    for k, v in parts.items():
        if k.endswith("/correct"):
            return v
    return None
