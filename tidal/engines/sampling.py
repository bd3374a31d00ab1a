"""Batched sampling whose randomness belongs to the request, not to the batch.

Each request carries a seed. The uniform noise for token j at generation position t of a
request is a hash of (seed, t, j) (splitmix64), so a request samples the same tokens
whether it runs alone or in any batch, in any order — what makes resumed runs and
engine/trainer comparisons reproducible. Sampling is Gumbel-max over the
temperature-scaled logits after top-k/top-p masking.

Legend: B batch rows, V vocabulary.
"""

from __future__ import annotations

import torch

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as signed int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift on int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniform_noise(seeds_B: torch.Tensor, positions_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0,1) float32 noise [B, V], a pure function of (seed, position, token index)."""
    row = splitmix64(splitmix64(seeds_B.long()) ^ (positions_B.long() * 0x2545F491))  # [B]
    cols = torch.arange(vocab, dtype=torch.long, device=seeds_B.device)
    z = splitmix64(row[:, None] + cols[None, :] * _GOLDEN)
    # 23 random bits: (bits + 0.5) / 2^23 is exact in float32, so u < 1 strictly (with 24
    # bits the top value rounds to 1.0, its Gumbel noise is +inf and it beats any mask).
    bits = _shr(z, 41).to(torch.float32)
    return (bits + 0.5) / float(1 << 23)


def mask_top_k_top_p(logits_BV: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus top-p to -inf (k=0, p=1 mean off)."""
    if bool((top_k_B <= 0).all()) and bool((top_p_B >= 1.0).all()):
        return logits_BV
    sorted_logits, order = logits_BV.sort(dim=-1, descending=True)
    V = logits_BV.shape[-1]
    ranks = torch.arange(V, device=logits_BV.device)[None, :]
    k = torch.where(top_k_B > 0, top_k_B, torch.full_like(top_k_B, V))
    drop = ranks >= k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    # Rows with p=1 keep everything: float cumsum can reach 1.0 before the tail, and a
    # request must sample the same whether or not it shares a batch with a top-p row.
    drop |= (mass_before >= top_p_B[:, None]) & (top_p_B < 1.0)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits_BV).scatter_(-1, order, sorted_logits)


def sample(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    seeds_B: torch.Tensor,
    positions_B: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token [B] and its log-prob [B] under softmax(logits / T) (T=1 for greedy rows).

    The log-prob is of the untruncated temperature-scaled distribution: the quantity the
    trainer recomputes (top-k/top-p change which tokens can be drawn, not their log-prob).
    """
    logits_BV = logits_BV.float()
    greedy_B = temperature_B <= 0
    t_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B)
    scaled_BV = logits_BV / t_B[:, None]
    logp_BV = scaled_BV.log_softmax(dim=-1)
    masked_BV = mask_top_k_top_p(scaled_BV, top_k_B, top_p_B)
    gumbel_BV = -torch.log(-torch.log(uniform_noise(seeds_B, positions_B, logits_BV.shape[-1])))
    sampled_B = (masked_BV + gumbel_BV).argmax(dim=-1)
    tokens_B = torch.where(greedy_B, logits_BV.argmax(dim=-1), sampled_B)
    return tokens_B, logp_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
