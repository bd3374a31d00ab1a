"""Data-parallel trainer ranks: the process group, batch sharding and FSDP2 sharding.

N trainer ranks form one torch.distributed group (gloo on CPU, NCCL on GPU). Each rank
holds a shard of every parameter (FSDP2 `fully_shard`, one group per decoder layer and per
vision block of a vision-language model, one for the root), trains on its own shard of the
global batch, and normalizes its loss by the GLOBAL token/sequence totals
(tidal.algorithms.aggregate). Gradients are therefore SUMMED across ranks, never averaged:
the sum of the ranks' shares is the loss of the whole batch, and the gradient equals the
single-process gradient.

Every collective here times out (the group's timeout) instead of hanging.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import nn


def init_distributed(rank: int, world_size: int, master_addr: str | None, master_port: int | None,
                     backend: str = "gloo", timeout_s: float = 600, store=None) -> None:
    """Join the trainer group, through `store` (a torch.distributed Store the caller met on
    already: placement.mode=launcher) or at tcp://master_addr:master_port. Every collective of
    the group then fails after `timeout_s` instead of waiting forever. With NCCL, the current
    CUDA device must be this rank's before the call (a Ray actor given one GPU sees it as
    cuda:0, the default)."""
    where = {"store": store} if store is not None else {"init_method": f"tcp://{master_addr}:{master_port}"}
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s),
                            **where)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    """Ranks in the trainer group; 1 when no group is initialized."""
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def balanced_shards(lengths: list[int], n: int) -> list[list[int]]:
    """Split sequence indices into `n` shards of balanced token counts: longest first, each
    to the shard with the fewest tokens (then fewest sequences, then lowest index), so the
    split is deterministic and every shard gets a sequence when there are at least `n`.
    Indices are sorted inside a shard."""
    if n < 1:
        raise ValueError(f"number of shards must be at least 1, got {n}")
    shards: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        s = min(range(n), key=lambda s: (load[s], len(shards[s]), s))
        shards[s].append(i)
        load[s] += lengths[i]
    return [sorted(s) for s in shards]


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: a vision-language model's vision blocks and decoder
    layers (Qwen2-VL layout: `visual.blocks` and `language_model.layers` of `model.model`, also
    under peft's wrapper), else `model.model.layers` (Qwen2/Llama layout, also the
    `*ForTokenClassification` heads), else the largest ModuleList of same-type modules."""
    for mod in model.modules():
        layers = getattr(getattr(mod, "language_model", None), "layers", None)
        blocks = getattr(getattr(mod, "visual", None), "blocks", None)
        if isinstance(layers, nn.ModuleList) and isinstance(blocks, nn.ModuleList):
            return [*blocks, *layers]  # in the order the forward runs them
    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return list(inner.layers)
    best: list[nn.Module] = []
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > len(best) and len({type(m) for m in mod}) == 1:
            best = list(mod)
    return best


