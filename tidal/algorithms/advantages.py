"""Advantage estimators.

Legend: N episodes in the batch; G groups (samples of one prompt share a group).
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards_N: torch.Tensor,
    group_N: torch.Tensor,
    scale: str = "group",
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO: A_i = (r_i − mean_{g(i)}) / (std + eps), one scalar per episode.

    `group_N` holds each episode's group index in [0, G). `scale` picks the std:
    "group" — std of the episode's group (GRPO, Shao et al. 2024);
    "batch" — std of all rewards in the batch (REINFORCE++-baseline style);
    "none"  — no division (Dr.GRPO, Liu et al. 2025).
    The std is the unbiased sample std (torch.std default); a group of one has A = 0.
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    rewards_N = rewards_N.to(torch.float64)
    G = int(group_N.max().item()) + 1 if group_N.numel() else 0
    count_G = torch.zeros(G, dtype=torch.float64).index_add_(0, group_N, torch.ones_like(rewards_N))
    mean_G = torch.zeros(G, dtype=torch.float64).index_add_(0, group_N, rewards_N) / count_G.clamp(min=1)
    centered_N = rewards_N - mean_G[group_N]
    if scale == "group":
        ss_G = torch.zeros(G, dtype=torch.float64).index_add_(0, group_N, centered_N**2)
        std_G = (ss_G / (count_G - 1).clamp(min=1)).sqrt()
        centered_N = centered_N / (std_G[group_N] + eps)
    elif scale == "batch":
        std = rewards_N.std() if rewards_N.numel() > 1 else rewards_N.new_zeros(())
        centered_N = centered_N / (std + eps)
    return centered_N.to(torch.float32)
