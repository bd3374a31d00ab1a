"""Reward functions: `fn(completion: str, **row_columns) -> float | dict[str, float]`, or
`async def` (awaited by the environment; `tidal.rewards.code` runs code in the sandbox).

A dict gives named parts whose sum is the reward; a part named `correct` (0 or 1) is what
accuracy is measured on. Users name their own function by dotted path,
`my_pkg.rewards:score`, in `task.reward`.
"""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Any, Callable

RewardFn = Callable[..., Any]


def import_object(path: str) -> Any:
    """Import `pkg.module:attr` (or `pkg.module.attr`), with an error that says what failed."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"`{path}` is not a dotted path of the form `my_pkg.module:function`")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module `{module_name}` of `{path}`: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module `{module_name}` has no attribute `{attr}` (from `{path}`)") from None


def load_reward_fn(path: str) -> RewardFn:
    fn = import_object(path)
    if not callable(fn):
        raise ValueError(f"reward `{path}` is not callable")
    fn.__tidal_name__ = path  # type: ignore[attr-defined]
    return fn


def reward_name(fn: RewardFn) -> str:
    return getattr(fn, "__tidal_name__", getattr(fn, "__qualname__", repr(fn)))


def call_reward(fn: RewardFn, completion: str, columns: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """Call `fn` with the columns it accepts; return (total, parts). Raises on bad output."""
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
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return columns
    return {k: v for k, v in columns.items() if k in params}


def _total_and_parts(out: Any) -> tuple[float, dict[str, float]]:
    if isinstance(out, dict):
        parts = {str(k): float(v) for k, v in out.items()}
        total = sum(parts.values())
    else:
        total = float(out)
        parts = {}
    if not math.isfinite(total):
        raise ValueError(f"returned a non-finite reward {out!r}")
    return total, parts
