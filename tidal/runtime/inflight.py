"""The steps the asynchronous loop has rolled out ahead of the learner, kept with a checkpoint
so that a resume continues exactly where the run was.

With `rollout.max_staleness` = k the rollout thread runs up to k steps ahead: when step S is
checkpointed, steps S+1..S+k are (being) generated with the weights of steps before S. A
resume that generated them again would use S's weights, fresher than the uninterrupted run's,
and every step after would differ. So the checkpoint of step S waits until the rollout has
handed those steps over and stores them whole (`ahead.pkl`: their episodes, which of them are
trained, the greedy baselines, the rollout metrics); the data position saved with it is the one
after them. A resumed run trains on them as they are and generates from step S+k+1 on, with the
weights of step S, as the uninterrupted run did.

The choice: storing the episodes rather than the weights they were generated with. Weights
would cost k model copies per checkpoint and could not reproduce a partial rollout (an
update that landed between two decode steps); the episodes are what was trained on, tokens,
log-probs and per-token versions included, and cost a few bytes per token. At k=0 nothing
is ahead and nothing is stored.
"""

from __future__ import annotations

import pickle
import threading
from pathlib import Path
from typing import Any

FILE = "ahead.pkl"


class Ahead:
    """The steps rolled out and not yet learned, as the rollout thread hands them over."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._steps: dict[int, Any] = {}  # step -> Sampled
        self._running = False  # a rollout thread is producing

    def start(self) -> None:
        with self._cond:
            self._running = True

    def stop(self) -> None:
        """The rollout thread ended (done, failed or stopped): nothing more will arrive."""
        with self._cond:
            self._running = False
            self._cond.notify_all()

    def add(self, sampled) -> None:
        with self._cond:
            self._steps[sampled.step] = sampled
            self._cond.notify_all()

    def learned(self, step: int) -> None:
        with self._cond:
            self._steps.pop(step, None)

    def wait(self, first: int, last: int, poll_s: float = 0.5) -> list:
        """Steps first..last in order, waiting for the rollout thread to hand them over; fewer
        (the contiguous run from `first` it has) once it has stopped. The wait is bounded by
        the rollout's own bounds (every episode has rollout.episode_timeout_s)."""
        with self._cond:
            while self._running and not all(s in self._steps for s in range(first, last + 1)):
                self._cond.wait(poll_s)
            out = []
            for s in range(first, last + 1):
                if s not in self._steps:
                    break
                out.append(self._steps[s])
            return out


def to_record(sampled) -> dict:
    """What a checkpoint keeps of a Sampled: plain data (no class of the controller's)."""
    trained = {id(e) for e in sampled.train_eps}
    return {"step": sampled.step, "episodes": sampled.episodes,
            "trained": [i for i, e in enumerate(sampled.episodes) if id(e) in trained],
            "baselines": dict(sampled.baselines), "metrics": dict(sampled.metrics)}


def save(directory: Path, steps: list) -> None:
    """Write the steps ahead into a checkpoint directory being written (nothing when none)."""
    if not steps:
        return
    with (directory / FILE).open("wb") as f:
        pickle.dump({"version": 1, "steps": [to_record(s) for s in steps]}, f, protocol=pickle.HIGHEST_PROTOCOL)


def load(directory: Path) -> list[dict]:
    """The records of the steps a checkpoint kept ahead (empty when it kept none). A checkpoint
    is the run's own output, trusted as its trainer state is (both are pickles)."""
    path = directory / FILE
    if not path.is_file():
        return []
    with path.open("rb") as f:
        data = pickle.load(f)  # the run's own checkpoint, verified by its manifest
    return data["steps"]
