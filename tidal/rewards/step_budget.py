"""A step's failure budget, kept while the step runs, so that a step whose rewards fail past
`reward.failure_budget` stops waiting for the rest of them.

The run-level budget (tidal/runtime/health.py, the run) decides after the step whether the run stops;
this one stops the step itself early. `Rollout.run` opens a `StepBudget` for its episodes
(a context variable: every episode task of the step sees it, and nothing else does); each
episode that ends failed is counted, and once more than `failure_budget` of the step's
episodes failed, the rewards still being computed or not yet started are given up: their
episodes end `reward_error` saying why, never scored 0. An always-hanging reward then costs
a step about ⌈(failure_budget × episodes + 1) / (workers × sync lanes)⌉ timeouts instead of
⌈episodes / (workers × sync lanes)⌉ (docs/rewards.md, "The worst case of a step").

`failure_budget` 1.0 keeps no budget (every reward is waited for), as evaluation does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")

_CURRENT: ContextVar[StepBudget | None] = ContextVar("tidal_step_budget", default=None)


class StepBudget:
    """The failures of one step's `n` episodes so far, against `budget` (a fraction)."""

    def __init__(self, n: int, budget: float):
        self.n, self.budget = n, budget
        self.failed = 0
        self.first = ""  # the first failure's error, named when the step gives up
        self.spent = asyncio.Event()

    def record(self, episode: Any) -> None:
        """An episode of the step ended."""
        if episode.status.trainable:
            return
        self.failed += 1
        self.first = self.first or episode.error
        if self.failed > self.budget * self.n:
            self.spent.set()

    def why(self) -> str:
        return (f"not scored: {self.failed} of the step's {self.n} episodes had failed, over reward.failure_budget="
                f"{self.budget:g}, so the step stopped waiting for its rewards (first failure: {self.first})")


def open_budget(n: int, budget: float):
    """Start counting the failures of the `n` episodes about to run in this context (a token
    for `close_budget`); None where `budget` is 1.0 (no budget)."""
    return _CURRENT.set(StepBudget(n, budget) if budget < 1.0 and n else None)


def close_budget(token) -> None:
    _CURRENT.reset(token)


def current() -> StepBudget | None:
    return _CURRENT.get()


async def unless_spent(aw: Awaitable[T]) -> T | None:
    """`aw`'s result, or None when the step's budget is (or becomes) spent first: then `aw`
    is cancelled (a reward call in flight is dropped by its pool, tidal/rewards/pool_base.py)."""
    budget = _CURRENT.get()
    if budget is None:
        return await aw
    task = asyncio.ensure_future(aw)
    if budget.spent.is_set():
        task.cancel()
        return None
    stop = asyncio.ensure_future(budget.spent.wait())
    try:
        done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if task in done:
        return task.result()
    task.cancel()
    return None
