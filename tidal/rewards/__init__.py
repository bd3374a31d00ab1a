"""Reward functions and how they are loaded: `task.reward` (or each `task.rewards[i].fn`)
names a dotted path `my_pkg.rewards:score` or a file path `path/to/rewards.py:score`; with
`args` the named attribute is a class or factory, called once with `**args` to make the
reward (a class without `args` is instantiated with none).

Loading is in `tidal/rewards/loading.py`; the calling conventions (forms) and their checks are
in `tidal/rewards/forms.py`; the worker pool that runs rewards with hard timeouts is
`tidal/rewards/pool.py` (`build_scorer`).
`call_reward`/`call_reward_async` call a `tidal`-form function directly (tests, simple
scripts): a dict gives named parts whose sum is the reward.
"""

from __future__ import annotations

import inspect
from typing import Any

from tidal.rewards.forms import TIDAL_FORM, accepted_keywords, check_sample
from tidal.rewards.loading import RewardFn, import_object, load_reward, load_reward_fn, reward_name

__all__ = ["RewardFn", "call_reward", "call_reward_async", "import_object", "load_reward", "load_reward_fn",
           "reward_name"]


def call_reward(fn: RewardFn, completion: str, columns: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """Call `fn` with the columns it accepts; return (total, parts). Raises on bad output
    (the same checks as the reward pool's, `tidal.rewards.forms`)."""
    out = fn(completion, **_accepted_columns(fn, columns))
    if inspect.isawaitable(out):
        if inspect.iscoroutine(out):
            out.close()
        raise TypeError("is async: call it with `await call_reward_async(...)`")
    return _total_and_parts(out)


async def call_reward_async(fn: RewardFn, completion: str, columns: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """`call_reward` for a function that may be async (e.g. one that runs code in the
    sandbox): awaited, so that the rewards of many episodes overlap."""
    out = fn(completion, **_accepted_columns(fn, columns))
    if inspect.isawaitable(out):
        out = await out
    return _total_and_parts(out)


def _accepted_columns(fn: RewardFn, columns: dict[str, Any]) -> dict[str, Any]:
    accepted = accepted_keywords(fn)
    return columns if accepted is None else {k: v for k, v in columns.items() if k in accepted}


def _total_and_parts(out: Any) -> tuple[float, dict[str, float]]:
    scored = check_sample(TIDAL_FORM, out)
    return scored.value, scored.parts
