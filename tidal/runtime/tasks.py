"""A task: train rows, held-out rows and how to make an environment for a row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tidal.config import TaskConfig
from tidal.envs.arithmetic import make_problems
from tidal.envs.dataset import load_prompts
from tidal.envs.single_turn import SingleTurnEnv
from tidal.rewards import RewardFn, load_reward_fn


@dataclass
class Task:
    name: str
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    reward_fn: RewardFn

    def make_env(self, row: dict[str, Any]) -> SingleTurnEnv:
        return SingleTurnEnv(row, self.reward_fn, name=self.name)


def build_task(cfg: TaskConfig) -> Task:
    """Everything is loaded and checked here, before any model or worker starts."""
    reward_fn = load_reward_fn(cfg.reward)
    if cfg.dataset is None:
        train = make_problems(cfg.arithmetic, "train", cfg.train_size, cfg.seed)
        held_out = make_problems(cfg.arithmetic, "test", cfg.eval_size, cfg.seed)
    else:
        train = load_prompts(cfg.dataset)
        held_out = load_prompts(cfg.eval_dataset) if cfg.eval_dataset else []
    return Task(cfg.name, train, held_out, reward_fn)
