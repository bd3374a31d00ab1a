"""DAPO's batch shaping (Yu et al. 2025): the soft overlong penalty and the selection of
groups that carry a learning signal (dynamic sampling).

Legend: N episodes, G groups.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths_N: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """Soft overlong punishment, ≤ 0, added to the reward:
    0 for |y| ≤ max_len − buffer; factor·((max_len − buffer) − |y|)/buffer inside the last
    `buffer` tokens (linear from 0 to −factor); −factor beyond max_len. buffer=0: off."""
    if buffer <= 0:
        return torch.zeros_like(lengths_N, dtype=torch.float32)
    lengths = lengths_N.to(torch.float32)
    free = float(max_len - buffer)
    pen = ((free - lengths) / buffer).clamp(min=-1.0, max=0.0)
    return factor * pen


def informative_groups(rewards_N: torch.Tensor, group_N: torch.Tensor, eps: float = 1e-9) -> torch.Tensor:
    """bool_G: True for groups whose rewards are not all equal. A group with zero reward
    variance has zero advantage under every group baseline, so it adds no gradient
    (only noise in the normalizer): DAPO's dynamic sampling drops it."""
    rewards_N = rewards_N.to(torch.float64)
    G = int(group_N.max().item()) + 1 if group_N.numel() else 0
    big = torch.full((G,), float("inf"), dtype=torch.float64, device=rewards_N.device)
    lo_G = big.scatter_reduce(0, group_N, rewards_N, reduce="amin")
    hi_G = (-big).scatter_reduce(0, group_N, rewards_N, reduce="amax")
    return (hi_G - lo_G) > eps
