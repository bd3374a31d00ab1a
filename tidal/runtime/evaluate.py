"""Held-out evaluation: greedy accuracy and pass@k (the unbiased estimator of Chen et al.
2021, with n = k samples per problem at the evaluation temperature). Episodes run through
the same rollout as training (turns, tools, rewards); a failed episode counts as wrong and
is reported in `failed` (by status), never hidden."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from math import comb
from typing import Any

from tidal.envs import loop_scoped
from tidal.runtime.rollout import Rollout, group_specs


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k draws without replacement from n samples, c correct, is correct)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _correct(e) -> float:
    return e.metrics.get("correct", 0.0) if e.status.trainable else 0.0


def evaluate_engine(engine, rollout: Rollout, rows: list[dict[str, Any]], make_env: Callable,
                    k: int = 8, temperature: float = 1.0, seed: int = 1234) -> dict[str, Any]:
    if not rows:
        raise ValueError("evaluation needs held-out rows (task.eval_dataset)")
    greedy = rollout.with_params(temperature=0.0)
    episodes = loop_scoped.run(greedy.run(group_specs(rows, make_env, 1, seed, 0), engine, step=0))
    correct = [_correct(e) for e in episodes]
    failed = Counter(e.status.value for e in episodes if not e.status.trainable)
    judged = any("correct" in e.metrics for e in episodes)
    # No reward said what is correct (a reward model alone): accuracy is unknown, not 0 (eval.reward).
    out: dict[str, Any] = {"n": len(rows), "accuracy": sum(correct) / len(rows) if judged or failed else None,
                           "failed": sum(failed.values()), "failed_by_status": dict(failed)}
    first = next((e for e in episodes if not e.status.trainable), None)
    if first is not None:  # a failure is counted wrong; what it was is said, not hidden behind 0.000
        out["first_error"] = first.error
    tool_calls = sum(e.metrics.get("tools/calls", 0.0) for e in episodes)
    if tool_calls:
        errors = sum(v for e in episodes for key, v in e.metrics.items() if key.startswith("tools/errors/"))
        out.update({"tool_calls": tool_calls, "tool_error_rate": errors / tool_calls})
    if k > 0:
        sampled = rollout.with_params(temperature=temperature)
        eps = loop_scoped.run(sampled.run(group_specs(rows, make_env, k, seed, 1), engine, step=0))
        per_row = [sum(_correct(e) for e in eps[i * k : (i + 1) * k]) for i in range(len(rows))]
        known = out["accuracy"] is not None
        out.update({"k": k, "temperature": temperature,
                    "pass_at_k": sum(pass_at_k(k, int(c), k) for c in per_row) / len(rows) if known else None,
                    "pass_at_1": sum(c / k for c in per_row) / len(rows) if known else None})
    return out


def evaluate_during_training(engine, rollout: Rollout, eval_rows: list[dict[str, Any]],
                             sets: dict[str, list[dict[str, Any]]], make_env: Callable, cfg: Any,
                             step: int) -> dict[str, float]:
    """A training step's evaluation (`cfg` an EvalConfig): held-out greedy accuracy
    (eval/accuracy) on cfg.n problems; every cfg.k_every steps also pass@k and pass@1 at
    cfg.temperature; the accuracy of each of cfg.sets (eval/<name>/accuracy)."""
    out: dict[str, float] = {}
    sampled = bool(cfg.k_every) and step > 0 and step % cfg.k_every == 0
    if eval_rows:
        res = evaluate_engine(engine, rollout, eval_rows[: cfg.n], make_env, k=cfg.k if sampled else 0,
                              temperature=cfg.temperature)
        if res["accuracy"] is not None:
            out["eval/accuracy"] = res["accuracy"]
        if sampled and res.get("pass_at_k") is not None:
            out["eval/pass_at_k"], out["eval/pass_at_1"] = res["pass_at_k"], res["pass_at_1"]
    for name, rows in sets.items():
        res = evaluate_engine(engine, rollout, rows, make_env, k=0)
        if res["accuracy"] is not None:
            out[f"eval/{name}/accuracy"] = res["accuracy"]
    return out
