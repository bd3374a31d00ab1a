"""The reward scorers: user reward code runs where a hung call can be killed.

`build_scorer(specs, cfg, ray_handles=...)` gives one of:

- `ProcessScorer` (reward.isolation=process, the default): `reward.workers` worker processes
  (`python -m tidal.rewards.worker`, each its own process group) that import the rewards once
  at start; the scorer fails at start, naming the key, when one cannot be imported.
- `RayScorer` (the same, placement.reward_workers Ray actors in ray mode).
- `InlineScorer` (reward.isolation=inline): the same adapters in the caller's event loop, for
  breakpoints. Async rewards are bounded by asyncio timeouts; a synchronous reward that hangs
  there hangs the rollout (nothing can stop a Python thread from outside).

How the pools work. `score(inputs)` turns each reward into calls: one per input for the
per-sample forms (tidal, veRL), one per group for TRL's batched form. Calls go to the
least-loaded worker; each worker serves up to `reward.max_concurrency` async calls at once
and runs synchronous ones in `reward.sync_concurrency` sync lanes, each a thread that runs its
calls one at a time, in order (the driver picks the lane and holds at most LANE_DEPTH calls
on one). Every call in flight has a deadline `reward.timeout_s + GRACE_S`, counted from when
it starts (a synchronous call starts when the one before it in its lane answers). A worker
that reports a hung call has a stuck lane: the call ends `timeout`, the calls queued behind it
are sent elsewhere, a replacement starts, and the worker, serving on its other lanes until the
replacement is ready, is killed (SIGKILL to its process group, so a subprocess the reward
started dies with it) once its other calls are answered; hung calls thus time out together.
A worker that misses a deadline (a hang holding the GIL) is killed at once and replaced; the
call that hung ends `timeout` (several lanes running: each runs again alone, which tells);
the other calls it held are sent again. A worker that dies on its
own (a segfault, `os._exit`) is replaced the same way, and its crash is charged to the call it
was running alone (a process worker tells which, through memory it shares with the driver):
that call ends `reward_error` naming the crash and is not retried; every other call it held is
sent again unchanged. Where several calls may have been running (async rewards), each runs
again alone, which tells. Each worker has limits (tidal/rewards/limits.py): memory and
processes (its own cgroup), recycling after `reward.worker_max_calls` calls or past
`reward.worker_max_rss_mb`, and its output captured into train.log, bounded. Nothing waits forever: a replacement that cannot start fails the calls waiting
for it, and `close()` stops every worker.

The two backends: worker processes in tidal/rewards/pool_process.py, Ray actors in
tidal/rewards/pool_ray.py; both build on `PoolScorer` (tidal/rewards/pool_base.py).

IPC is batched: the calls of one `score` sent to one worker travel in one message (inputs
once, whatever the number of rewards), and the answers that finish together come back in one.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from tidal.rewards.contract import RewardInput, RewardOutcome
from tidal.rewards.forms import OncePerStep, default_keys, spec_data
from tidal.rewards.pool_base import PoolScorer, RewardLoadError, calls_of, outcomes
from tidal.rewards.pool_process import ProcessPool
from tidal.rewards.pool_ray import RayPool
from tidal.rewards.worker import RewardHost

__all__ = ["InlineScorer", "ProcessScorer", "RayScorer", "RewardLoadError", "build_scorer", "spec_keys"]


def build_scorer(specs: list, cfg, *, ray_handles=None, keys: list[str] | None = None):
    """The scorer for `specs` (RewardSpec, in order) under `cfg` (RewardConfig). `ray_handles`:
    the `RewardActors` of placement (Roles.reward_handles in ray mode); None or empty: local
    worker processes. `keys` names each spec's config key in errors (default: `task.reward` for
    one spec, `task.rewards[i].fn` for several; see `spec_keys`). Blocks until the workers are
    ready; raises RewardLoadError (a ValueError) naming the key when a reward cannot be loaded."""
    keys = keys or default_keys(len(specs))
    data = [spec_data(s, k) for s, k in zip(specs, keys)]
    if cfg.isolation == "inline":
        return InlineScorer(data, cfg)
    if ray_handles:
        return RayScorer(data, cfg, ray_handles)
    return ProcessScorer(data, cfg)


def spec_keys(task_cfg) -> list[str]:
    """The config key of each of `task_cfg.reward_specs(...)`: `task.rewards[i].fn`, or `task.reward`."""
    if task_cfg.rewards:
        return [f"task.rewards[{i}].fn" for i in range(len(task_cfg.rewards))]
    return ["task.reward"]


# -- inline ------------------------------------------------------------------------------------
class InlineScorer:
    """Rewards in the caller's event loop (reward.isolation=inline)."""

    def __init__(self, specs: list[dict[str, Any]], cfg):
        self.host = RewardHost(specs, cfg.timeout_s, sync_in_thread=False)
        self.rewards = self.host.rewards
        self.per_group = any(r.form == "trl" for r in self.rewards)
        self.logged = OncePerStep()  # a failure's traceback: once per distinct error and step

    async def score(self, inputs: list[RewardInput]) -> list[RewardOutcome]:
        if not inputs:
            return []
        calls = calls_of(self.rewards, inputs)
        runs = [self.host.run(si, [inputs[j] for j in rows]) for si, rows in calls]
        answers = [await runs[0]] if len(runs) == 1 else await asyncio.gather(*runs)
        return outcomes(self.rewards, inputs, calls, [a for a, _ in answers], self.logged)

    async def close(self) -> None:
        await self.host.close()


# -- what build_scorer returns -----------------------------------------------------------------
class _Scorer:
    """The pool behind a handle that nothing inside the pool refers to: a scorer that is
    dropped without `close()` (a run that ends without closing) still stops its workers once
    it is collected, or at interpreter exit."""

    def __init__(self, pool: PoolScorer):
        self._pool = pool
        self._finalizer = weakref.finalize(self, pool.shutdown)
        self.rewards, self.per_group = pool.rewards, pool.per_group

    async def score(self, inputs: list[RewardInput]) -> list[RewardOutcome]:
        return await self._pool.score(inputs)

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        self._finalizer()  # runs pool.shutdown once

    def pids(self) -> list[int]:
        """Process ids of the live workers, by slot."""
        return self._pool.pids()

    @property
    def served(self) -> list[int]:
        """Calls answered, per worker slot."""
        return self._pool.served

    @property
    def restarts(self) -> int:
        """Workers replaced so far (killed for a hung call, or died)."""
        return self._pool.restarts

    @property
    def recycled(self) -> int:
        """Workers retired after reward.worker_max_calls calls or past reward.worker_max_rss_mb."""
        return self._pool.recycled

    @property
    def crashes(self) -> int:
        """Calls charged with the crash of their worker (each ended `reward_error`)."""
        return self._pool.crashes


class ProcessScorer(_Scorer):
    """Rewards in `reward.workers` worker processes on this machine."""

    def __init__(self, specs: list[dict[str, Any]], cfg):
        super().__init__(ProcessPool(specs, cfg))


class RayScorer(_Scorer):
    """Rewards in Ray reward actors (placement.reward_workers), started through `actors`."""

    def __init__(self, specs: list[dict[str, Any]], cfg, actors):
        super().__init__(RayPool(specs, cfg, actors))
