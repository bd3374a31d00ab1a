"""KL estimators between the policy π and a reference π_ref, per token, from log-probs
of the sampled tokens (Schulman, "Approximating KL divergence", 2020).

Legend: B sequences, T tokens. log_ratio = log π(x) − log π_ref(x), x ~ π.
"""

from __future__ import annotations

import torch


def kl_estimate(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """k1 = log_ratio (unbiased, can be negative);
    k2 = ½ log_ratio² (biased, ≥ 0);
    k3 = exp(−log_ratio) − 1 + log_ratio (unbiased, ≥ 0, low variance).
    The log-ratio is clamped to ±20 before exponentiation so one outlier cannot overflow."""
    log_ratio = logp_BT - ref_logp_BT
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        neg = (-log_ratio).clamp(-20.0, 20.0)
        return neg.exp() - 1.0 - neg
    raise ValueError(f"KL estimator must be 'k1', 'k2' or 'k3', got {kind!r}")
