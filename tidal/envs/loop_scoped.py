"""Objects that belong to one event loop: a sandbox pool, a browser pool.

A run makes a loop per step (local mode) or keeps one per actor (Ray), and these pools hold
loop-bound things (asyncio primitives, Playwright's objects, processes waited on by the
loop). `loop_scoped(key, make)` gives the running loop's object for `key`, made on first use,
and closes it (`await obj.close()`) when the loop shuts down its async generators
(`asyncio.run` does, before closing the loop); then it is forgotten, so no pool, loop or
thread outlives its loop (a WeakKeyDictionary by loop would not let go: a contended pool's
semaphore holds its loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

OBJECTS: dict[asyncio.AbstractEventLoop, dict[str, tuple[Any, Any]]] = {}


async def _lifetime(loop: asyncio.AbstractEventLoop, key: str, obj: Any):
    try:
        yield
    finally:  # the loop's shutdown_asyncgens: close the object and forget it
        objects = OBJECTS.get(loop, {})
        objects.pop(key, None)
        if not objects:
            OBJECTS.pop(loop, None)
        await obj.close()


async def loop_scoped(key: str, make: Callable[[], T]) -> T:
    """The running loop's object for `key` (`make()` on first use), closed with the loop."""
    loop = asyncio.get_running_loop()
    objects = OBJECTS.setdefault(loop, {})
    if key not in objects:
        obj = make()
        lifetime = _lifetime(loop, key, obj)
        objects[key] = (obj, lifetime)
        await lifetime.__anext__()  # started in this loop: the loop finalizes it at shutdown
    return objects[key][0]


async def close_all() -> None:
    """Close the running loop's objects now, while its tasks still run. At `asyncio.run`'s
    shutdown the loop's tasks are cancelled before its async generators are finalized, and an
    object that needs a task of its own to close (Playwright's connection reads its pipe in
    one) can then only be killed, not closed."""
    for _, lifetime in list(OBJECTS.get(asyncio.get_running_loop(), {}).values()):
        await lifetime.aclose()  # runs _lifetime's finally: forget the object, close it


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)`, closing the loop's objects (`close_all`) when `main` ends."""
    async def closing() -> T:
        try:
            return await main
        finally:
            await close_all()

    return asyncio.run(closing())
