"""How a reward is loaded: the object a RewardSpec names (a dotted or file path), called with its
`args` when it is a class or factory, and named for errors and metrics (`reward_name`).

Plain code over tidal.importing, with no reward machinery, so that the forms (forms.py), the
worker (worker.py) and the package's helpers (tidal/rewards/__init__.py) all load alike.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from tidal.importing import import_object as _import_object

RewardFn = Callable[..., Any]


def import_object(path: str, key: str = "") -> Any:
    """Import `pkg.module:attr` (or `pkg.module.attr`, or `path/to/file.py:attr`), with an
    error that says what failed (and names `key` when given)."""
    return _import_object(path, key)


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
