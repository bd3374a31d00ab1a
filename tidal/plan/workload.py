"""A step's episodes as the simulator needs them: generated tokens of each policy turn, the environment's
latency after each turn, and the group each episode belongs to. Lengths come from a distribution
(lognormal for reasoning's long tail, geometric, fixed) or are resampled from a run's episode store
(Parquet, `RUN/episodes/`), so a simulated step carries the length mix a real one had.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tidal.monitor.episodes import episode_files
from tidal.plan.spec import LengthSpec, WorkloadSpec


@dataclass
class StepWork:
    lengths: np.ndarray  # [E, T] generated tokens per turn (0: the episode ended before that turn)
    env_latency: np.ndarray  # [E, T] seconds of the environment step after each turn
    group: np.ndarray  # [E] group index
    prompt_tokens: int
    obs_tokens: int

    @property
    def episodes(self) -> int:
        return self.lengths.shape[0]


def store_lengths(path: str | Path) -> np.ndarray:
    """Generated tokens per episode (policy tokens: the loss mask's count) from a run's episode store."""
    import pyarrow.parquet as pq


    files = episode_files(path)
    if not files:
        raise FileNotFoundError(f"workload.lengths.path={path}: no episode store files (step_*.parquet) there")
    out = []
    for f in files:
        col = pq.read_table(f, columns=["loss_mask"]).column("loss_mask").combine_chunks()
        flat = np.asarray(col.flatten().to_numpy(zero_copy_only=False), dtype=bool)
        ends = np.cumsum(np.diff(np.asarray(col.offsets.to_numpy())))
        counts = np.add.reduceat(flat.astype(np.int64), np.r_[0, ends[:-1]]) if len(flat) else np.zeros(0)
        out.append(np.where(np.diff(np.r_[0, ends]) > 0, counts, 0))
    return np.concatenate(out)


class LengthSampler:
    def __init__(self, spec: LengthSpec, seed: int):
        self.spec = spec
        self.rng = np.random.default_rng(seed)
        self.pool = store_lengths(spec.path) if spec.kind == "parquet" else None
        if spec.kind == "parquet" and spec.path is None:
            raise ValueError("workload.lengths.kind=parquet needs workload.lengths.path")

    def sample(self, n: int) -> np.ndarray:
        s = self.spec
        if s.kind == "fixed":
            x = np.full(n, s.mean)
        elif s.kind == "geometric":
            x = self.rng.geometric(1.0 / max(s.mean, 1.0), n)
        elif s.kind == "lognormal":  # mean kept at s.mean: mu = ln(mean) - sigma^2/2
            x = self.rng.lognormal(np.log(s.mean) - s.sigma ** 2 / 2, s.sigma, n)
        else:
            x = self.rng.choice(self.pool, n)
        return np.clip(np.rint(x), 1, s.max).astype(np.int64)


def step_work(w: WorkloadSpec, sampler: LengthSampler, groups: int, rng: np.random.Generator) -> StepWork:
    """`groups` prompts x samples_per_prompt episodes of `w.turns` turns each."""
    e = groups * w.samples_per_prompt
    lengths = sampler.sample(e * w.turns).reshape(e, w.turns)
    lat = rng.exponential(w.env_latency_s, (e, w.turns)) if w.env_latency_s > 0 else np.zeros((e, w.turns))
    return StepWork(lengths, lat, np.repeat(np.arange(groups), w.samples_per_prompt), w.prompt_tokens, w.obs_tokens)
