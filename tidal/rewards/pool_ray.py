"""The Ray backend of the reward pools: rewards in Ray actors (`RewardWorker`,
placement.reward_workers), each running them in a reward worker process of its own (the
process pool of tidal/rewards/pool_process.py inside the actor: crashes, limits, recycling and
output are handled there, as locally). How the pools work: tidal/rewards/pool.py.

With tidal/runtime/, the one place that imports Ray (docs/architecture.md, "Packages"): the
reward pool stays in tidal/rewards/ with its two backends, and the Ray one keeps Ray here,
including the lookup of a named reward-model actor (`named_actor`, for tidal/rewards/rm.py).
Ray is imported inside the functions that use it: a run without Ray placement never loads it."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import Any

from tidal.rewards.pool_base import (
    GRACE_S,
    RAY_ACTOR_CONCURRENCY,
    SYNC_DEPTH,
    Call,
    PoolScorer,
    Slot,
    unscored,
    wire,
)


# -- Ray reward actors -------------------------------------------------------------------------
class RayPool(PoolScorer):
    """Rewards in Ray actors (`RewardWorker`, placement.reward_workers). `actors` is
    placement's `RewardActors`: `spawn(i, specs, timeout_s)` starts the actor of slot i (in
    its placement-group bundle), also to replace one that was killed or died."""

    lane_exclusive = True  # Ray keeps the order of calls within one actor call, not across calls
    # The actor's own worker process answers a hung call `timeout` at reward.timeout_s and is
    # replaced; the driver's deadline is the backstop for an actor that stops answering at
    # all, past that answer and a replacement's start.
    grace_s = GRACE_S + 10.0
    lane_depth = SYNC_DEPTH  # the calls of one message: the actor's pool keeps its own lanes' depth

    def __init__(self, specs: list[dict[str, Any]], cfg, actors):
        self.actors = actors
        # Ray runs a future's callback in its own thread, or at once in ours when the future is
        # done already (with our lock held): every callback is handed to one thread instead.
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run_events, name="tidal-reward-ray", daemon=True).start()
        super().__init__(specs, cfg, int(actors.count), min(int(cfg.max_concurrency), RAY_ACTOR_CONCURRENCY - 4))
        self.max_calls = self.max_rss = 0  # the actor recycles its worker process; the actor lives on

    def lanes_of(self, cfg) -> int:
        """One lane in the driver's view of an actor: the actor's own pool spreads the calls over
        its worker's sync lanes, and this pool's deadlines are the backstop past its answers."""
        return 1

    def _run_events(self) -> None:
        while (event := self._events.get()) is not None:
            event()

    def _on(self, ref, handler) -> None:
        ref.future().add_done_callback(lambda f: self._events.put(lambda: handler(f)))

    def start_worker(self, slot: Slot) -> None:
        slot.transport = self.actors.spawn(slot.index, self.specs, self.timeout_s)
        self._on(slot.transport.ready.remote(), lambda f: self._ray_ready(slot, f))

    def _ray_ready(self, slot: Slot, f) -> None:
        try:
            info = f.result()
        except Exception as e:  # noqa: BLE001 - the actor's constructor raised (a reward failed to load) or it died
            with self.lock:
                self.on_start_failed(slot, _ray_cause(e))
                self.flush_wakes()
            return
        with self.lock:
            if "failed" in info:
                self.on_start_failed(slot, info["failed"], info.get("traceback", ""))
            else:
                self.on_ready(slot, info)
            self.flush_wakes()

    def send_calls(self, slot: Slot, calls: list[Call]) -> None:
        """One streaming actor call for the lot: answers come back in bunches as they finish
        (a synchronous call's answer tells that the next one started, as with the processes)."""
        gen = slot.transport.run_batch.options(num_returns="streaming").remote(wire(calls))
        threading.Thread(target=self._consume, args=(slot, gen, calls), name=f"tidal-reward-ray{slot.index}",
                         daemon=True).start()

    def _consume(self, slot: Slot, gen, calls: list[Call]) -> None:
        import ray
        from ray.exceptions import RayActorError

        try:
            for ref in gen:
                chunk = ray.get(ref)
                for name, level, message in chunk["log"]:  # the actor's worker output and messages: train.log
                    logging.getLogger(name).log(level, "%s: %s", slot, message)
                with self.lock:
                    self.on_results(slot, chunk["results"])
                    self.flush_wakes()
        except RayActorError as e:
            with self.lock:
                self.on_exit(slot, _ray_cause(e))
                self.flush_wakes()
        except Exception as e:  # noqa: BLE001 - the host itself failed: its calls are errors, not hangs
            why = f"the reward worker raised {_ray_cause(e)}"
            with self.lock:
                self.on_results(slot, [(c.id, unscored(why, len(c.inputs)), False) for c in calls])
                self.flush_wakes()

    def on_exit(self, slot: Slot, why: str, running: int | None = None) -> None:
        """The actor died (killed from outside, its node lost): not a reward's crash, which
        ends in its worker process. Its calls are sent again, none charged."""
        if slot.dead:
            return
        if not slot.ready:
            self.on_start_failed(slot, f"the actor died before it was ready ({why})")
            return
        self._lose(slot, f"its reward actor died ({why})", set())

    def kill_worker(self, slot: Slot) -> None:
        if slot.transport is not None:
            import ray

            with contextlib.suppress(Exception):  # already gone
                ray.kill(slot.transport, no_restart=True)

    def stop_workers(self, slots: list[Slot]) -> None:
        for s in slots:
            self.kill_worker(s)
        self._events.put(None)


def _ray_cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return str(cause) if isinstance(cause, ValueError) else f"{type(cause).__name__}({cause})"
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"


def named_actor(name: str, namespace: str | None = None):
    """The handle of the live Ray actor `name` (e.g. a `RewardModelActor` started by the user)."""
    import ray

    return ray.get_actor(name, namespace=namespace)
