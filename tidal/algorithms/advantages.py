"""Advantage estimators.

Legend: N episodes (= B sequences) in the batch; G groups (the samples of one prompt);
T token positions, aligned with the trainer's targets (position t scores token t+1).
`mask_BT` is True on tokens the policy generated.

An estimator is a callable of `AdvantageInputs` that declares what it needs beyond the rewards
(`Estimator`): the run gives a critic's values to one that declares `needs_values`, and rolls out
a greedy response per prompt for one that declares `needs_greedy_baseline`. `build_estimator`
makes the one `algorithm.advantage` names: a built-in, or a user's class or function by path.

Every estimator ends as a per-token advantage `adv_BT` (0 off the mask), so the trainer
has one path for all of them. Sequence-level estimators (GRPO, Dr.GRPO, RLOO, ReMax)
give each token of a sequence the sequence's advantage; token-level ones (GAE,
REINFORCE++) differ per token. Rewards arrive per token too (`token_rewards_BT`: the
episode reward on its last policy token plus any per-token penalty such as KL-in-reward);
a sequence-level estimator scores a sequence by their sum.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce++", "reinforce++-baseline", "remax", "gae")


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
    count_G, mean_G = _group_stats(rewards_N, group_N)
    centered_N = rewards_N - mean_G[group_N]
    if scale == "group":
        ss_G = torch.zeros_like(count_G).index_add_(0, group_N, centered_N**2)
        std_G = (ss_G / (count_G - 1).clamp(min=1)).sqrt()
        centered_N = centered_N / (std_G[group_N] + eps)
    elif scale == "batch":
        std = rewards_N.std() if rewards_N.numel() > 1 else rewards_N.new_zeros(())
        centered_N = centered_N / (std + eps)
    return centered_N.to(torch.float32)


def rloo_advantages(rewards_N: torch.Tensor, group_N: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i − mean_{j≠i in g(i)} r_j = n/(n−1)·(r_i − mean_g).
    A group of one has no other sample to compare with: A = 0."""
    rewards_N = rewards_N.to(torch.float64)
    count_G, mean_G = _group_stats(rewards_N, group_N)
    n_N = count_G[group_N]
    adv_N = torch.where(n_N > 1, n_N / (n_N - 1).clamp(min=1) * (rewards_N - mean_G[group_N]), 0.0)
    return adv_N.to(torch.float32)


def remax_advantages(rewards_N: torch.Tensor, baseline_N: torch.Tensor) -> torch.Tensor:
    """ReMax (Li et al. 2023): A_i = r_i − r(greedy response to the same prompt)."""
    return (rewards_N.to(torch.float64) - baseline_N.to(torch.float64)).to(torch.float32)


