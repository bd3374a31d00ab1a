"""Policy and value losses, and the one loss-normalization contract.

Legend: B sequences, T tokens (after the shift: position t scores token t+1), V vocab.
`old_logp` is the clipping anchor (the proximal policy: the trainer's log-probs before
this batch's first update); the behaviour policy (the engine) enters only through the
importance weights of tidal.algorithms.corrections.

A loss is computed per token, then `aggregate` reduces it with a denominator fixed for
the whole (mini-)batch *before* it is split into micro-batches or ranks. Each
micro-batch returns its share, the shares add up to the batch loss, and so gradients do
not depend on the split (docs/architecture.md, "Invariants").
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("ppo", "gspo", "cispo")


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
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token (Schulman et al. 2017).

    ρ = exp(logp − old_logp); loss = −min(ρ·A, clip(ρ, 1−clip_low, 1+clip_high)·A).
    clip_high > clip_low is DAPO's clip-higher. `dual_clip` = c > 1 (Ye et al. 2020)
    bounds the loss of a negative advantage by −c·A, so a huge ratio on a bad token
    cannot dominate. Returns (loss_BT, clipped_BT): clipped marks tokens whose
    gradient a clip cut.
    """
    ratio = torch.exp((logp_BT - old_logp_BT).clamp(-20.0, 20.0))
    loss, cut = _clipped_surrogate(ratio, adv_BT, clip_low, clip_high)
    if dual_clip is not None:
        bound = -dual_clip * adv_BT
        dual = (adv_BT < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        cut = cut | dual
    return loss, cut


def gspo_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): one length-normalized ratio per sequence,
    s = exp(mean_t (logp − old_logp)), clipped as in PPO with A the sequence advantage.

    Per token (GSPO-token form): s_t = sg[s]·exp(logp_t − sg[logp_t]), whose value is s
    and whose gradient is s·∇logp_t, so with seq-mean-token-mean aggregation the
    gradient is s·A·mean_t ∇logp_t, the paper's. The paper's clip range is ~1e-3 wide.
    """
    m = mask_BT.to(logp_BT.dtype)
    log_s_B = ((logp_BT - old_logp_BT) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    s_BT = torch.exp(log_s_B.detach().clamp(-20.0, 20.0))[:, None] * torch.exp(logp_BT - logp_BT.detach())
    return _clipped_surrogate(s_BT, adv_BT, clip_low, clip_high)


def _clipped_surrogate(ratio_BT, adv_BT, clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """max(−ρ·A, −clip(ρ, 1−clip_low, 1+clip_high)·A) and where the clip cut the gradient."""
    unclipped = -ratio_BT * adv_BT
    clipped = -ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high) * adv_BT
    return torch.maximum(unclipped, clipped), clipped > unclipped


def cispo_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, 2025): loss = −sg[clip(ρ, 1−clip_low, 1+clip_high)]·A·logp.

    The importance weight is clipped and detached, but every token keeps its gradient
    (PPO's clip zeroes it). MiniMax-M1 bounds only the top: clip_low=1 removes the bottom.
    Returns (loss_BT, clipped_BT) with clipped marking tokens whose weight was cut."""
    ratio = torch.exp((logp_BT - old_logp_BT).detach().clamp(-20.0, 20.0))
    weight = ratio.clamp(max(1.0 - clip_low, 0.0), 1.0 + clip_high)
    return -weight * adv_BT * logp_BT, weight != ratio


def policy_loss(
    name: str,
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy loss chosen by name (one of POLICY_LOSSES), per token."""
    if name == "ppo":
        return ppo_clip_loss(logp_BT, old_logp_BT, adv_BT, clip_low, clip_high, dual_clip)
    if name == "gspo":
        return gspo_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, clip_low, clip_high)
    if name == "cispo":
        return cispo_loss(logp_BT, old_logp_BT, adv_BT, clip_low, clip_high)
    raise ValueError(f"policy loss must be one of {POLICY_LOSSES}, got {name!r}")


def value_loss(
    values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor, clip: float | None = 0.2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO2): ½·max((V − R)², (V_old + clip(V − V_old, ±clip) − R)²).
    `clip=None` is the plain squared error. Returns (loss_BT, clipped_BT)."""
    plain = (values_BT - returns_BT) ** 2
    if clip is None:
        return 0.5 * plain, torch.zeros_like(plain, dtype=torch.bool)
    v_clipped = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
    cl = (v_clipped - returns_BT) ** 2
    return 0.5 * torch.maximum(plain, cl), cl > plain


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    total_tokens: float,
    total_seqs: float,
    norm_len: float = 1.0,
) -> torch.Tensor:
    """This micro-batch's share of the batch loss. `total_tokens` / `total_seqs` count the
    masked tokens / sequences of the whole batch (all micro-batches, all ranks);
    `norm_len` is a constant (Dr.GRPO: the generation budget), not a batch statistic.

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
