"""Policy losses and the one loss-normalization contract.

Legend: B sequences, T tokens (after the shift: position t scores token t+1), V vocab.

A loss is computed per token, then `aggregate` reduces it with a denominator fixed for
the whole (mini-)batch *before* it is split into micro-batches or ranks. Each
micro-batch returns its share, the shares add up to the batch loss, and so gradients do
not depend on the split (DESIGN.md invariant).
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) at the target tokens, float32 [B, T]."""
    logits = logits_BTV.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.log_softmax(-1).gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits_BTV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H = −Σ_v p_v log p_v per position [B, T] under softmax(logits / temperature)."""
    logp = (logits_BTV.float() / temperature).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def ppo_clip_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token (Schulman et al. 2017), with asymmetric bounds.

    ρ = exp(logp − old_logp); loss = −min(ρ·A, clip(ρ, 1−clip_low, 1+clip_high)·A).
    Returns (loss_BT, clipped_BT) where clipped marks tokens whose gradient the clip cut.
    """
    ratio = torch.exp((logp_BT - old_logp_BT).clamp(-20.0, 20.0))
    unclipped = ratio * adv_BT
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv_BT
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    total_tokens: float,
    total_seqs: float,
    norm_len: float = 1.0,
) -> torch.Tensor:
    """This micro-batch's share of the batch loss. `total_tokens` / `total_seqs` count the
    masked tokens / sequences of the whole batch (all micro-batches, all ranks).

    token-mean:              Σ_b Σ_t l·m / total_tokens
    seq-mean-token-sum:      Σ_b (Σ_t l·m) / total_seqs
    seq-mean-token-mean:     Σ_b (Σ_t l·m / Σ_t m) / total_seqs
    seq-mean-token-sum-norm: Σ_b Σ_t l·m / (total_seqs · norm_len)   (Dr.GRPO's constant)
    """
    mask = mask_BT.to(loss_BT.dtype)
    per_seq = (loss_BT * mask).sum(-1)
    if mode == "token-mean":
        return per_seq.sum() / max(total_tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return per_seq.sum() / max(total_seqs, 1.0)
    if mode == "seq-mean-token-mean":
        return (per_seq / mask.sum(-1).clamp(min=1.0)).sum() / max(total_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        return per_seq.sum() / (max(total_seqs, 1.0) * norm_len)
    raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {mode!r}")
