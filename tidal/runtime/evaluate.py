"""Held-out evaluation: greedy accuracy and pass@k (the unbiased estimator of Chen et al.
2021, with n = k samples per problem at the evaluation temperature). Episodes run through
the same rollout as training (turns, tools, rewards).

A failed episode (its reward raised or timed out, its environment failed) is counted apart,
in `failed` and `failed_frac`, and is never averaged in as wrong: accuracy is the mean
`correct` of the episodes that were scored. Accuracy is read where a reward says what is
correct (a `correct` part, a reward named `correct`, veRL's `acc`: tidal/rewards/forms.py);
where none does, it is unknown (None), not 0, and `accuracy_note` says so at start."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from math import comb
from typing import Any

from tidal.envs import loop_scoped
from tidal.rewards.forms import reward_meta, says_correct, spec_data
from tidal.runtime.rollout import Rollout, group_specs


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k draws without replacement from n samples, c correct, is correct)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def accuracy_note(specs: list, keys: list[str]) -> str | None:
    """A line for the log at start when, by their config alone, none of the rewards `specs`
    (RewardSpec, named by `keys`) can say what is correct: TRL-form rewards (a float per
    sample) none of which is named `correct`. None when one can (a tidal-form reward may
    return a `correct` part, a veRL one an `acc`)."""
    if not specs:
        return None
    meta = reward_meta([spec_data(s, k) for s, k in zip(specs, keys)])
    if any(r.form != "trl" or says_correct(r) for r in meta):
        return None
    names = ", ".join(f"`{r.label}` ({r.key})" for r in meta)
    return (f"evaluation: no reward says what is correct ({names}: TRL form, a float per sample, and none named "
            "`correct`), so eval/accuracy is not reported (eval/failed_frac is). Name the reward that says right or "
            "wrong `correct` (task.rewards: [{fn: ..., form: trl, name: correct}]), or set eval.reward and "
            "eval.reward_form to a verifier (docs/rewards.md)")


def _scored(e) -> bool:
    return e.status.trainable and "correct" in e.metrics


def evaluate_engine(engine, rollout: Rollout, rows: list[dict[str, Any]], make_env: Callable,
                    k: int = 8, temperature: float = 1.0, seed: int = 1234) -> dict[str, Any]:
    if not rows:
        raise ValueError("evaluation needs held-out rows (task.eval_dataset)")
    greedy = rollout.with_params(temperature=0.0)
    episodes = loop_scoped.run(greedy.run(group_specs(rows, make_env, 1, seed, 0), engine, step=0))
    failed = Counter(e.status.value for e in episodes if not e.status.trainable)
    scored = [e.metrics["correct"] for e in episodes if _scored(e)]
    # No episode said what is correct (a reward model alone, every episode failed): unknown, not 0.
    out: dict[str, Any] = {"n": len(rows), "accuracy": sum(scored) / len(scored) if scored else None,
                           "scored": len(scored), "failed": sum(failed.values()),
                           "failed_frac": sum(failed.values()) / len(episodes), "failed_by_status": dict(failed)}
    first = next((e for e in episodes if not e.status.trainable), None)
    if first is not None:  # what failed is said, and kept out of the accuracy
        out["first_error"] = first.error
    tool_calls = sum(e.metrics.get("tools/calls", 0.0) for e in episodes)
    if tool_calls:
        errors = sum(v for e in episodes for key, v in e.metrics.items() if key.startswith("tools/errors/"))
        out.update({"tool_calls": tool_calls, "tool_error_rate": errors / tool_calls})
    if k > 0:
        sampled = rollout.with_params(temperature=temperature)
        eps = loop_scoped.run(sampled.run(group_specs(rows, make_env, k, seed, 1), engine, step=0))
        # Per problem, its samples that were scored: a failed one is left out, not counted wrong
        # (pass@min(k, n) from the n scored; a problem with none scored is left out).
        per_row = [[e.metrics["correct"] for e in eps[i * k : (i + 1) * k] if _scored(e)] for i in range(len(rows))]
        per_row = [cs for cs in per_row if cs]
        out.update({"k": k, "temperature": temperature,
                    "sampled_failed_frac": sum(not e.status.trainable for e in eps) / len(eps),
                    "pass_at_k": sum(pass_at_k(len(cs), int(sum(cs)), min(k, len(cs))) for cs in per_row)
                    / len(per_row) if per_row else None,
                    "pass_at_1": sum(sum(cs) / len(cs) for cs in per_row) / len(per_row) if per_row else None})
    return out


def evaluate_during_training(engine, rollout: Rollout, eval_rows: list[dict[str, Any]],
                             sets: dict[str, list[dict[str, Any]]], make_env: Callable, cfg: Any,
                             step: int) -> dict[str, float]:
    """A training step's evaluation (`cfg` an EvalConfig): held-out greedy accuracy
    (eval/accuracy) on cfg.n problems and the fraction of them that failed (eval/failed_frac,
    left out of the accuracy); every cfg.k_every steps also pass@k and pass@1 at
    cfg.temperature; the accuracy of each of cfg.sets (eval/<name>/accuracy, eval/<name>/failed_frac)."""
    out: dict[str, float] = {}
    sampled = bool(cfg.k_every) and step > 0 and step % cfg.k_every == 0
    if eval_rows:
        res = evaluate_engine(engine, rollout, eval_rows[: cfg.n], make_env, k=cfg.k if sampled else 0,
                              temperature=cfg.temperature)
        out["eval/failed_frac"] = res["failed_frac"]
        if res["accuracy"] is not None:
            out["eval/accuracy"] = res["accuracy"]
        if sampled and res.get("pass_at_k") is not None:
            out["eval/pass_at_k"], out["eval/pass_at_1"] = res["pass_at_k"], res["pass_at_1"]
    for name, rows in sets.items():
        res = evaluate_engine(engine, rollout, rows, make_env, k=0)
        out[f"eval/{name}/failed_frac"] = res["failed_frac"]
        if res["accuracy"] is not None:
            out[f"eval/{name}/accuracy"] = res["accuracy"]
    return out
