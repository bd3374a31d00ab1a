"""Pure tensor functions of the post-training objectives. Imports nothing from tidal."""

from tidal.algorithms.advantages import group_advantages
from tidal.algorithms.kl import kl_estimate
from tidal.algorithms.losses import AGGREGATIONS, aggregate, entropy_from_logits, ppo_clip_loss, token_logprobs

__all__ = [
    "AGGREGATIONS",
    "aggregate",
    "entropy_from_logits",
    "group_advantages",
    "kl_estimate",
    "ppo_clip_loss",
    "token_logprobs",
]
