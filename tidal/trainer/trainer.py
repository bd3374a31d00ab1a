"""The Trainer role: policy, optimizer, optional frozen reference; micro-batching by tokens.

`forward_backward` accumulates gradients over micro-batches whose losses are each a
share of the batch loss under one normalization (tidal.algorithms.aggregate), so the
gradient is the same however the batch is split. `optim_step` clips and steps.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tidal.algorithms import aggregate, entropy_from_logits, kl_estimate, ppo_clip_loss, token_logprobs
from tidal.config import AlgorithmConfig, TrainConfig
from tidal.models import load_model


@dataclass
class TrainBatch:
    """What the trainer needs of a set of episodes. Lists are per sequence."""

    tokens: list[list[int]]
    loss_mask: list[list[bool]]
    advantages: list[float]
    behaviour_logprobs: list[list[float]]  # engine log-probs, 0 off the mask
    old_logprobs: list[list[float]] | None = None  # proximal policy; None: on-policy (= current, detached)

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, idx: list[int]) -> "TrainBatch":
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        return TrainBatch(pick(self.tokens), pick(self.loss_mask), pick(self.advantages),
                          pick(self.behaviour_logprobs), pick(self.old_logprobs))


def micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Split sequence indices into micro-batches whose padded size (rows × longest) stays
    within `token_budget`. Sorting by length keeps padding low; the split never changes the
    loss (see module docstring)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if lengths[i] > token_budget:
            raise ValueError(f"a sequence of {lengths[i]} tokens exceeds train.micro_batch_tokens={token_budget}")
        if cur and (len(cur) + 1) * lengths[i] > token_budget:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def _pad(rows: list[list], value, dtype, device="cpu") -> torch.Tensor:
    L = max(len(r) for r in rows)
    out = torch.full((len(rows), L), value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out.to(device)


class Trainer:
    def __init__(self, model_path: str, train: TrainConfig, algo: AlgorithmConfig, *,
                 dtype: str = "float32", temperature: float = 1.0, pad_token_id: int = 0, device: str = "cpu"):
        self.train_cfg, self.algo = train, algo
        self.temperature = temperature if temperature > 0 else 1.0
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.model = load_model(model_path, dtype=dtype, device=device)
        self.model.config.use_cache = False
        self.model.train()
        self.ref_model = None
        if algo.kl_coef > 0:  # no reference model is loaded when it cannot matter
            self.ref_model = load_model(model_path, dtype=dtype, device=device).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=train.lr, betas=train.betas, weight_decay=train.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(train))
        self.version = 0

    # -- forward passes -------------------------------------------------------------------
    def _forward(self, model, tokens: list[list[int]]):
        ids = _pad(tokens, self.pad_token_id, torch.long, self.device)
        attn = _pad([[1] * len(t) for t in tokens], 0, torch.long, self.device)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        return logits, ids[:, 1:]

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Current-policy log-probs of every token after the first (position 0 scores token 1)."""
        out: list[list[float]] = [[] for _ in range(len(batch))]
        for idx in micro_batches([len(t) for t in batch.tokens], self.train_cfg.micro_batch_tokens):
            logits, targets = self._forward(self.model, [batch.tokens[i] for i in idx])
            lp = token_logprobs(logits, targets, self.temperature)
            for row, i in enumerate(idx):
                out[i] = lp[row, : len(batch.tokens[i]) - 1].tolist()
        return out

    def forward_backward(self, batch: TrainBatch) -> dict[str, float]:
        """Accumulate the gradient of the batch loss; return token-weighted metrics."""
        algo = self.algo
        masks = [m[1:] for m in batch.loss_mask]  # aligned with targets
        total_tokens = float(sum(sum(m) for m in masks))
        total_seqs = float(sum(1 for m in masks if any(m)))
        norm_len = float(max(len(m) for m in masks))
        sums = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip_frac": 0.0,
                "logprob_abs_diff": 0.0, "mismatch_kl": 0.0}
        max_diff = 0.0
        for idx in micro_batches([len(t) for t in batch.tokens], self.train_cfg.micro_batch_tokens):
            logits, targets = self._forward(self.model, [batch.tokens[i] for i in idx])
            mask = _pad([masks[i] for i in idx], False, torch.bool, self.device)
            logp = token_logprobs(logits, targets, self.temperature)
            behav = _pad([batch.behaviour_logprobs[i][1:] for i in idx], 0.0, torch.float32, self.device)
            if batch.old_logprobs is None:
                old = logp.detach()
            else:
                old = _pad([batch.old_logprobs[i] for i in idx], 0.0, torch.float32, self.device)
            adv = torch.tensor([batch.advantages[i] for i in idx], dtype=torch.float32, device=self.device)
            adv = adv[:, None].expand_as(logp)
            pg_BT, clipped_BT = ppo_clip_loss(logp, old, adv, algo.clip_low, algo.clip_high)
            loss_BT = pg_BT
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logits, _ = self._forward(self.ref_model, [batch.tokens[i] for i in idx])
                    ref_logp = token_logprobs(ref_logits, targets, self.temperature)
                kl_BT = kl_estimate(logp, ref_logp, algo.kl_estimator)
                loss_BT = loss_BT + algo.kl_coef * kl_BT
                sums["kl"] += float((kl_BT.detach() * mask).sum())
            loss = aggregate(loss_BT, mask, algo.loss_agg, total_tokens, total_seqs, norm_len)
            loss.backward()
            with torch.no_grad():
                m = mask.float()
                sums["loss"] += float(loss)
                sums["pg_loss"] += float((pg_BT * m).sum())
                sums["entropy"] += float((entropy_from_logits(logits.detach(), self.temperature) * m).sum())
                sums["clip_frac"] += float((clipped_BT.float() * m).sum())
                diff = (logp.detach() - behav).abs() * m
                sums["logprob_abs_diff"] += float(diff.sum())
                sums["mismatch_kl"] += float((kl_estimate(behav, logp.detach(), "k3") * m).sum())
                max_diff = max(max_diff, float(diff.max()) if diff.numel() else 0.0)
        denom = max(total_tokens, 1.0)
        metrics = {k: v / denom for k, v in sums.items() if k != "loss"}
        metrics["loss"] = sums["loss"]
        metrics["logprob_max_abs_diff"] = max_diff
        if self.ref_model is None:
            metrics.pop("kl")
        return metrics

    def optim_step(self) -> dict[str, float]:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train_cfg.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.version += 1
        return {"grad_norm": float(grad_norm), "lr": lr, "skipped_step": float(not torch.isfinite(grad_norm))}

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, path: str | Path, tokenizer=None) -> None:
        """model/ is a normal HF directory (loadable by every engine and `tidal eval`)."""
        path = Path(path)
        self.model.save_pretrained(path / "model", safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(path / "model")
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
             "version": self.version, "rng": rng_state()},
            path / "trainer_state.pt",
        )

    def load(self, path: str | Path) -> None:
        from safetensors.torch import load_file

        path = Path(path)
        state = load_file(str(path / "model" / "model.safetensors"))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
        self.model.tie_weights()
        st = torch.load(path / "trainer_state.pt", weights_only=False, map_location=self.device)
        self.optimizer.load_state_dict(st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        self.version = st["version"]
        set_rng_state(st["rng"])


def lr_factor(train: TrainConfig):
    """Multiplier of the peak lr at optimizer step s: linear warm-up, then constant or cosine."""
    total = max(train.steps * train.mini_batches * train.epochs, 1)

    def factor(s: int) -> float:
        warm = min(1.0, (s + 1) / train.warmup_steps) if train.warmup_steps > 0 else 1.0
        if train.lr_schedule == "constant":
            return warm
        progress = min(max(s - train.warmup_steps, 0) / max(total - train.warmup_steps, 1), 1.0)
        return warm * (train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    return factor


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
