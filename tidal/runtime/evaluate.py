"""Held-out evaluation: greedy accuracy and pass@k (the unbiased estimator of Chen et al.
2021, with n = k samples per problem at the evaluation temperature)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from math import comb
from typing import Any

from tidal.runtime.rollout import Rollout, group_specs
from tidal.types import SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k draws without replacement from n samples, c correct, is correct)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate_engine(engine, tokenizer, rows: list[dict[str, Any]], make_env: Callable, params: SamplingParams,
                    k: int = 8, temperature: float = 1.0, seed: int = 1234) -> dict[str, Any]:
    if not rows:
        raise ValueError("evaluation needs held-out rows (task.eval_dataset)")
    greedy = Rollout(tokenizer, replace(params, temperature=0.0))
    episodes = asyncio.run(greedy.run(group_specs(rows, make_env, 1, seed, 0), engine, step=0))
    correct = [e.metrics.get("correct", 0.0) if e.status.trainable else 0.0 for e in episodes]
    out: dict[str, Any] = {"n": len(rows), "accuracy": sum(correct) / len(rows),
                           "failed": sum(not e.status.trainable for e in episodes)}
    if k > 0:
        sampled = Rollout(tokenizer, replace(params, temperature=temperature))
        eps = asyncio.run(sampled.run(group_specs(rows, make_env, k, seed, 1), engine, step=0))
        per_row = [sum(e.metrics.get("correct", 0.0) for e in eps[i * k : (i + 1) * k] if e.status.trainable)
                   for i in range(len(rows))]
        out.update({"k": k, "temperature": temperature,
                    "pass_at_k": sum(pass_at_k(k, int(c), k) for c in per_row) / len(rows),
                    "pass_at_1": sum(c / k for c in per_row) / len(rows)})
    return out
