"""Pure tensor functions of the post-training objectives. Imports nothing from tidal."""

from tidal.algorithms.advantages import (
    ESTIMATORS,
    AdvantageInputs,
    Estimator,
    build_estimator,
    discounted_returns,
    estimate_advantages,
    gae,
    group_advantages,
    masked_whiten,
    needs,
    remax_advantages,
    rloo_advantages,
    terminal_rewards,
)
from tidal.algorithms.corrections import IS_LEVELS, REJECTION_LEVELS, importance_weights, rejection_mask
from tidal.algorithms.kl import KL_ESTIMATORS, AdaptiveKLController, kl_estimate
from tidal.algorithms.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    aggregate,
    cispo_loss,
    entropy_from_logits,
    gspo_loss,
    policy_loss,
    ppo_clip_loss,
    token_logprobs,
    value_loss,
)
from tidal.algorithms.shaping import informative_groups, overlong_penalty

__all__ = [
    "AGGREGATIONS", "ESTIMATORS", "IS_LEVELS", "KL_ESTIMATORS", "POLICY_LOSSES", "REJECTION_LEVELS",
    "AdaptiveKLController", "AdvantageInputs", "Estimator", "aggregate", "build_estimator", "cispo_loss",
    "discounted_returns", "entropy_from_logits", "estimate_advantages", "gae", "group_advantages", "gspo_loss",
    "importance_weights", "informative_groups", "kl_estimate", "masked_whiten", "needs", "overlong_penalty", "policy_loss", "ppo_clip_loss", "rejection_mask",
    "remax_advantages", "rloo_advantages", "terminal_rewards", "token_logprobs", "value_loss",
]
