"""INTERIM (removed when tidal/rewards/pool.py lands): scores tidal-form rewards in the
caller's loop so the default job runs while the worker pool is being built."""

from __future__ import annotations

import math

from tidal.importing import import_object
from tidal.rewards.contract import RewardInput, RewardOutcome


class InterimScorer:
    per_group = False

    def __init__(self, specs):
        self.fns = [(s, import_object(s.fn, "task.reward")) for s in specs]

    async def score(self, inputs: list[RewardInput]) -> list[RewardOutcome]:
        from tidal.rewards import call_reward_async

        outs = []
        for inp in inputs:
            total, parts = 0.0, {}
            try:
                for spec, fn in self.fns:
                    t, p = await call_reward_async(fn, inp.completion, inp.columns)
                    total += spec.weight * t
                    parts.update({k: spec.weight * v for k, v in p.items()} if p else {spec.name or spec.fn: spec.weight * t})
            except Exception as e:  # noqa: BLE001
                outs.append(RewardOutcome("reward_error", error=f"reward function raised {type(e).__name__}({e}) on episode {inp.episode_id}"))
                continue
            outs.append(RewardOutcome("ok", total, parts) if math.isfinite(total) else RewardOutcome("reward_error", error="non-finite"))
        return outs

    async def close(self) -> None:
        pass


def build_scorer(specs, cfg, ray_handles=None):
    return InterimScorer(specs)
