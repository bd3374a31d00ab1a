"""The trainer's computation on a thread that ends with each call, when it shares a process with
an engine (placement.mode=local, or any rank under a launcher).

With libgomp, every thread that runs a parallel torch op keeps an OpenMP team for as long as it
lives; `on_own_thread` keeps the trainer's team from outliving its call (the reason and the
measurement are in its docstring). It is the trainer's concern, not the loop's: the loop calls
the trainer on whatever thread it runs on.
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

    began, ended = threading.Event(), threading.Event()

    def run() -> None:
        _here.inside = True
        began.set()
        try:
            if not box.get("stop"):  # a signal on the caller while this thread started: fn never runs
                box["out"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            box["err"] = e
        finally:
            ended.set()

    # Waited for through events of its own, not Thread.join: a KeyboardInterrupt inside join()
    # makes Python 3.11 mark the thread stopped while it still runs (bpo-45274's cleanup).
    thread = threading.Thread(target=run, name="tidal-trainer", daemon=True)
    try:
        thread.start()  # a signal may land while it waits for the thread to start, too
        while not ended.wait(0.1):  # wakes to run signal handlers: a signal may land on another thread
            pass
    except BaseException as e:
        box["stop"] = True
        if began.wait(5.0) and not ended.is_set():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(type(e)))
            ended.wait()
        raise
    thread.join()  # it has ended: only its last bytecodes are left
    if "err" in box:
        raise box["err"]
    return box["out"]