def shard_model(model: nn.Module, mixed_precision: bool = False, reshard_root: bool = False, mesh=None) -> nn.Module:
    """FSDP2-shard `model` in place over `mesh` (default: a 1-D mesh of the whole default group;
    a 2-D one replicates over its first dimension, HSDP): each block, then the root.

    The root group owns everything outside the blocks (embeddings, final norm, lm_head), so
    tied embeddings (one Parameter for `embed_tokens` and `lm_head`) stay one sharded
    parameter. `reshard_root=True` frees the root's gathered parameters after each forward
    (right for a frozen model that never runs backward). `mixed_precision` computes in
    bfloat16 over float32 master weights, reducing gradients in float32.

    Gradient reduction is a plain SUM (divide factor 1, sum-only collectives): each rank's
    loss already carries the global denominators. FSDP's default would average, i.e.
    divide the gradient by the world size. Sum-only also avoids PREMUL_SUM, which gloo
    lacks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if mesh is None:
        mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    kw = {"mesh": mesh}
    if mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in _blocks(model):
        fully_shard(block, **kw)
    fully_shard(model, reshard_after_forward=True if reshard_root else None, **kw)
    for mod in model.modules():
        if isinstance(mod, FSDPModule):  # the setting is per FSDP group
            mod.set_gradient_divide_factor(1.0)
            mod.set_force_sum_reduction_for_comms(True)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (FSDP2-sharded, tensor-parallel or both):
    then its state dicts and checkpoints are collectives."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return isinstance(model, FSDPModule) or any(isinstance(p, DTensor) for p in model.parameters())


def reshard(model: nn.Module) -> None:
    """Free the root's gathered parameters: a no-grad forward leaves them gathered (the root
    keeps them for a backward that never comes), and the optimizer, the state dicts and
    `full_tensor` need the sharded ones registered again."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective: every rank must call it); a plain
    tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_` that also works on DTensor gradients (FSDP2 shards, tensor-parallel
    shards, both) mixed with plain ones: the squared norm of each group of gradients that share
    a mesh and placements is made whole (a collective) and the groups are summed. A plain
    gradient is whole on every rank (replicated), so it counts once. Returns a plain tensor."""
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.grad is not None]
    if not any(isinstance(p.grad, DTensor) for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    groups: dict = {}
    for p in params:
        g = p.grad
        # keyed by names, not ranks: every rank visits its groups in the same order
        key = f"{g.device_mesh.mesh_dim_names}{tuple(g.placements)}" if isinstance(g, DTensor) else ""
        groups.setdefault(key, []).append(g)
    sq = torch.zeros((), dtype=torch.float32, device=params[0].grad.device)
    for key in sorted(groups):
        sq = sq + full_tensor(torch.nn.utils.get_total_norm(groups[key])).float() ** 2
    norm = sq.sqrt()
    coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    for p in params:
        p.grad.mul_(coef)
    return norm


def all_reduce(values: list[float], op: str = "sum", device: torch.device | str = "cpu", group=None) -> list[float]:
    """All-reduce a few floats (float64) across `group` (default: every rank); unchanged without one."""
    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t.tolist()


# -- checkpoints: full (unsharded) state dicts, so any number of ranks can resume ---------
def _full_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def load_hf_weights(model: nn.Module, path) -> tuple[list[str], list[str]]:
    """Load `path/model.safetensors` (a full state dict) into `model`, sharded or not; every
    rank reads the file. Returns (missing, unexpected) keys; tied weights are re-tied."""
    import json

    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"  # save_pretrained splits large models
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    state = _own_names(model, {k: v for f in files for k, v in load_file(str(path / f)).items()})
    missing, unexpected = load_full_state(model, state)
    if not is_sharded(model):
        model.tie_weights()
    return missing, unexpected


def _own_names(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (read from a model directory) under `model`'s own parameter names. save_pretrained
    writes some models under the naming their checkpoints were first published in (Qwen2-VL:
    `visual.*` and `model.*` for `model.visual.*` and `model.language_model.*`, which is what
    engines expect) and from_pretrained renames back; a state dict read here gets the same
    renaming, found by reverting each of the model's own names as save_pretrained does. Keys the
    model already has stay as they are."""
    own = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    if not state.keys() - set(own):
        return state
    from transformers.core_model_loading import revert_weight_conversion

    probe = torch.empty(0)
    saved_as = {}
    for name in own:
        out = revert_weight_conversion(model, {name: probe})
        if len(out) == 1:  # a renaming (a weight split or fused on saving keeps its name: then unexpected)
            saved_as[next(iter(out))] = name
    return {saved_as.get(k, k): v for k, v in state.items()}


def load_full_state(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load a full (unsharded) state dict, or part of one, into `model`, sharded or not (each
    rank takes its shard). Returns (missing, unexpected) keys."""
    if not is_sharded(model):
        missing, unexpected = model.load_state_dict(state, strict=False)
        return list(missing), list(unexpected)
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    reshard(model)
    # the tied head is one sharded Parameter with the embedding: loading the embedding sets both
    keys = set_model_state_dict(model, state, options=_full_options(strict=False))
    return list(keys.missing_keys), list(keys.unexpected_keys)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's FULL state dict keyed by parameter name (the same on 1 or N ranks).
    Sharded: a collective; only rank 0 gets the state (on CPU)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    reshard(model)
    return get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=is_sharded(model)))


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore `optimizer_state` output on every rank (each takes its shard of the full
    state). A checkpoint of the older format (state keyed by parameter index, one process)
    still loads into an unsharded model."""
    if any(isinstance(i, int) for g in state["param_groups"] for i in g["params"]):
        if is_sharded(model):
            raise ValueError("this checkpoint's optimizer state is of the older per-process format (by parameter "
                             "index): resume it on one trainer rank and save it again to move it to more ranks")
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    reshard(model)
    set_optimizer_state_dict(model, optimizer, state, options=_full_options())


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()
