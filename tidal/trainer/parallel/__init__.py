"""Parallelism as plans over one named device mesh (docs/parallel.md).

`ParallelDims` (mesh.py) holds the degrees and the mesh; `parallelize` applies them to a model
in the order torchtitan does: tensor parallelism first (tensor.py, one plan per family),
expert parallelism (expert.py: each rank keeps its slice of the experts, FSDP2 over
`expert_fsdp_mesh` for them), then FSDP2 over the data dimensions for the rest
(tidal/trainer/distributed.py's `shard_model` over `fsdp_mesh`: HSDP when replicated). The
trainer's step is the same code at every mesh shape.
"""

from __future__ import annotations

from torch import nn

from tidal.trainer import distributed as dp
from tidal.trainer.parallel.expert import apply_ep, shard_experts
from tidal.trainer.parallel.mesh import ParallelDims
from tidal.trainer.parallel.tensor import apply_tp

__all__ = ["ParallelDims", "parallelize"]


def parallelize(model: nn.Module, dims: ParallelDims, *, mixed_precision: bool = False, reshard_root: bool = False,
                tensor_parallel: bool = True) -> nn.Module:
    """Apply `dims` to `model` in place: its tp plan and its ep split (unless
    `tensor_parallel=False`: a model outside the plans, such as the critic, is then replicated
    over tp, its experts, if any, plain parameters sharded over the data dimensions with the
    rest), then FSDP2 over the data dimensions. Nothing for one rank."""

    if dims.tp_mesh is not None and tensor_parallel:
        apply_tp(model, dims.tp_mesh)
    if dims.ep_mesh is not None and tensor_parallel:
        shard_experts(apply_ep(model, dims.ep_mesh), dims.expert_fsdp_mesh, mixed_precision)
    if dims.fsdp:
        dp.shard_model(model, mixed_precision=mixed_precision, reshard_root=reshard_root, mesh=dims.fsdp_mesh)
    return model
