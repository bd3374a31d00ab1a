"""The trainer's side of mixture-of-experts routing: replay laid out in the forward's tokens,
routing metrics, the balancing loss (docs/moe.md).

A forward runs on rows the trainer lays out (padded, packed or with shared prompts:
tidal/trainer/layout.py); `flat_BT[i, t]` is the flat position, in [rows × width], of token t of
sequence i for t < len - 1 (the last token's hidden state scores nothing, so its routing never
matters). Replay records are per sequence, [tokens, layers, k] (tidal/models/moe.py's compact
record: the engine's for R3, the trainer's log-prob pass's for R2); they are scattered to those
positions, and every position without a record (prompt and observation tokens, padding) is
routed by the trainer itself.

Metrics, per update (`RoutingStats`), over the policy tokens the forward routes (the tokens the
engine generated, but each sequence's last):
- `moe/imbalance/l{i}`: the largest share of tokens an expert of layer i received over the mean
  share (k / experts): 1 is perfectly balanced, experts / k is every token to the same k;
- `moe/share_min/l{i}`, `moe/share_max/l{i}`: the smallest and largest share of tokens routed to
  an expert (each token goes to k experts, so shares sum to k); the expert-collapse alert reads them;
- `moe/topk_disagree`: of the tokens with an engine record, the fraction whose trainer top-k (its
  own choice, before replay) differs from the engine's in at least one layer;
  `moe/router_disagree` the fraction of (token, layer) pairs that differ;
- `moe/replayed_frac`: the fraction of those tokens whose experts were replayed.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from tidal.models.moe import from_index, install_routers, recorded, replaying, to_index
from tidal.trainer import distributed as dp


def replay_index(records: list[np.ndarray | None], flat_BT: torch.Tensor, lengths: list[int], layers: int, k: int,
                 numel: int) -> torch.Tensor | None:
    """[layers, numel, k] expert indices (-1: route yourself) from per-sequence records; None when
    no sequence has one."""
    if not any(r is not None for r in records):
        return None
    out = torch.full((layers, numel, k), -1, dtype=torch.long)
    flat = flat_BT.cpu()
    for i, (rec, n) in enumerate(zip(records, lengths)):
        if rec is None or n < 2:
            continue
        if rec.shape[0] != n or rec.shape[1:] != (layers, k):
            raise ValueError(f"routing replay: sequence {i} has {n} tokens and a record of shape {rec.shape}; "
                             f"want ({n}, {layers}, {k})")
        idx = to_index(rec[: n - 1])  # [n-1, L, K]
        out[:, flat[i, : n - 1]] = idx.permute(1, 0, 2)
    return out.to(flat_BT.device)


def per_sequence(index_LNK: torch.Tensor, flat_BT: torch.Tensor, lengths: list[int], num_experts: int) -> list[np.ndarray]:
    """The forward's experts [layers, numel, k] as one compact record per sequence, [len, layers, k]
    (the last token: none)."""
    out = []
    idx = index_LNK.cpu()
    flat = flat_BT.cpu()
    for i, n in enumerate(lengths):
        got = torch.full((n, idx.shape[0], idx.shape[2]), -1, dtype=torch.long)
        if n > 1:
            got[: n - 1] = idx[:, flat[i, : n - 1]].permute(1, 0, 2)
        out.append(from_index(got, num_experts))
    return out


def balancing_loss(logits_N: list[torch.Tensor], index_N: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss, as transformers computes it, over the given tokens
    of each layer: experts × Σ_e (share of routed slots to e) × (mean router probability of e),
    averaged over layers. 1 when balanced, up to experts when one expert takes everything."""
    losses = []
    for z, idx in zip(logits_N, index_N):
        counts = torch.zeros(num_experts, device=z.device).index_add_(
            0, idx.reshape(-1), torch.ones(idx.numel(), device=z.device))
        frac = counts / max(idx.numel(), 1)
        losses.append(num_experts * (frac * torch.softmax(z, dim=-1).mean(0)).sum())
    return torch.stack(losses).mean()


