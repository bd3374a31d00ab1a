"""Sharded checkpoints: every rank writes its own shards of the policy and its optimizer state.

`torch.distributed.checkpoint` (DCP) saves each rank's DTensor shards (FSDP2's, tensor
parallelism's, both) with the global offsets of each piece, so a checkpoint saved on one mesh
loads on any other, or in one process: each rank reads the pieces that overlap its own shards.
No rank ever holds the whole model or the whole optimizer state (the old format gathered both
on rank 0, which stops working at the size where sharding is needed).

The state dicts are torch's distributed ones (`get_state_dict`): keyed by parameter name, the
optimizer's state created (zeros) before a load so there is something to load into.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tidal.trainer.distributed import reshard

DIRNAME = "shards"


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Write `model`'s and `optimizer`'s shards under `path` (a collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict


    reshard(model)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Load shards written by `save_sharded` on any mesh into `model` and `optimizer`, whatever
    their own sharding (one process included)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


    reshard(model)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
