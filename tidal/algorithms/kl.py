"""KL control against a frozen reference π_ref: per-token estimators from log-probs of the
sampled tokens (Schulman, "Approximating KL divergence", 2020) and the adaptive
coefficient of Ziegler et al. 2019.

Legend: B sequences, T tokens. log_ratio = log π(x) − log π_ref(x), x ~ π.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


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
        return torch.expm1(neg) - neg  # expm1: exp(x) − 1 − x rounds below 0 for small x
    raise ValueError(f"KL estimator must be one of {KL_ESTIMATORS}, got {kind!r}")


class AdaptiveKLController:
    """β ← β·(1 + clip(KL/target − 1, −0.2, 0.2)·n/horizon) after each step of n samples
    (Ziegler et al. 2019): β grows while the policy drifts past the target KL and
    shrinks while it stays below. `target=None` keeps β fixed."""

    def __init__(self, coef: float, target: float | None = None, horizon: int = 10_000):
        self.coef, self.target, self.horizon = coef, target, horizon

    def update(self, kl: float, n_samples: int) -> float:
        if self.target is not None and self.target > 0:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * n_samples / self.horizon
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])
