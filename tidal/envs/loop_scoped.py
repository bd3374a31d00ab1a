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
import contextlib
import logging
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
    """`asyncio.run(main)`, closing the loop's objects (`close_all`) when `main` ends. On an
    interrupt (KeyboardInterrupt raised inside the loop: the CLI's SIGINT and SIGTERM handlers
    raise it wherever the main thread is) the loop's tasks are cancelled and run to their end
    before the interrupt goes on (`_drain`)."""
    async def closing() -> T:
        try:
            return await main
        finally:
            await close_all()

    runner = asyncio.Runner()
    try:
        return runner.run(closing())
    except KeyboardInterrupt:
        _drain(runner.get_loop())
        raise
    finally:
        runner.close()


def _drain(loop: asyncio.AbstractEventLoop, rounds: int = 20, wait_s: float = 1.0) -> None:
    """After an interrupt: cancel the loop's tasks and run them to their end (each `finally`
    runs, a pool is closed), bounded. asyncio.run's own shutdown does the same but stops at
    the first task that passes the interrupt on through a gather, leaving the rest to be
    destroyed pending: a "Task was destroyed but it is pending!" per episode on the console (a
    step of 256 episodes printed ~1000 lines after the stop message). What the tasks say while
    they end goes to the debug log: the interrupt has been reported once already."""
    log = logging.getLogger("tidal")
    loop.set_exception_handler(lambda _, ctx: log.debug("after the interrupt: %s", ctx.get("message")))
    for _ in range(rounds):
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if not pending:
            return
        for t in pending:
            t.cancel()
        with contextlib.suppress(KeyboardInterrupt):  # a task passed it on through a gather: go on
            loop.run_until_complete(asyncio.wait(pending, timeout=wait_s))
