"""Parallelism as plans over one named device mesh (docs/parallel.md).

`ParallelDims` (mesh.py) holds the degrees and the mesh; `parallelize` applies them to a model
in the order torchtitan does: tensor parallelism first (tensor.py, one plan per family),
then FSDP2 over the data dimensions (tidal/trainer/distributed.py's `shard_model` over
`fsdp_mesh`: HSDP when replicated). The trainer's step is the same code at every mesh shape.
"""

from __future__ import annotations

from torch import nn

from tidal.trainer import distributed as dp
from tidal.trainer.parallel.mesh import ParallelDims
from tidal.trainer.parallel.tensor import apply_tp

__all__ = ["ParallelDims", "parallelize"]


def parallelize(model: nn.Module, dims: ParallelDims, *, mixed_precision: bool = False, reshard_root: bool = False,
                tensor_parallel: bool = True) -> nn.Module:
    """Apply `dims` to `model` in place: its tp plan (unless `tensor_parallel=False`: a model
    outside the plans, such as the critic, is then replicated over tp and sharded over the data
    dimensions only), then FSDP2 over the data dimensions. Nothing for one rank."""

    if dims.tp_mesh is not None and tensor_parallel:
        apply_tp(model, dims.tp_mesh)
    if dims.fsdp:
        dp.shard_model(model, mixed_precision=mixed_precision, reshard_root=reshard_root, mesh=dims.fsdp_mesh)
    return model