class TrainerRouting:
    """The policy's routers (installed at construction), what they replay, and the statistics of
    an update's forwards (module docstring)."""

    def __init__(self, model, mode: str = "none", aux_loss_coef: float = 0.0):
        self.routers = install_routers(model)
        self.mode, self.aux_loss_coef = mode, aux_loss_coef
        if (mode != "none" or aux_loss_coef > 0) and not self.routers:
            raise ValueError(f"train.moe.routing_replay={mode}, aux_loss_coef={aux_loss_coef}: the policy has no "
                             "top-k routers (not a mixture of experts)")
        self.layers = len(self.routers)
        self.k = self.routers[0].top_k if self.routers else 0
        self.experts = self.routers[0].num_experts if self.routers else 0
        self.reset()

    def __bool__(self) -> bool:
        return bool(self.routers)

    def reset(self) -> None:
        self.counts = np.zeros((self.layers, self.experts))
        self.sums = dict.fromkeys(("tokens", "recorded", "disagree", "router_disagree", "replayed", "aux"), 0.0)

    @contextlib.contextmanager
    def forward(self, records: list | None, flat_BT: torch.Tensor, lengths: list[int], numel: int, *,
                policy_BT: torch.Tensor | None = None, engine: list | None = None, aux: bool = False):
        """Routers record (and replay `records`, per sequence, when given) while inside. After it,
        `self.used` holds the experts used ([layers, numel, k]); with `policy_BT` ([B, T] bool, the
        tokens the statistics count) the statistics add this forward's, comparing the trainer's own
        choice with `engine` (the engine's records). With `aux` the routers keep their logits and
        `self.aux` is the balancing loss over the counted tokens."""
        if not self.routers:
            yield self
            return
        index = None if records is None else replay_index(records, flat_BT, lengths, self.layers, self.k, numel)
        for r in self.routers:
            r.record, r.recorded, r.own, r.keep_logits = True, None, None, aux
        try:
            with replaying(self.routers, index):
                yield self
            self.used = recorded(self.routers)
            if policy_BT is not None:
                at = flat_BT[policy_BT]  # the counted tokens' flat positions
                self._count(at, engine, flat_BT, lengths, index)
                if aux:
                    self.aux = balancing_loss([r.logits[at] for r in self.routers], [u[at] for u in self.used], self.experts)
                    self.sums["aux"] += float(self.aux.detach()) * int(at.numel())
        finally:
            for r in self.routers:
                r.record, r.keep_logits, r.logits = False, False, None

    def _count(self, at: torch.Tensor, engine: list | None, flat_BT, lengths: list[int], index) -> None:
        used = self.used[:, at]  # [L, n, K]
        for layer in range(self.layers):
            self.counts[layer] += np.bincount(used[layer].reshape(-1).cpu().numpy(), minlength=self.experts)
        self.sums["tokens"] += int(at.numel())
        if index is not None:
            self.sums["replayed"] += float((index[:, at, 0] >= 0).any(0).sum())
        if engine is None or not any(e is not None for e in engine):
            return
        eng = replay_index(engine, flat_BT, lengths, self.layers, self.k, self.used.shape[1])
        eng = eng[:, at]
        has = (eng[:, :, 0] >= 0).all(0)  # tokens with an engine record in every layer
        own = recorded(self.routers, own=True)[:, at]
        differ = (own.sort(-1).values != eng.sort(-1).values).any(-1)[:, has]  # [L, n]
        self.sums["recorded"] += float(has.sum())
        self.sums["disagree"] += float(differ.any(0).sum())
        self.sums["router_disagree"] += float(differ.float().mean(0).sum()) if differ.numel() else 0.0

    def metrics(self, world_size: int, device, group=None) -> dict[str, float]:
        """The statistics since `reset` (data parallel: a collective over `group`, the global
        batch's), then reset."""
        if not self.routers:
            return {}
        keys = list(self.sums)
        flat = [self.sums[k] for k in keys] + self.counts.reshape(-1).tolist()
        if world_size > 1:
            flat = dp.all_reduce(flat, "sum", device, group)
        sums = dict(zip(keys, flat[: len(keys)]))
        counts = np.asarray(flat[len(keys):]).reshape(self.layers, self.experts)
        self.reset()
        out: dict[str, float] = {}
        tokens = max(sums["tokens"], 1.0)
        for layer, c in enumerate(counts):
            share = c / tokens  # each token counts once per expert it went to: shares sum to k
            out[f"moe/imbalance/l{layer}"] = float(share.max() / (self.k / self.experts))
            out[f"moe/share_min/l{layer}"] = float(share.min())
            out[f"moe/share_max/l{layer}"] = float(share.max())
        out["moe/imbalance"] = max(out[f"moe/imbalance/l{i}"] for i in range(self.layers))
        if sums["recorded"] > 0:
            out["moe/topk_disagree"] = sums["disagree"] / sums["recorded"]
            out["moe/router_disagree"] = sums["router_disagree"] / sums["recorded"]
        if self.mode != "none":
            out["moe/replayed_frac"] = sums["replayed"] / tokens
        if self.aux_loss_coef > 0:
            out["moe/aux_loss"] = sums["aux"] / tokens
        return out

    def records(self, flat_BT: torch.Tensor, lengths: list[int]) -> list[np.ndarray]:
        """The last forward's experts as per-sequence records (R2)."""
        return per_sequence(self.used, flat_BT, lengths, self.experts)