def terminal_rewards(rewards_N: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-token rewards with each episode's reward on its last policy token, 0 elsewhere."""
    out = torch.zeros(mask_BT.shape, dtype=torch.float32, device=mask_BT.device)
    pos = torch.arange(mask_BT.shape[1], device=mask_BT.device)
    last_B = torch.where(mask_BT, pos, -1).max(-1).values
    has = last_B >= 0
    out[has.nonzero().squeeze(-1), last_B[has]] = rewards_N[has].to(torch.float32)
    return out


def discounted_returns(token_rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = Σ_{s ≥ t, s on the mask} γ^(k(s)−k(t)) r_s, where k counts policy tokens only:
    tokens the environment inserted (multi-turn) neither earn nor discount. 0 off the mask."""
    ret_BT = torch.zeros_like(token_rewards_BT, dtype=torch.float32)
    running = torch.zeros(token_rewards_BT.shape[0], dtype=torch.float32, device=token_rewards_BT.device)
    for t in reversed(range(token_rewards_BT.shape[1])):
        m = mask_BT[:, t]
        running = torch.where(m, token_rewards_BT[:, t] + gamma * running, running)
        ret_BT[:, t] = torch.where(m, running, 0.0)
    return ret_BT


def gae(
    token_rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over policy tokens.

    δ_t = r_t + γ V(t') − V(t), A_t = δ_t + γλ A_t', with t' the next policy token (past
    the last one V = 0: the episode ends). Returns (advantages_BT, returns_BT = A + V),
    both 0 off the mask. `values_BT[t]` is the critic's value of the state that
    generated the token at position t."""
    B, T = token_rewards_BT.shape
    adv_BT = torch.zeros(B, T, dtype=torch.float32, device=values_BT.device)
    next_value = torch.zeros(B, dtype=torch.float32, device=values_BT.device)
    last = torch.zeros(B, dtype=torch.float32, device=values_BT.device)
    values_BT = values_BT.float()
    for t in reversed(range(T)):
        m = mask_BT[:, t]
        delta = token_rewards_BT[:, t] + gamma * next_value - values_BT[:, t]
        last = torch.where(m, delta + gamma * lam * last, last)
        next_value = torch.where(m, values_BT[:, t], next_value)
        adv_BT[:, t] = torch.where(m, last, 0.0)
    returns_BT = torch.where(mask_BT, adv_BT + values_BT, 0.0)
    return adv_BT, returns_BT


def masked_whiten(x_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float = 1e-8, shift_mean: bool = True) -> torch.Tensor:
    """(x − mean) / std over the tokens on the mask of the whole batch; 0 off the mask.
    shift_mean=False divides by the std only (x already centred)."""
    m = mask_BT.to(torch.float64)
    n = m.sum().clamp(min=1)
    x = x_BT.to(torch.float64)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    centred = x - mean if shift_mean else x
    return torch.where(mask_BT, centred / (var.sqrt() + eps), 0.0).to(torch.float32)


@dataclass
class AdvantageInputs:
    """What an estimator gets. `values_BT` only for one that declares `needs_values` (the critic's
    value of the state before each token), `baseline_N` only for one that declares
    `needs_greedy_baseline` (each episode's prompt's greedy reward)."""

    token_rewards_BT: torch.Tensor
    mask_BT: torch.Tensor
    group_N: torch.Tensor
    values_BT: torch.Tensor | None = None
    baseline_N: torch.Tensor | None = None


class Estimator(Protocol):
    """An advantage estimator: (adv_BT, returns_BT or None) from AdvantageInputs; 0 off the mask.
    It declares what it needs, and the run provides it: `needs_values` (a critic is trained, its
    values computed before the update; the returns are its regression target) and
    `needs_greedy_baseline` (one more, greedy, rollout per prompt). Both default to False."""

    needs_values: ClassVar[bool]
    needs_greedy_baseline: ClassVar[bool]

    def __call__(self, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass(frozen=True)
class GroupNormalized:
    """grpo (scale group | batch | none) and drgrpo (none): (r − mean_g) / std."""

    scale: str = "group"
    needs_values: ClassVar[bool] = False
    needs_greedy_baseline: ClassVar[bool] = False

    def __call__(self, x: AdvantageInputs) -> tuple[torch.Tensor, None]:
        return _broadcast(group_advantages(x.token_rewards_BT.sum(-1), x.group_N, self.scale), x.mask_BT), None


@dataclass(frozen=True)
class LeaveOneOut:
    """rloo: r − mean of the other samples of the group."""

    needs_values: ClassVar[bool] = False
    needs_greedy_baseline: ClassVar[bool] = False

    def __call__(self, x: AdvantageInputs) -> tuple[torch.Tensor, None]:
        return _broadcast(rloo_advantages(x.token_rewards_BT.sum(-1), x.group_N), x.mask_BT), None


@dataclass(frozen=True)
class GreedyBaseline:
    """remax: r − r_greedy."""

    needs_values: ClassVar[bool] = False
    needs_greedy_baseline: ClassVar[bool] = True

    def __call__(self, x: AdvantageInputs) -> tuple[torch.Tensor, None]:
        if x.baseline_N is None:
            raise ValueError("remax needs baseline_N, the reward of each prompt's greedy response")
        return _broadcast(remax_advantages(x.token_rewards_BT.sum(-1), x.baseline_N), x.mask_BT), None


@dataclass(frozen=True)
class WhitenedReturns:
    """reinforce++ (whiten_batch(G_t)) and reinforce++-baseline (the group mean reward subtracted
    first, then scaled by the batch std without shifting)."""

    group_baseline: bool = False
    gamma: float = 1.0
    needs_values: ClassVar[bool] = False
    needs_greedy_baseline: ClassVar[bool] = False

    def __call__(self, x: AdvantageInputs) -> tuple[torch.Tensor, None]:
        rewards_BT = x.token_rewards_BT
        if self.group_baseline:
            _, mean_G = _group_stats(rewards_BT.sum(-1).to(torch.float64), x.group_N)
            rewards_BT = rewards_BT - terminal_rewards(mean_G[x.group_N].float(), x.mask_BT)
        returns_BT = discounted_returns(rewards_BT, x.mask_BT, self.gamma)
        return masked_whiten(returns_BT, x.mask_BT, shift_mean=not self.group_baseline), None


@dataclass(frozen=True)
class GeneralizedAdvantage:
    """gae: whiten_batch(GAE(γ, λ)) over the critic's values; returns A + V for the critic."""

    gamma: float = 1.0
    lam: float = 0.95
    needs_values: ClassVar[bool] = True
    needs_greedy_baseline: ClassVar[bool] = False

    def __call__(self, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
        if x.values_BT is None:
            raise ValueError("gae needs values_BT from a critic")
        adv_BT, returns_BT = gae(x.token_rewards_BT, x.values_BT, x.mask_BT, self.gamma, self.lam)
        return masked_whiten(adv_BT, x.mask_BT), returns_BT


# The built-in estimators by name, each built from (std_scale, gamma, lam).
BUILTIN: dict[str, Callable[[str, float, float], Estimator]] = {
    "grpo": lambda std_scale, gamma, lam: GroupNormalized(std_scale),
    "drgrpo": lambda std_scale, gamma, lam: GroupNormalized("none"),
    "rloo": lambda std_scale, gamma, lam: LeaveOneOut(),
    "reinforce++": lambda std_scale, gamma, lam: WhitenedReturns(False, gamma),
    "reinforce++-baseline": lambda std_scale, gamma, lam: WhitenedReturns(True, gamma),
    "remax": lambda std_scale, gamma, lam: GreedyBaseline(),
    "gae": lambda std_scale, gamma, lam: GeneralizedAdvantage(gamma, lam),
}
BUILTIN_NEEDS = {"remax": ("greedy_baseline",), "gae": ("values",)}  # for config checks, without building


def needs(estimator: Estimator, what: str) -> bool:
    """Whether `estimator` declares that it needs `what` ("values" or "greedy_baseline")."""
    if what not in ("values", "greedy_baseline"):
        raise ValueError(f"an estimator declares needs_values and needs_greedy_baseline, not needs_{what}")
    return bool(getattr(estimator, f"needs_{what}", False))


def build_estimator(algo: Any, import_object: Callable | None = None) -> Estimator:
    """`algorithm.advantage`: a built-in name (BUILTIN), or a dotted or file path to a class
    built as `cls(algo, **algorithm.advantage_args)` or to a function called as
    `fn(inputs, **algorithm.advantage_args)`; either returns (adv_BT, returns_BT or None) and may
    declare `needs_values` / `needs_greedy_baseline` (class or function attributes)."""
    name, args = algo.advantage, dict(getattr(algo, "advantage_args", None) or {})
    if name in BUILTIN:
        if args:
            raise ValueError(f"algorithm.advantage_args is for an estimator of your own; `{name}` takes its "
                             "settings from the algorithm section (std_scale, gamma, lam)")
        return BUILTIN[name](algo.std_scale, algo.gamma, algo.lam)
    obj = import_object(name, "algorithm.advantage")
    if isinstance(obj, type):
        return obj(algo, **args)
    if not callable(obj):
        raise TypeError(f"`algorithm.advantage`: `{name}` is not a class or function")
    fn = functools.partial(obj, **args)
    for what in ("values", "greedy_baseline"):  # a function's own declarations carry over
        setattr(fn, f"needs_{what}", needs(obj, what))
    return fn


def estimate_advantages(
    name: str,
    token_rewards_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    group_N: torch.Tensor,
    *,
    std_scale: str = "group",
    values_BT: torch.Tensor | None = None,
    baseline_N: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Advantages of the built-in estimator `name` (one of ESTIMATORS) as (adv_BT, returns_BT).
    Returns are only produced by "gae" (the critic's regression target); else None.

    grpo                  (r − mean_g) / std (std_scale: group | batch | none)
    drgrpo                r − mean_g (no std: Dr.GRPO's unbiased form)
    rloo                  r − mean of the other samples of the group
    remax                 r − r_greedy (baseline_N: reward of the greedy response)
    reinforce++           whiten_batch(G_t), G_t the discounted return of token rewards
    reinforce++-baseline  whiten_batch(G_t) after subtracting the group mean reward
    gae                   whiten_batch(GAE(γ, λ)) with the critic's values_BT
    """
    if name not in BUILTIN:
        raise ValueError(f"advantage estimator must be one of {ESTIMATORS}, got {name!r}")
    estimator = BUILTIN[name](std_scale, gamma, lam)
    return estimator(AdvantageInputs(token_rewards_BT, mask_BT, group_N, values_BT, baseline_N))


def _group_stats(rewards_N: torch.Tensor, group_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    G = int(group_N.max().item()) + 1 if group_N.numel() else 0
    count_G = torch.zeros(G, dtype=rewards_N.dtype, device=rewards_N.device).index_add_(0, group_N, torch.ones_like(rewards_N))
    mean_G = torch.zeros_like(count_G).index_add_(0, group_N, rewards_N) / count_G.clamp(min=1)
    # the rounded mean of equal rewards can miss them by an ulp; make it exact so r − mean = 0
    lo_G = torch.full_like(count_G, torch.inf).scatter_reduce(0, group_N, rewards_N, "amin")
    hi_G = torch.full_like(count_G, -torch.inf).scatter_reduce(0, group_N, rewards_N, "amax")
    return count_G, torch.where(lo_G == hi_G, lo_G, mean_G)


def _broadcast(adv_N: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return torch.where(mask_BT, adv_N.to(torch.float32)[:, None], 0.0)
