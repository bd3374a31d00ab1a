"""Off-policy and engine/trainer mismatch corrections.

Legend: B sequences, T tokens. prox_logp is the proximal policy (the trainer's log-probs
of the batch before its first update, the PPO clipping anchor); behav_logp is what the
engine that generated the tokens reported. Their gap is the off-policy-ness of the data:
stale weights (async), or a different numeric path (vLLM kernels, bf16).

Two tools, composable (as in veRL's rollout IS / rejection sampling, and AReaL's
decoupled PPO):
- importance weights w = min(π_prox/μ, cap), detached, multiply the per-token policy
  loss (truncated IS, Yao et al. 2025; with the proximal anchor this is the decoupled
  PPO objective of Hilton et al. 2022 / AReaL);
- rejection masks drop tokens (or whole sequences) whose ratio leaves [low, high]
  (token masking; geometric sequence masking on the per-token geometric mean).
"""

from __future__ import annotations

import torch

IS_LEVELS = ("none", "token", "sequence")
REJECTION_LEVELS = ("none", "token", "geometric")


def importance_weights(
    prox_logp_BT: torch.Tensor, behav_logp_BT: torch.Tensor, mask_BT: torch.Tensor, level: str = "token", cap: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance weights, detached, and which were truncated.

    token:    w_t = min(exp(prox_t − behav_t), cap)
    sequence: w   = min(Π_t exp(prox_t − behav_t), cap), the same for every token of a
              sequence (computed as exp of the summed log-ratio, in log space)
    none:     w = 1
    Off the mask w = 1."""
    log_r = torch.where(mask_BT, prox_logp_BT - behav_logp_BT, 0.0).detach()
    if level == "none":
        w = torch.ones_like(log_r)
    elif level == "token":
        w = torch.exp(log_r.clamp(max=20.0))
    elif level == "sequence":
        w = torch.exp(log_r.sum(-1, keepdim=True).clamp(max=20.0)).expand_as(log_r)
    else:
        raise ValueError(f"importance-weight level must be one of {IS_LEVELS}, got {level!r}")
    truncated = (w > cap) & mask_BT
    return torch.where(mask_BT, w.clamp(max=cap), 1.0), truncated


def rejection_mask(
    prox_logp_BT: torch.Tensor,
    behav_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    level: str = "token",
    low: float = 0.5,
    high: float = 2.0,
) -> torch.Tensor:
    """Tokens kept (True) after rejection; tokens off the mask are never kept.

    token:     keep t iff low ≤ exp(prox_t − behav_t) ≤ high
    geometric: keep a whole sequence iff low ≤ exp(mean_t (prox_t − behav_t)) ≤ high
               (the geometric mean ratio: length-independent, unlike the product)
    none:      keep every masked token"""
    log_r = torch.where(mask_BT, prox_logp_BT - behav_logp_BT, 0.0).detach()
    lo, hi = torch.log(torch.tensor(low, dtype=log_r.dtype)), torch.log(torch.tensor(high, dtype=log_r.dtype))
    if level == "none":
        return mask_BT.clone()
    if level == "token":
        return mask_BT & (log_r >= lo) & (log_r <= hi)
    if level == "geometric":
        geo_B = log_r.sum(-1) / mask_BT.sum(-1).clamp(min=1)
        return mask_BT & ((geo_B >= lo) & (geo_B <= hi))[:, None]
    raise ValueError(f"rejection level must be one of {REJECTION_LEVELS}, got {level!r}")
