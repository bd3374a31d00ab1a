"""Mixture-of-experts routing shared by the engines and the trainer: a float32 router that can
record the experts it chose and replay given ones.

`install_routers(model)` puts a `Router` in the place of each of transformers' top-k routers
(`Qwen3MoeTopKRouter`, the `mlp.gate` of a Qwen3-MoE block), holding the same `weight`
parameter, so the state dict, the checkpoints and the weight sync are unchanged, and the
experts (`Qwen3MoeExperts.forward(hidden_states, top_k_index, top_k_weights)`, which expert
parallelism keeps) are called as before. The router:

- computes its logits and softmax in float32 whatever the model's dtype (and outside autocast),
  as the large-MoE recipes do: a bfloat16 router flips near-tied choices between two runs;
- records the top-k of its last forward when `record` is on (`recorded`: [tokens, k]);
- replays given experts (`replay`: [tokens, k], rows of -1 route themselves): the chosen experts
  are the given ones, and their weights are the router's own softmax at those experts
  (renormalised over the k when the model's config says so), so the router's weight still gets
  a gradient through them (rollout routing replay, R3, arXiv 2510.11370).

Tokens are the rows of the block's input flattened row-major, [batch × positions]; `replay`
must be laid out the same way. `RoutingArray` is the compact per-token record that episodes
carry: [tokens, layers, k] of uint8 (fewer than 255 experts) or int16, with the dtype's maximum
where a token has no record.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Router(nn.Module):
    """transformers' top-k router (same `weight`, same outputs: logits, weights, indices), in
    float32, with `record` and `replay` (module docstring)."""

    def __init__(self, weight: nn.Parameter, top_k: int, norm_topk_prob: bool):
        nn.Module.__init__(self)  # not the router it stands in for (`install_routers` makes it one of its kind)
        self.weight = weight  # [experts, hidden]: the parameter of the router it replaces
        self.top_k, self.num_experts, self.hidden_dim = top_k, weight.shape[0], weight.shape[1]
        self.norm_topk_prob = norm_topk_prob
        self.record = False
        self.recorded: torch.Tensor | None = None  # [tokens, k] the experts used in the last forward while `record`
        self.own: torch.Tensor | None = None  # [tokens, k] the router's own top-k there (before any replay)
        self.replay: torch.Tensor | None = None  # [tokens, k]; -1 rows: the router's own choice
        self.logits: torch.Tensor | None = None  # [tokens, experts] float32, kept while `keep_logits`
        self.keep_logits = False

    def forward(self, hidden_states: torch.Tensor):
        h = hidden_states.reshape(-1, self.hidden_dim)
        with torch.autocast(h.device.type, enabled=False):
            w = self.weight.full_tensor() if hasattr(self.weight, "full_tensor") else self.weight
            logits = F.linear(h.float(), w.float())  # [tokens, experts]
            probs = torch.softmax(logits, dim=-1)
            own = index = torch.topk(probs, self.top_k, dim=-1).indices
            if self.replay is not None:
                if self.replay.shape != index.shape:
                    raise ValueError(f"routing replay: {tuple(self.replay.shape)} experts given for a forward of "
                                     f"{tuple(index.shape)} (tokens, k)")
                index = torch.where(self.replay >= 0, self.replay.to(index.device, index.dtype), index)
            weights = probs.gather(-1, index)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.record:
            self.recorded, self.own = index.detach(), own.detach()
        if self.keep_logits:
            self.logits = logits
        return logits, weights.to(hidden_states.dtype), index


def _is_hf_router(module: nn.Module) -> bool:
    return type(module).__name__.endswith("TopKRouter") and all(
        hasattr(module, a) for a in ("weight", "top_k", "norm_topk_prob"))


_KINDS: dict[type, type] = {}


def install_routers(model: nn.Module) -> list[Router]:
    """Replace every transformers top-k router of `model` by a `Router` on the same weight
    (idempotent); the routers in layer order. Empty for a model without experts."""
    for name, module in list(model.named_modules()):
        if _is_hf_router(module) and not isinstance(module, Router):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            # Of the replaced router's class too, so that transformers' isinstance checks (its
            # `output_router_logits` recorder) still find it.
            kind = _KINDS.setdefault(type(module), type(f"Tidal{type(module).__name__}", (Router, type(module)), {}))
            setattr(parent, child, kind(module.weight, int(module.top_k), bool(module.norm_topk_prob)))
    return routers(model)


def routers(model: nn.Module) -> list[Router]:
    """The model's installed `Router`s, in layer order."""
    return [m for m in model.modules() if isinstance(m, Router)]


