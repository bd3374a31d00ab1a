"""A simulated run's `trace.json`, in the format a real run writes with `run.trace=true`
(`tidal/monitor/trace.py`: Chrome trace events, microseconds): the same span names and categories
(`rollout`/generate and `train`/train and `sync`/sync and `save`/save as complete events on the
driver's threads, `generate` and `reward` as async events keyed by episode id `s{step}-p{group}-e{i}`),
so a simulated and a measured step open side by side in Perfetto or the dashboard. The choice: per
episode events only for the first `max_episode_events` episodes of a step (a 4,096-GPU step has tens of
thousands), the step-level spans always.
"""

from __future__ import annotations

import json
from pathlib import Path

from tidal.plan.loop import SimResult

PID, ROLLOUT_TID, LEARN_TID = 1, 1, 2


def trace_events(r: SimResult, max_episode_events: int = 256) -> list[dict]:
    us = 1e6
    ev: list[dict] = [{"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": "driver (simulated)"}}]
    spp = r.spec.workload.samples_per_prompt

    def span(name: str, cat: str, t0: float, t1: float, tid: int, **args) -> None:
        ev.append({"name": name, "cat": cat, "ph": "X", "ts": t0 * us, "dur": max(0.0, t1 - t0) * us, "pid": PID,
                   "tid": tid, "args": args})

    for x in r.records:
        span("rollout", "generate", x.rollout_start, x.rollout_end, ROLLOUT_TID, step=x.step)
        span("train", "train", x.train_start, x.train_end, LEARN_TID, step=x.step)
        span("sync", "sync", x.train_end, x.sync_end, LEARN_TID, step=x.step)
        if x.learn_end > x.sync_end:
            span("save", "save", x.sync_end, x.learn_end, LEARN_TID, step=x.step)
        finish = x.episode_finish if x.episode_finish is not None else []
        for i, f in enumerate(finish[:max_episode_events]):
            key = f"s{x.step}-p{i // spp}-e{i % spp}"
            base = {"cat": "episode", "id": key, "pid": PID, "tid": ROLLOUT_TID}
            ev.append({**base, "name": "generate", "ph": "b", "ts": x.rollout_start * us, "args": {"turn": 0}})
            ev.append({**base, "name": "generate", "ph": "e", "ts": (x.rollout_start + f) * us})
    return ev


def write_trace(r: SimResult, path: str | Path, max_episode_events: int = 256) -> int:
    """Write `path` (trace.json) as `tidal.monitor.trace.assemble` does; returns the number of events."""
    events = trace_events(r, max_episode_events)
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return len(events)
