"""Expert parallelism: each rank holds a slice of every MoE layer's experts; tokens travel to them.

A mixture-of-experts layer's router picks top-k experts per token; with `train.parallel.ep`
ranks, rank r of an ep group holds experts [r·E/ep, (r+1)·E/ep) of every layer (a DTensor
`Shard(0)` over the ep mesh, so checkpoints, the gradient norm and weight sync see the whole
tensor). The ranks of an ep group are data ranks: each runs its own sequences through
attention and the router, then

1. dispatch: sorts its (token, expert) assignments by expert, tells every ep rank how many
   it will send to each of that rank's experts (an all-to-all of counts: the splits are
   variable, so nothing is dropped and no capacity factor pads anything), and sends the
   tokens (an all-to-all of hidden states);
2. each rank runs its local experts on what it received (a rank may receive nothing: its
   experts still join the graph, with zero gradients, so that FSDP's collectives pair up);
3. combine: the reverse all-to-all brings each output back to the rank and position it came
   from, where it is weighted by the router's score and summed per token (as HF's loop does).

Both all-to-alls are `torch.distributed.nn.functional.all_to_all_single`, differentiable:
its backward is the reverse exchange, so the gradient of a token's hidden state returns to
its rank and each expert's weight gradient sums the tokens of every ep rank (no gradient
reduction over ep). The router (its logits, top-k, scores) is the model's own and untouched:
`ExpertParallel` replaces only HF's experts module (`Qwen3MoeExperts` and the families with
the same layout: fused `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], forward(hidden_states,
top_k_index, top_k_weights)), keeping its parameter names, so state dicts are unchanged.
Routing weights are applied on the token's own rank after the combine: the router's gradient
never crosses ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# legend: T tokens on this rank, k experts per token, A = T·k assignments, E experts,
# L = E / ep local experts, N assignments received, H hidden size, I expert width


def find_experts(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, experts module) for every MoE layer of `model`: modules with the fused
    3-D expert layout (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], `num_experts`)."""
    out = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if _is_experts(child):
                out.append((parent, name, child))
    return out


def _is_experts(m: nn.Module) -> bool:
    gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3
            and isinstance(getattr(m, "num_experts", None), int) and not getattr(m, "is_transposed", False))


def check_ep(model: nn.Module, ep: int, name: str = "the model") -> list[tuple[nn.Module, str, nn.Module]]:
    """The experts modules of `model`; a ValueError naming the model when ep cannot split them."""
    found = find_experts(model)
    if not found:
        raise ValueError(f"train.parallel.ep={ep}: {name} ({type(model).__name__}) has no mixture-of-experts layers "
                         "(experts with fused gate_up_proj/down_proj, as Qwen3-MoE's); use ep=1")
    for _, attr, experts in found:
        if experts.num_experts % ep:
            raise ValueError(f"train.parallel.ep={ep} does not divide {name}'s num_experts={experts.num_experts} "
                             f"(its {attr} modules): each ep rank must hold the same number of experts")
        if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
            raise ValueError(f"train.parallel.ep={ep}: {name}'s experts have biases, which the expert-parallel "
                             "module does not carry")
    return found


def route(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [A], token [A], counts [E]): the assignments sorted by expert (stable: by token
    within an expert), the token of each sorted assignment, and how many each expert gets."""
    flat = top_k_index.reshape(-1)  # [A], assignment a = token·k + j
    order = torch.argsort(flat, stable=True)
    token = order // top_k_index.shape[-1]
    return order, token, torch.bincount(flat, minlength=num_experts)


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows of `x` sent `in_splits[r]` to rank r, received `out_splits[r]` from rank r;
    differentiable (the backward sends the gradients back the reverse way)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group))


def exchange_counts(counts: torch.Tensor, ep: int, group) -> torch.Tensor:
    """[ep, L]: row r holds how many assignments rank r sends to each of this rank's L experts
    (from `counts` [E], this rank's assignments per global expert)."""
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)  # L counts to each rank, in rank order
    return got.view(ep, -1)


def expert_mlp(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor, act) -> torch.Tensor:
    """Each local expert's SwiGLU on its rows of `x` (rows grouped by expert, `counts` each):
    down_e(act(gate_e x) * up_e x). Every expert runs, on zero rows too: its weights stay in the
    graph (a zero gradient), as FSDP's gradient collectives need."""
    outs = []
    for e, rows in enumerate(torch.split(x, counts)):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(act(gate) * up, down[e]))
    return torch.cat(outs)


