"""The per-token objective of a policy update, as one component (in the spirit of torchtitan's
`DAPOLoss`): `objective(LossInputs) -> LossOutput`, so that `Trainer.forward_backward` reads
forward -> loss -> backward, and a user's own objective is a dotted path away
(`algorithm.loss: my_pkg.losses:MyLoss`).

`PolicyObjective` is tidal's: the policy loss of `algorithm.policy_loss` (PPO clip, dual clip,
GSPO, CISPO) against the anchor (proximal or behaviour log-probs), times the truncated
importance weight π_prox/μ, plus β·KL to the reference when the KL is a loss term, minus the
entropy bonus; tokens rejected by the π_prox/μ ratio add nothing; then aggregated by
`algorithm.loss_agg` under the denominators of the whole batch as sampled (`total_tokens`,
`total_seqs`), which is what makes the gradient the same however the batch is split into
micro-batches or ranks. A user's objective keeps that property by aggregating with the same
totals (`tidal.algorithms.aggregate`).

Shapes: every tensor of `LossInputs` is [B, T], aligned with the trainer's targets (entry t
belongs to token t+1). Metric `sums` are sums over the micro-batch's policy tokens (the
trainer divides by the batch's token count, across ranks); `loss` is the micro-batch's share of
the batch loss. Imports nothing from tidal outside this package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.algorithms.corrections import importance_weights, rejection_mask
from tidal.algorithms.kl import kl_estimate
from tidal.algorithms.losses import aggregate, policy_loss


@dataclass
class LossInputs:
    """One micro-batch of the policy update, every tensor [B, T]. The trainer computes log-probs
    and entropy at the policy tokens only: off the mask, `logp` and `entropy` are 0."""

    logp: torch.Tensor  # log π_θ of each target token, with grad
    old_logp: torch.Tensor  # the proximal policy's (π_θ before this update), detached
    behaviour_logp: torch.Tensor  # the engine's (μ), 0 off the mask
    advantages: torch.Tensor
    mask: torch.Tensor  # bool: the policy's own tokens
    entropy: torch.Tensor  # per-token entropy of π_θ (with grad only when the objective asks: `entropy_grad`)
    total_tokens: float  # policy tokens of the whole batch, across ranks
    total_seqs: float  # sequences of the whole batch, across ranks
    norm_len: float | None = None  # seq-mean-token-sum-norm's constant length
    ref_logp: torch.Tensor | None = None  # the reference's, when the KL is a loss term
    kl_coef: float = 0.0


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar: this micro-batch's share of the batch loss
    sums: dict[str, float] = field(default_factory=dict)  # token sums of the objective's own metrics


class PolicyObjective:
    """tidal's objective, configured by `algorithm.*` (see the module docstring)."""

    # The metric sums it may return: every rank of a data-parallel group reduces the same keys.
    metric_keys = ("pg_loss", "kl", "clip_frac", "is_weight", "is_truncated_frac", "rejected_frac")

    def __init__(self, algo: Any):
        self.algo = algo
        self.entropy_grad = algo.entropy_coef > 0  # the trainer keeps the entropy's graph only then

    def __call__(self, x: LossInputs) -> LossOutput:
        a = self.algo
        anchor = x.behaviour_logp if a.anchor == "behaviour" else x.old_logp
        weight_BT, truncated_BT = importance_weights(x.old_logp, x.behaviour_logp, x.mask, a.is_level, a.is_cap)
        keep_BT = rejection_mask(x.old_logp, x.behaviour_logp, x.mask, a.rejection, a.reject_low, a.reject_high)
        pg_BT, clipped_BT = policy_loss(a.policy_loss, x.logp, anchor, x.advantages, x.mask, a.clip_low, a.clip_high,
                                        a.dual_clip)
        loss_BT = weight_BT * pg_BT
        kl_BT = None
        if x.ref_logp is not None:
            kl_BT = kl_estimate(x.logp, x.ref_logp, a.kl_estimator)
            loss_BT = loss_BT + x.kl_coef * kl_BT
        if a.entropy_coef > 0:
            loss_BT = loss_BT - a.entropy_coef * x.entropy
        # Rejected tokens add nothing, but the denominators stay those of the batch as
        # sampled: rejection never depends on how the batch is split.
        loss = aggregate(loss_BT, keep_BT, a.loss_agg, x.total_tokens, x.total_seqs, x.norm_len)
        with torch.no_grad():
            m = x.mask.float()
            sums = {"pg_loss": float((pg_BT * m).sum()), "clip_frac": float((clipped_BT.float() * m).sum())}
            if kl_BT is not None:
                sums["kl"] = float((kl_BT.detach() * m).sum())
            if a.is_level != "none":
                sums["is_weight"] = float((weight_BT * m).sum())
                sums["is_truncated_frac"] = float(truncated_BT.float().sum())
            if a.rejection != "none":
                sums["rejected_frac"] = float((x.mask & ~keep_BT).float().sum())
        return LossOutput(loss, sums)


def build_objective(algo: Any, import_object=None):
    """`algorithm.loss` (a dotted or file path to a class built as `cls(algo, **algorithm.loss_args)`,
    or to a function called as `fn(inputs, **algorithm.loss_args)`) or, when unset, PolicyObjective. A function may return a
    LossOutput, a `(loss, sums)` pair or the loss alone; of its sums, those it names in a
    `metric_keys` attribute are logged (per policy token, like tidal's own)."""
    path = getattr(algo, "loss", None)
    if not path:
        return PolicyObjective(algo)
    obj = import_object(path, "algorithm.loss")
    args = dict(getattr(algo, "loss_args", None) or {})
    fn = obj(algo, **args) if isinstance(obj, type) else obj
    if not callable(fn):
        raise TypeError(f"`algorithm.loss`: `{path}` is not callable (a class taking the AlgorithmConfig, or a "
                         "function of LossInputs)")

    def objective(x: LossInputs) -> LossOutput:
        out = fn(x) if isinstance(obj, type) else fn(x, **args)
        if isinstance(out, LossOutput):
            return out
        if isinstance(out, tuple) and len(out) == 2:
            return LossOutput(out[0], dict(out[1]))
        if isinstance(out, torch.Tensor):
            return LossOutput(out, {})
        raise TypeError(f"`algorithm.loss` `{path}` returned {type(out).__name__}: expected a LossOutput, a "
                        "(loss, sums) pair or a scalar tensor")

    objective.entropy_grad = bool(getattr(fn, "entropy_grad", algo.entropy_coef > 0))
    objective.metric_keys = tuple(getattr(fn, "metric_keys", ()))
    return objective
