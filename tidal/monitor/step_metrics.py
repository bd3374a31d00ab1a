"""A step's metrics over its episodes (docs/metrics.md): counts, means, staleness."""

from __future__ import annotations

import logging

from tidal.types import Episode

log = logging.getLogger("tidal")

# Episode metrics summed over a step's episodes (counts), not averaged.
SUMMED_PREFIXES = ("tools/", "rollout/prefix_breaks", "rollout/out_of_", "env/close_errors", "judge/injection",
                   "math/no_answer", "math/several_answers", "math/refused/")


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    n = max(len(episodes), 1)
    ok = [e for e in episodes if e.status.trainable]
    m: dict[str, float] = {f"episodes/{s}": 0.0 for s in ("ok", "truncated", "env_error", "reward_error", "engine_error", "timeout")}
    for e in episodes:
        m[f"episodes/{e.status.value}"] += 1
    judged = [e for e in ok if "correct" in e.metrics]  # a reward model alone says nothing of correctness
    if judged:
        m["accuracy"] = sum(e.metrics["correct"] for e in judged) / len(judged)
    if ok:
        m["reward"] = sum(e.reward for e in ok) / len(ok)
        m["response_tokens"] = sum(e.num_policy_tokens for e in ok) / len(ok)
        m["turns"] = sum(len(e.turns) for e in ok) / len(ok)
        parts = {k for e in ok for k in e.reward_parts}
        for k in sorted(parts):
            m[f"reward/{k}"] = sum(e.reward_parts.get(k, 0.0) for e in ok) / len(ok)
    means: dict[str, list[float]] = {}
    for e in episodes:
        for k, v in e.metrics.items():
            if k.startswith(SUMMED_PREFIXES):
                m[k] = m.get(k, 0.0) + v
            elif "/" in k:  # an environment's or a reward's own metric (code/runs, shell/checks_passed, ...)
                means.setdefault(k, []).append(v)
    for k, vs in means.items():  # the mean over the episodes that report it
        m.setdefault(k, sum(vs) / len(vs))
    if m.get("tools/calls"):
        m["tools/error_rate"] = sum(v for k, v in m.items() if k.startswith("tools/errors/")) / m["tools/calls"]
    if (zero := zero_std_frac(ok)) is not None:
        m["groups/zero_std_frac"] = zero
    m["episodes"] = float(n if episodes else 0)
    m["episodes/failed_frac"] = (len(episodes) - len(ok)) / n if episodes else 0.0
    return m


def zero_std_frac(episodes: list[Episode]) -> float | None:
    """The fraction of groups (of two or more trained-on episodes) whose rewards are all
    equal: those give GRPO no advantage, so no gradient (TRL logs the same). None: no group."""
    by_group: dict[str, list[float]] = {}
    for e in episodes:
        by_group.setdefault(e.group_id, []).append(e.reward)
    groups = [rs for rs in by_group.values() if len(rs) > 1]
    if not groups:
        return None
    # Equal within 1e-9: rewards summed from weighted parts differ in their last bits.
    return sum(max(rs) - min(rs) <= 1e-9 for rs in groups) / len(groups)


def staleness_metrics(episodes: list[Episode], version: int, per_step: int, k: int) -> dict[str, float]:
    """Version lag, in training steps, of every trained policy token against the weights it is
    trained with (`version`, the trainer's before this step's update): max, token mean and the
    fraction of tokens at each lag 0..k (a lag beyond k would break the bound; it is counted
    in `staleness/over_bound`)."""
    lags = [(version - v) // per_step for e in episodes for v, m in zip(e.versions, e.loss_mask) if m]
    if not lags:
        return {}
    out = {"staleness/max": float(max(lags)), "staleness/mean": sum(lags) / len(lags),
           "staleness/over_bound": float(sum(lag > k for lag in lags)) / len(lags)}
    for j in range(k + 1):
        out[f"staleness/lag{j}_frac"] = sum(lag == j for lag in lags) / len(lags)
    if out["staleness/over_bound"]:
        log.error("staleness bound broken: %d trained tokens are more than %d steps old (max %d)",
                  sum(lag > k for lag in lags), k, max(lags))
    return out