class ExpertParallel(nn.Module):
    """A drop-in for HF's experts module (same parameter names, same forward signature) whose
    experts are split over `ep_mesh` (module docstring)."""

    def __init__(self, experts: nn.Module, ep_mesh):
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        self.num_experts = experts.num_experts
        self.ep = ep_mesh.size()
        self.local = self.num_experts // self.ep
        self.group = ep_mesh.get_group()
        self.act_fn = experts.act_fn
        for name in ("gate_up_proj", "down_proj"):  # every rank loaded the whole tensor: each keeps its slice
            p = getattr(experts, name)   # (src_data_rank=None: sliced in place, nothing sent)
            setattr(self, name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None),
                                             requires_grad=p.requires_grad))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        local = lambda p: p.to_local() if isinstance(p, DTensor) else p
        # looked up when called: a test swaps in a broken combine to show the checks catch it
        x, per_expert, route_ = dispatch(hidden_states, top_k_index, self.num_experts, self.ep, self.group)
        y = expert_mlp(x, per_expert, local(self.gate_up_proj), local(self.down_proj), self.act_fn)
        return combine(y, route_, hidden_states, top_k_weights, self.group)


@dataclass
class Route:
    """What the combine needs to undo a dispatch."""

    order: torch.Tensor  # [A] the assignments sorted by expert
    token: torch.Tensor  # [A] the token of each sorted assignment
    send: list[int]  # assignments sent to each ep rank
    recv: list[int]  # ... and received from each
    perm: torch.Tensor  # [N] the received rows regrouped by local expert


def dispatch(hidden_states: torch.Tensor, top_k_index: torch.Tensor, num_experts: int, ep: int,
             group) -> tuple[torch.Tensor, list[int], Route]:
    """Send each (token, expert) assignment's hidden state [H] to the ep rank holding the expert.
    Returns the rows this rank received [N, H] grouped by its local expert, how many each local
    expert got, and the `Route` back."""
    order, token, counts = route(top_k_index, num_experts)
    got = exchange_counts(counts, ep, group)  # [ep, L]
    send = counts.view(ep, -1).sum(1).tolist()
    recv = got.sum(1).tolist()
    x = all_to_all(hidden_states[token], recv, send, group)  # [N, H], by source rank, then expert
    # the rows of (source s, local expert e) are block s·L + e: regroup them by expert
    local = got.shape[1]
    expert_of = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep), got.reshape(-1))
    perm = torch.argsort(expert_of, stable=True)
    return x[perm], got.sum(0).tolist(), Route(order, token, send, recv, perm)


def combine(y: torch.Tensor, r: Route, hidden_states: torch.Tensor, top_k_weights: torch.Tensor,
            group) -> torch.Tensor:
    """The experts' outputs [N, H] (in `dispatch`'s order) back to their tokens' ranks, each
    weighted by its router score and summed per token: [T, H]."""
    y = all_to_all(y[torch.argsort(r.perm)], r.send, r.recv, group)  # [A, H], in `order`
    y = y * top_k_weights.reshape(-1)[r.order, None].to(y.dtype)
    return torch.zeros_like(hidden_states).index_add(0, r.token, y.to(hidden_states.dtype))


def apply_ep(model: nn.Module, ep_mesh) -> list[nn.Module]:
    """Replace every experts module of `model` by an `ExpertParallel` over `ep_mesh` (in place);
    returns the new modules (FSDP shards each as a group of its own: parallelize)."""
    out = []
    for parent, attr, experts in check_ep(model, ep_mesh.size(), type(model).__name__):
        module = ExpertParallel(experts, ep_mesh)
        setattr(parent, attr, module)
        out.append(module)
    return out


def shard_experts(modules: list[nn.Module], mesh, mixed_precision: bool) -> None:
    """FSDP2 over `mesh` (the expert data mesh) for each expert-parallel module, before the
    blocks are sharded (so their groups leave the experts out). Dimension 1 is sharded, not 0:
    dimension 0 is already split over ep, and a second split of the few local experts would
    leave ranks empty (torchtitan shards dim 1 in that case too)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    kw = {"mesh": mesh, "shard_placement_fn": lambda p: Shard(1)}
    if mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in modules:
        fully_shard(m, **kw)
