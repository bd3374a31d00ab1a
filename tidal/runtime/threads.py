"""Running the trainer's work on a thread of its own (see `on_own_thread`).

Used inside the trainer (trainer_group.py: every call of a trainer in this process) and the
in-process weight sync (sync.py), not by the loop: the loop runs on the calling thread.
"""

from __future__ import annotations

import ctypes
import threading

_here = threading.local()  # `inside` on a thread that on_own_thread started


def on_own_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a thread that ends with it; its result, or its exception raised here.
    Called on such a thread already, fn runs right there.

    Why: with libgomp, every thread that runs a parallel torch op keeps an OpenMP team for as long
    as it lives, and once the teams hold more threads than the machine has cores, libgomp stops
    letting idle workers spin, so every small op waits for a wake-up. A team on the run's main
    thread would outlive the update and throttle the engine's decode steps on the scheduler
    thread, which likewise ends when idle (docs/engines.md, "Shared prompts, the heap and
    OpenMP"). Measured on the default job, best settings: the engine's decode time per step
    15-20% lower.

    Ctrl-C and SIGTERM raise on the calling (main) thread while it waits: the same exception is
    then raised inside fn's thread (CPython's PyThreadState_SetAsyncExc, at its next bytecode, as a
    signal handler would on the main thread), that thread is waited for, and the exception goes
    on. So an update is stopped where it is, as when it ran on the main thread, and nothing of it
    runs on after the run has reported its last complete checkpoint."""
    if getattr(_here, "inside", False):
        return fn(*args, **kwargs)
    box: dict = {}

    def run() -> None:
        _here.inside = True
        try:
            box["out"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            box["err"] = e

    thread = threading.Thread(target=run, name="tidal-trainer", daemon=True)
    thread.start()
    try:
        while thread.is_alive():  # wakes to run signal handlers: a signal may land on another thread
            thread.join(0.1)
    except BaseException as e:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(type(e)))
        thread.join()
        raise
    if "err" in box:
        raise box["err"]
    return box["out"]
