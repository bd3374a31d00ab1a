"""Tensor parallelism: the DTensor plan of each decoder family tidal trains, and the checks that refuse a model it cannot split.

One plan serves the Llama-layout families (Qwen2, Qwen2.5, Qwen3, Llama: the same module
names): in every decoder layer q/k/v and gate/up are column-parallel (each rank computes its
own attention heads and its own MLP columns, no communication), o and down are row-parallel
(each rank's partial product, summed by one all-reduce), so a layer costs two all-reduces of
the hidden states forward and two backward (Megatron's split). The embedding is
vocabulary-parallel (each rank looks up the ids in its rows, one all-reduce), and the output
head's weight is split by vocabulary rows too, never used as a module: the trainer computes
log-probs and entropy from hidden states on those shards (tidal/trainer/parallel/logprob.py),
so neither the vocabulary nor the logits are gathered. A tied head (Qwen2's small models) is
the embedding's own sharded parameter, so it stays tied.

Qwen3's per-head q/k norms see only the rank's heads: their weight is replicated as a
DTensor over the head-sharded input (torch's SequenceParallel style on the head dimension),
so its gradient, computed from each rank's heads, is summed over the tp group.

HF's attention infers the number of heads from the projection's width (`view(..., -1,
head_dim)`), so the local heads need no change to the modules.
"""

from __future__ import annotations

from torch import nn

FAMILIES = ("qwen2", "qwen3", "llama")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def check_tp(config, tp: int, name: str = "the model") -> None:
    """Raise a ValueError naming the model, the family or the dimension when `tp` cannot split it."""
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        raise ValueError(f"train.parallel.tp={tp}: {name} is a {kind!r} model; tensor-parallel plans exist for "
                         f"{', '.join(FAMILIES)}")
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, key)
        if value % tp:
            raise ValueError(f"train.parallel.tp={tp} does not divide {name}'s {key}={value}")


def _decoder(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        raise ValueError(f"tensor parallelism needs the Llama layout (model.model.layers); {type(model).__name__} "
                         "does not have it")
    return inner


def layer_plan(layer: nn.Module) -> dict:
    """The plan of one decoder layer, by submodule name."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    missing = [f"{sub}.{n}" for sub, names in (("self_attn", _ATTN), ("mlp", _MLP)) for n in names
               if not isinstance(getattr(getattr(layer, sub, None), n, None), nn.Linear)]
    if missing:
        raise ValueError(f"tensor parallelism: a decoder layer ({type(layer).__name__}) has no Linear {missing}")
    plan = {f"self_attn.{n}": ColwiseParallel() for n in _ATTN[:3]}
    plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
             "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for norm in ("q_norm", "k_norm"):  # Qwen3: over each head's features; input [B, T, heads, head_dim]
        if hasattr(layer.self_attn, norm):
            plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def apply_tp(model: nn.Module, tp_mesh) -> nn.Module:
    """Split `model` in place over `tp_mesh` (1-D), each decoder layer by `layer_plan` (looked up
    when called: a test swaps in a broken plan to show the golden runs catch it)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    check_tp(model.config, tp_mesh.size(), type(model).__name__)
    inner = _decoder(model)
    for layer in inner.layers:
        parallelize_module(layer, tp_mesh, layer_plan(layer))
    head, embed = model.get_output_embeddings(), inner.embed_tokens
    tied = head is not None and head.weight is embed.weight
    parallelize_module(embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if head is not None:
        if tied:
            head.weight = embed.weight  # the same Shard(0) parameter: still tied
        else:
            head.weight = nn.Parameter(distribute_tensor(head.weight.data, tp_mesh, [Shard(0)]),
                                       requires_grad=head.weight.requires_grad)
        if getattr(head, "bias", None) is not None:
            raise ValueError("tensor parallelism: an output head with a bias is not supported")
    return model
