"""The asynchronous loop, `rollout.max_staleness` = k > 0: a producer thread rolls out ahead of
the learner, and the learning thread learns the steps in order.

The choice: the same two parts as the synchronous step (the controller's `_produce` and
`_learn`, passed in), joined by a bounded queue of k+1 steps, not a second loop of their own.
The producer starts step s once the engines hold the weights of step s-1-k (admission
control: nothing is generated that could not be trained within the bound). k = 0 never comes
here: the controller's `train` calls `train_step` in a plain loop on its own thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from tidal.monitor.progress import Progress
from tidal.runtime.inflight import Ahead


class Overlap:
    """When the producer thread was rolling out, for `time/overlap`: the fraction of a step's
    learning during which the engines were generating."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[tuple[float, float]] = []  # rollouts that ended
        self._since = 0.0  # start of the rollout in progress; 0 when none is

    def begin(self) -> None:
        with self._lock:
            self._since = time.perf_counter()

    def end(self) -> None:
        with self._lock:
            self._spans.append((self._since, time.perf_counter()))
            self._since = 0.0

    def fraction(self, t0: float, t1: float) -> float:
        """Fraction of [t0, t1] (a step's learning) during which a rollout ran."""
        with self._lock:
            spans = list(self._spans) + ([(self._since, t1)] if self._since else [])
            self._spans = [(a, b) for a, b in self._spans if b > t1]
        busy = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans)
        return busy / max(t1 - t0, 1e-9)


def train_ahead(first: int, last: int, k: int, produce: Callable[[int], Any], learn: Callable[..., dict[str, float]],
                restored: Callable[[int], Any | None], ahead: Ahead, overlap: Overlap,
                bar: Progress) -> dict[str, float]:
    """Steps `first`..`last`: `produce(step)` on a producer thread (`restored(step)` instead for a
    step a checkpoint kept ahead, rolled out with the weights of then), `learn(sampled,
    trainer_wait=...)` on this thread, in order. `ahead` holds the steps handed over and not yet
    learned (for a checkpoint's `ahead.pkl`); `overlap` records when the producer rolled out.
    Returns the last step's metrics; an error of the producer is raised here."""
    handoff: queue.Queue = queue.Queue(maxsize=k + 1)
    stop = threading.Event()
    published = threading.Condition()
    state = {"published": first - 1}  # the last step whose weights are on the engines

    def hand_over(item) -> None:
        """Put into the bounded queue, giving up once the learning thread has stopped."""
        while not stop.is_set():
            try:
                handoff.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def producer() -> None:
        try:
            for step in range(first, last + 1):
                kept = restored(step)
                if kept is not None:
                    hand_over(kept)
                    continue
                t0 = time.perf_counter()
                with published:  # admission: weights of step-1-k are on the engines
                    while state["published"] < step - 1 - k and not stop.is_set():
                        published.wait(0.1)
                if stop.is_set():
                    return
                wait = time.perf_counter() - t0
                overlap.begin()
                sampled = produce(step)
                overlap.end()
                sampled.admission_wait = wait
                ahead.add(sampled)
                hand_over(sampled)
        except BaseException as e:  # noqa: BLE001 - the learning thread raises it
            hand_over(e)
        finally:
            ahead.stop()

    thread = threading.Thread(target=producer, name="tidal-rollout", daemon=True)
    ahead.start()
    thread.start()
    metrics: dict[str, float] = {}
    try:
        for step in range(first, last + 1):
            t0 = time.perf_counter()
            item = handoff.get()
            if isinstance(item, BaseException):
                raise item
            metrics = learn(item, trainer_wait=time.perf_counter() - t0)
            ahead.learned(step)
            with published:
                state["published"] = step
                published.notify_all()
            bar.update(step, metrics)
    finally:
        stop.set()
        thread.join(timeout=5.0)  # mid-rollout it ends when the engines close
    return metrics