def is_moe_config(config) -> bool:
    """Whether a transformers config, or a config.json as a dict (or its text config), describes a
    mixture of experts: a number of experts (`num_experts`, which transformers 5 writes as
    `num_local_experts`; DeepSeek's `n_routed_experts`) and of experts per token."""
    get = (lambda c, k: c.get(k)) if isinstance(config, dict) else (lambda c, k: getattr(c, k, None))
    cfg = get(config, "text_config") or config
    experts = max(int(get(cfg, k) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    return experts > 0 and int(get(cfg, "num_experts_per_tok") or 0) > 0


@contextlib.contextmanager
def recording(rs: list[Router]):
    """Routers record their choices while inside; `recorded` stays readable after."""
    for r in rs:
        r.record, r.recorded = True, None
    try:
        yield rs
    finally:
        for r in rs:
            r.record = False


@contextlib.contextmanager
def replaying(rs: list[Router], index_LNK: torch.Tensor | None):
    """Routers replay `index_LNK` ([layers, tokens, k], -1: route yourself) while inside;
    `None`: nothing changes."""
    if index_LNK is None:
        yield rs
        return
    if index_LNK.shape[0] != len(rs):
        raise ValueError(f"routing replay: experts for {index_LNK.shape[0]} layers, the model has {len(rs)} routers")
    for r, idx in zip(rs, index_LNK):
        r.replay = idx
    try:
        yield rs
    finally:
        for r in rs:
            r.replay = None


def recorded(rs: list[Router], own: bool = False) -> torch.Tensor:
    """[layers, tokens, k]: the experts the routers used in their last recorded forward (`own`:
    their own top-k there, before any replay)."""
    got = [r.own if own else r.recorded for r in rs]
    if any(g is None for g in got):
        raise RuntimeError("routing: a router recorded nothing (no forward ran while recording)")
    return torch.stack(got)


# -- the compact per-token record ------------------------------------------------------------

def routing_dtype(num_experts: int) -> np.dtype:
    """uint8 below 255 experts (255 marks `no record`), else int16."""
    return np.dtype(np.uint8) if num_experts < 255 else np.dtype(np.int16)


def missing(dtype: np.dtype) -> int:
    """The value that marks a token without a record."""
    return int(np.iinfo(dtype).max)


def empty_routing(tokens: int, layers: int, k: int, dtype: np.dtype) -> np.ndarray:
    return np.full((tokens, layers, k), missing(dtype), dtype=dtype)


def append_routing(have: np.ndarray | None, have_tokens: int, new: np.ndarray | None, new_tokens: int) -> np.ndarray | None:
    """An episode's record after `new_tokens` more tokens: `have` (covering `have_tokens`; None:
    none yet) extended by `new` ([new_tokens, layers, k]) or by rows of `missing` when `new` is
    None. None while neither has ever held a record."""
    if new is None and have is None:
        return None
    if new is not None and new.shape[0] != new_tokens:
        raise ValueError(f"routing record of {new.shape[0]} tokens for {new_tokens} tokens")
    ref = new if new is not None else have
    if have is None:
        have = empty_routing(have_tokens, ref.shape[1], ref.shape[2], ref.dtype)
    add = new if new is not None else empty_routing(new_tokens, have.shape[1], have.shape[2], have.dtype)
    return np.concatenate([have, add.astype(have.dtype)])


def to_index(record: np.ndarray) -> torch.Tensor:
    """A record as expert indices [tokens, layers, k] int64, -1 where it has none."""
    out = torch.from_numpy(record.astype(np.int64))
    out[torch.from_numpy(record == missing(record.dtype))] = -1
    return out


def from_index(index_TLK: torch.Tensor, num_experts: int) -> np.ndarray:
    """Expert indices [tokens, layers, k] (-1: none) as a compact record."""
    dt = routing_dtype(num_experts)
    arr = index_TLK.cpu().numpy()
    return np.where(arr < 0, missing(dt), arr).astype(dt)


def checkpoint_names(tensors) -> dict:
    """Weights by the names of a Hugging Face checkpoint: transformers 5 holds a Qwen3-MoE block's
    experts fused (`experts.gate_up_proj` [experts, 2 x width, hidden], `experts.down_proj`
    [experts, hidden, width]) but writes and reads them per expert (`experts.{e}.gate_proj.weight`,
    `.up_proj.weight`, `.down_proj.weight`), which is what engines that load checkpoints (vLLM's
    `reload_weights`) take. Other tensors pass through; a dict without fused experts is returned as is."""
    if not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in tensors):
        return tensors
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            base, width = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):  # the forward splits each expert's rows: gate first, then up
                out[f"{base}{e}.gate_proj.weight"] = t[e, :width]
                out[f"{base}{e}.up_proj.weight"] = t[e, width:]
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out
