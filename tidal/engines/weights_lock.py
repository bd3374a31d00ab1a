"""The torch engine's lock between generation and weight updates."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class WeightsLock:
    """Generation (shared) against weight updates (exclusive), updates first: once an update
    waits, no new holder gets the lock until it is done, so back-to-back decode steps or
    generate calls cannot starve it. Holders in the same thread must not nest."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.holders = 0  # shared holders now
        self.updates_waiting = 0
        self._updating = False

    def acquire_shared(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._updating and not self.updates_waiting)
            self.holders += 1

    def release_shared(self) -> None:
        with self._cond:
            self.holders -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        self.acquire_shared()
        try:
            yield
        finally:
            self.release_shared()

    @contextlib.contextmanager
    def exclusive(self, timeout_s: float, on_timeout: Callable[[int], Exception]) -> Iterator[None]:
        """Wait up to timeout_s for the shared holders to leave, then run the body alone.
        `on_timeout(holders)` builds the error raised when they do not."""
        with self._cond:
            self.updates_waiting += 1
            try:
                if not self._cond.wait_for(lambda: not self._updating and not self.holders, timeout_s):
                    raise on_timeout(self.holders)
                self._updating = True
            finally:
                self.updates_waiting -= 1
                self._cond.notify_all()  # after a timeout, shared holders waiting behind it may go
        try:
            yield
        finally:
            with self._cond:
                self._updating = False
                self._cond.notify_all()
