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

from tidal.algorithms import (
    AdvantageInputs,
    Estimator,
    build_estimator,
    informative_groups,
    kl_estimate,
    needs,
    overlong_penalty,
    terminal_rewards,
)
from tidal.config import AlgorithmConfig
from tidal.importing import import_object
from tidal.models.vision import image_runs
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


def token_rewards(episodes: list[Episode], mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-token rewards [B, T] aligned with the shifted mask (entry t: token t+1): each
    turn's reward on the turn's last trained token, the rest of the episode's reward (reward
    functions, shaping) on its last trained token. A reward whose turn has no trained token
    left (a masked segment) moves to the next trained token, so the total is kept."""
    out_BT = terminal_rewards(torch.tensor([e.reward - sum(t.reward for t in e.turns) for e in episodes]), mask_BT)
    for b, e in enumerate(episodes):
        if not any(t.reward for t in e.turns):  # single-turn and outcome-only episodes: nothing to place
            continue
        trained = mask_BT[b].nonzero().squeeze(-1).tolist()
        for t in e.turns:
            if not t.reward or not trained:
                continue
            at = [p for p in trained if p <= t.end - 2]  # shifted: token t.end-1 sits at t.end-2
            pos = at[-1] if at else next((p for p in trained if p > t.end - 2), trained[-1])
            out_BT[b, pos] += t.reward
    return out_BT


def build_batch(
    episodes: list[Episode], algo: AlgorithmConfig, trainer, *, kl_coef: float, estimator: Estimator | None = None,
    baselines: dict[str, float] | None = None, image_token_id: int | None = None,
) -> tuple[TrainBatch, dict[str, float]]:
    """A TrainBatch with per-token advantages by `estimator` (default: algorithm.advantage's) for `episodes` (all trainable, grouped
    by group_id). `trainer` supplies reference log-probs (KL in reward) and critic values (an
    estimator that needs values). `baselines` maps group id → greedy reward (one that needs a
    greedy baseline). Episodes with images (a vision-language
    model) give the batch their images, one list per sequence.

    An episode split into segments by a prefix break (see rollout.py) becomes one training
    sequence per segment that has trained tokens; its advantages are computed over the whole
    episode (the segments joined: rewards and returns run over policy tokens only), and
    log-probs (KL in reward) in each segment's own context, the one the policy sampled in.
    Each segment takes the images whose runs of image pads start inside it, which needs
    `image_token_id` (the model's `Vision.image_token_id`) when such an episode has images."""
    estimator = estimator or build_estimator(algo, import_object)  # default: algorithm.advantage's
    split = any(len(e.segment_spans()) > 1 for e in episodes)
    if split and needs(estimator, "values"):
        raise ValueError(f"algorithm.advantage={algo.advantage} cannot value an episode split by a prefix break "
                         "(rollout.prefix_policy); use a chat template that preserves prefixes or an outcome estimator")
    seg_batch, where = _segments(episodes, image_token_id) if split else (None, [])
    batch = TrainBatch(tokens=[e.tokens for e in episodes], loss_mask=[e.loss_mask for e in episodes],
                       advantages=[], behaviour_logprobs=[e.logprobs for e in episodes],
                       images=[e.image_list() for e in episodes] if any(e.images for e in episodes) else None,
                       routed_experts=_routing(episodes))
    lengths = [len(e.tokens) - 1 for e in episodes]
    mask_BT = pad_rows([m[1:] for m in batch.loss_mask], False, torch.bool)
    token_rewards_BT = token_rewards(episodes, mask_BT)
    metrics: dict[str, float] = {}
    if algo.kl_in == "reward" and algo.kl_coef > 0:  # a reference model is loaded
        # veRL/OpenRLHF's KL-in-reward: β·KL(π_prox ‖ π_ref) per token, before advantages.
        scored = seg_batch if split else batch
        scored.old_logprobs = trainer.logprobs(scored)  # also the PPO anchor: no second pass later
        kl_rows = (kl_estimate(pad_rows(scored.old_logprobs, 0.0, torch.float32),
                               pad_rows(trainer.ref_logprobs(scored), 0.0, torch.float32), algo.kl_estimator)
                   * pad_rows([m[1:] for m in scored.loss_mask], False, torch.bool))
        kl_BT = torch.zeros_like(token_rewards_BT)
        if split:
            for r, (i, a) in enumerate(where):
                n = len(seg_batch.tokens[r]) - 1
                kl_BT[i, a:a + n] = kl_rows[r, :n]
        else:
            kl_BT = kl_rows
        token_rewards_BT = token_rewards_BT - kl_coef * kl_BT
        metrics["kl"] = float(kl_BT.sum() / mask_BT.sum().clamp(min=1))
    values_BT = baseline_N = None
    if needs(estimator, "values"):
        batch.old_values = trainer.values(batch)
        values_BT = pad_rows(batch.old_values, 0.0, torch.float32)
    if needs(estimator, "greedy_baseline"):
        baseline_N = torch.tensor([baselines[e.group_id] for e in episodes])
    adv_BT, returns_BT = estimator(AdvantageInputs(token_rewards_BT, mask_BT, group_index(episodes),
                                                   values_BT=values_BT, baseline_N=baseline_N))
    batch.advantages = unpad_positions(adv_BT, lengths)
    if returns_BT is not None:
        batch.returns = unpad_positions(returns_BT, lengths)
        v, r = values_BT[mask_BT].double(), returns_BT[mask_BT].double()
        if r.numel() > 1 and r.var() > 0:
            metrics["critic/explained_var"] = float(1 - (r - v).var() / r.var())
        metrics["critic/value_mean"] = float(v.mean()) if v.numel() else 0.0
    keep = list(range(len(episodes)))
    if algo.overlong_filter:
        keep = [i for i, e in enumerate(episodes) if e.status != Status.TRUNCATED]
        metrics["overlong_filtered"] = float(len(episodes) - len(keep))
    if split:
        seg_batch.advantages = [batch.advantages[i][a:a + len(seg_batch.tokens[r]) - 1] for r, (i, a) in enumerate(where)]
        metrics["rollout/segments_trained"] = float(len(where))
        return seg_batch.select([r for r, (i, _) in enumerate(where) if i in set(keep)]), metrics
    return (batch.select(keep) if algo.overlong_filter else batch), metrics


def _segments(episodes: list[Episode], image_token_id: int | None = None) -> tuple[TrainBatch, list[tuple[int, int]]]:
    """One training sequence per segment with trained tokens, and for each its (episode
    index, start offset). Per-position lists are filled in by `build_batch`. A segment's
    images are those of the episode's image runs that start inside it (`segment_images`)."""
    tokens, masks, behaviour, images, where, routed = [], [], [], [], [], []
    for i, e in enumerate(episodes):
        spans = e.segment_spans()
        per_span = segment_images(e, spans, image_token_id) if e.images else [[] for _ in spans]
        for (a, b), ims in zip(spans, per_span):
            if not any(e.loss_mask[a + 1:b]):
                continue
            tokens.append(e.tokens[a:b])
            masks.append(e.loss_mask[a:b])
            behaviour.append(e.logprobs[a:b])
            images.append(ims)
            where.append((i, a))
            routed.append(None if e.routed_experts is None else e.routed_experts[a:b])
    return TrainBatch(tokens, masks, [], behaviour, images=images if any(images) else None,
                      routed_experts=routed if any(r is not None for r in routed) else None), where


def _routing(episodes: list[Episode]) -> list | None:
    """The engine's experts per episode (a mixture of experts), None when no episode has them."""
    routed = [e.routed_experts for e in episodes]
    return routed if any(r is not None for r in routed) else None


def segment_images(episode: Episode, spans: list[tuple[int, int]], image_token_id: int | None) -> list[list]:
    """The episode's ImageBlobs per span of its tokens: image k (`episode.images[k]`) belongs to
    the span where the k-th run of image pads starts. A later segment re-renders the
    conversation, so it holds its own runs, and so its own copies, of earlier images."""
    if image_token_id is None:
        raise ValueError(f"episode {episode.episode_id} has images and is split into segments by a prefix break: "
                         "build_batch needs image_token_id (the model's Vision.image_token_id) to give each "
                         "segment its images")
    runs = image_runs(episode.tokens, image_token_id)
    if len(runs) != len(episode.images):
        raise ValueError(f"episode {episode.episode_id}: {len(runs)} runs of image pads (token {image_token_id}) in "
                         f"its tokens but {len(episode.images)} images")
    blobs = episode.image_list()
    return [[blob for (s, _), blob in zip(runs, blobs) if a <= s < b] for a, b in spans]


