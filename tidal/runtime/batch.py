"""From scored episodes to a TrainBatch: reward shaping, KL-in-reward, critic values and
advantages, in one place for every estimator.

Order (DAPO's and veRL's): the soft overlong penalty shapes rewards as soon as episodes
are scored, before dynamic sampling looks at group variance; per-token rewards (the
episode reward on its last policy token, minus β·KL when the KL sits in the reward) then
go to the estimator named in config; overlong filtering drops truncated episodes from the
loss only after they served in their group's baseline.
"""

from __future__ import annotations

import torch

from tidal.algorithms import estimate_advantages, informative_groups, kl_estimate, overlong_penalty, terminal_rewards
from tidal.config import AlgorithmConfig
from tidal.trainer.trainer import TrainBatch, pad_rows
from tidal.types import Episode, Status


def shape_rewards(episodes: list[Episode], algo: AlgorithmConfig, max_len: int) -> None:
    """DAPO's soft overlong penalty, added to the reward and recorded as reward part `overlong`."""
    if algo.overlong_buffer <= 0:
        return
    scored = [e for e in episodes if e.status.trainable]
    if not scored:
        return
    lengths = torch.tensor([e.num_policy_tokens for e in scored])
    for e, pen in zip(scored, overlong_penalty(lengths, max_len, algo.overlong_buffer, algo.overlong_penalty).tolist()):
        e.reward += pen
        e.reward_parts["overlong"] = pen


def group_index(episodes: list[Episode]) -> torch.Tensor:
    groups: dict[str, int] = {}
    return torch.tensor([groups.setdefault(e.group_id, len(groups)) for e in episodes], dtype=torch.long)


def informative(episodes: list[Episode]) -> set[str]:
    """Group ids whose trainable episodes' rewards are not all equal (dynamic sampling)."""
    if not episodes:
        return set()
    ids = list(dict.fromkeys(e.group_id for e in episodes))
    keep_G = informative_groups(torch.tensor([e.reward for e in episodes], dtype=torch.float64), group_index(episodes))
    return {g for g, k in zip(ids, keep_G.tolist()) if k}


def unpad_positions(x_BT: torch.Tensor, lengths: list[int]) -> list[list[float]]:
    return [x_BT[i, :n].tolist() for i, n in enumerate(lengths)]


def build_batch(
    episodes: list[Episode], algo: AlgorithmConfig, trainer, *, kl_coef: float,
    baselines: dict[str, float] | None = None,
) -> tuple[TrainBatch, dict[str, float]]:
    """A TrainBatch with per-token advantages for `episodes` (all trainable, grouped by
    group_id). `trainer` supplies reference log-probs (KL in reward) and critic values (gae).
    `baselines` maps group id → greedy reward (remax)."""
    batch = TrainBatch(tokens=[e.tokens for e in episodes], loss_mask=[e.loss_mask for e in episodes],
                       advantages=[], behaviour_logprobs=[e.logprobs for e in episodes])
    lengths = [len(e.tokens) - 1 for e in episodes]
    mask_BT = pad_rows([m[1:] for m in batch.loss_mask], False, torch.bool)
    token_rewards_BT = terminal_rewards(torch.tensor([e.reward for e in episodes]), mask_BT)
    metrics: dict[str, float] = {}
    if algo.kl_in == "reward" and algo.kl_coef > 0:  # a reference model is loaded
        # veRL/OpenRLHF's KL-in-reward: β·KL(π_prox ‖ π_ref) per token, before advantages.
        batch.old_logprobs = trainer.logprobs(batch)  # also the PPO anchor: no second pass later
        prox_BT = pad_rows(batch.old_logprobs, 0.0, torch.float32)
        kl_BT = kl_estimate(prox_BT, pad_rows(trainer.ref_logprobs(batch), 0.0, torch.float32),
                            algo.kl_estimator) * mask_BT
        token_rewards_BT = token_rewards_BT - kl_coef * kl_BT
        metrics["kl"] = float(kl_BT.sum() / mask_BT.sum().clamp(min=1))
    values_BT = None
    if algo.advantage == "gae":
        batch.old_values = trainer.values(batch)
        values_BT = pad_rows(batch.old_values, 0.0, torch.float32)
    baseline_N = None
    if algo.advantage == "remax":
        baseline_N = torch.tensor([baselines[e.group_id] for e in episodes])
    adv_BT, returns_BT = estimate_advantages(
        algo.advantage, token_rewards_BT, mask_BT, group_index(episodes), std_scale=algo.std_scale,
        values_BT=values_BT, baseline_N=baseline_N, gamma=algo.gamma, lam=algo.lam,
    )
    batch.advantages = unpad_positions(adv_BT, lengths)
    if returns_BT is not None:
        batch.returns = unpad_positions(returns_BT, lengths)
        v, r = values_BT[mask_BT].double(), returns_BT[mask_BT].double()
        if r.numel() > 1 and r.var() > 0:
            metrics["critic/explained_var"] = float(1 - (r - v).var() / r.var())
        metrics["critic/value_mean"] = float(v.mean()) if v.numel() else 0.0
    if algo.overlong_filter:
        keep = [i for i, e in enumerate(episodes) if e.status != Status.TRUNCATED]
        metrics["overlong_filtered"] = float(len(episodes) - len(keep))
        batch = batch.select(keep)
    return batch, metrics
