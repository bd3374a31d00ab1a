"""Reward functions and how they are loaded: `task.reward` (or each `task.rewards[i].fn`)
names a dotted path `my_pkg.rewards:score` or a file path `path/to/rewards.py:score`; with
`args` the named attribute is a class or factory, called once with `**args` to make the
reward (a class without `args` is instantiated with none).

The calling conventions (forms) and their checks are in `tidal/rewards/forms.py`; the
worker pool that runs rewards with hard timeouts is `tidal/rewards/pool.py` (`build_scorer`).
`call_reward`/`call_reward_async` call a `tidal`-form function directly (tests, simple
scripts): a dict gives named parts whose sum is the reward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., Any]


def import_object(path: str, key: str = "") -> Any:
    """Import `pkg.module:attr` (or `pkg.module.attr`, or `path/to/file.py:attr`), with an
    error that says what failed (and names `key` when given)."""
    from tidal.importing import import_object as _import

    return _import(path, key)


def load_reward(spec: Any, key: str = "task.reward") -> RewardFn:
    """The reward a RewardSpec names (anything with `fn` and `args`): the attribute itself,
    or, with `args` (or when it is a class), what calling it with `**args` returns. Every
    failure is a ValueError naming `key` and what failed."""
    where = f"`{key}`: "
    try:
        obj = import_object(spec.fn, key)
    except ValueError:
        raise
    except Exception as e:  # the module itself raised while being imported
        raise ValueError(f"{where}importing `{spec.fn}` raised {type(e).__name__}({e})") from e
    args = dict(getattr(spec, "args", None) or {})
    if args or inspect.isclass(obj):
        if not callable(obj):
            raise ValueError(f"{where}`{spec.fn}` is not a class or factory, so it cannot take args {sorted(args)}")
        try:
            obj = obj(**args)
        except Exception as e:
            raise ValueError(f"{where}`{spec.fn}(**{args!r})` raised {type(e).__name__}({e})") from e
    if not callable(obj):
        raise ValueError(f"{where}reward `{spec.fn}` is not callable (it is a {type(obj).__name__})")  # noqa: TRY004
    try:
        obj.__tidal_name__ = spec.fn  # type: ignore[attr-defined]
    except (AttributeError, TypeError):  # a builtin or a slotted object: the name comes from the spec
        pass
    return obj


def load_reward_fn(path: str, key: str = "") -> RewardFn:
    """The function at a dotted or file path (no factory call), as `task.reward` names it."""
    fn = import_object(path, key)
    if not callable(fn):
        raise ValueError(f"reward `{path}` is not callable")  # noqa: TRY004 - a config error, as the others
    fn.__tidal_name__ = path  # type: ignore[attr-defined]
    return fn


def reward_name(fn: RewardFn) -> str:
    return getattr(fn, "__tidal_name__", getattr(fn, "__qualname__", repr(fn)))


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
    from tidal.rewards.forms import accepted_keywords

    accepted = accepted_keywords(fn)
    return columns if accepted is None else {k: v for k, v in columns.items() if k in accepted}


def _total_and_parts(out: Any) -> tuple[float, dict[str, float]]:
    from tidal.rewards.forms import TIDAL_FORM, check_sample

    scored = check_sample(TIDAL_FORM, out)
    return scored.value, scored.parts
