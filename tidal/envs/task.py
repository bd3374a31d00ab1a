"""A task as the rollout sees it: its rows, and how to make an environment for one row.

`tidal/runtime/tasks.py` builds it from `task.*` (the rows from a dataset or the environment's
generator, the class from a name or path, the rewards); the rollout only calls `make_env` once
per episode, with the episode's seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tidal.config import RewardSpec


@dataclass
class Task:
    name: str
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    env_cls: Any
    env_args: dict[str, Any] = field(default_factory=dict)
    rewards: list[RewardSpec] = field(default_factory=list)

    def make_env(self, row: dict[str, Any], seed: int = 0):
        """The environment of one episode: `env_cls(row, seed=seed, **env_args)`, named after the task."""
        env = self.env_cls(row, seed=seed, **self.env_args)
        env.name = self.name
        return env
