"""The deadline of math-verify's parse and comparison in a process's main thread (used by
tidal/rewards/math.py): SIGALRM, repeated until the block ends, because math-verify's single
alarm can be swallowed. Only the main thread may set it; in worker threads the math reward's
cost bounds (tidal/rewards/math_exact.py) are the guard."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any


class OutOfTime(BaseException):
    """Raised by the deadline's alarm. A BaseException, so that no `except Exception` inside
    math-verify or sympy turns it into a result."""


REFIRE_S = 0.05  # the alarm repeats until the deadline is cleared


@contextlib.contextmanager
def deadline(seconds: int | None) -> Iterator[None]:
    """Raise OutOfTime in the block after `seconds` (None: no deadline). math-verify's own
    timeout is one SIGALRM whose exception can land where Python ignores it (a weakref
    callback during garbage collection: seen in CI, the parse then ran to completion and the
    answer counted as correct); this alarm fires again every REFIRE_S until the block ends,
    so a swallowed one is followed by another.

    A swallowed alarm goes to `sys.unraisablehook`. For the block's length a hook drops it
    (it is expected, and the next alarm ends the block) and hands any other unraisable
    exception to the hook that was there, with the alarm held off meanwhile: a repeat that
    landed inside that hook (reading source lines to format a traceback: seen in CI) would
    break it."""
    if seconds is None:
        yield
        return
    armed, in_hook = [True], [False]

    def fire(signum: int, frame: Any) -> None:
        if armed[0] and not in_hook[0]:
            raise OutOfTime

    previous_hook = sys.unraisablehook

    def unraisable(args: Any) -> None:
        if issubclass(args.exc_type, OutOfTime):
            return
        in_hook[0] = True
        try:
            previous_hook(args)
        finally:
            in_hook[0] = False

    previous = signal.signal(signal.SIGALRM, fire)
    sys.unraisablehook = unraisable
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds, REFIRE_S)
        yield
    finally:
        while True:  # an alarm may still land here, before `armed` is cleared: clear it again
            try:
                armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                if sys.unraisablehook is unraisable:  # unless something in the block replaced it
                    sys.unraisablehook = previous_hook
                break
            except OutOfTime:
                continue
