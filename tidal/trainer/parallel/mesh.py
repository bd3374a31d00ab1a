"""The trainer ranks' named device mesh: one object that knows every parallel dimension.

`ParallelDims` takes the degrees of `train.parallel` (validated against the number of ranks
before anything loads) and builds ONE DeviceMesh with named dimensions, outermost first:
`dp_replicate`, `dp_shard`, `ep`, `cp`, `tp`. Tensor parallelism is innermost, so a tp group
is made of consecutive ranks (the ranks Ray places together on a node; NVLink on a GPU box),
and the data-parallel dimensions are outermost (their gradient collectives cross nodes once
per step). Expert parallelism is borrowed from the data ranks, as torchtitan does: the ranks
of an ep group hold different sequences, and exchange only the tokens routed to each other's
experts (tidal/trainer/parallel/expert.py). Derived views, flattened once here:

- `fsdp_mesh`: where FSDP2 shards the parameters outside the experts: `dp_shard` x `ep` x `cp`
  (context-parallel ranks hold the same parameters and their gradients are summed), 2-D
  (`dp_replicate`, shard) for HSDP;
- `ep_mesh`: the experts' mesh (each rank holds num_experts / ep of them), and
  `expert_fsdp_mesh`: where FSDP2 shards each rank's experts further, `dp_shard` (2-D with
  `dp_replicate`);
- `tp_mesh`: the DTensor plans' mesh;
- `dp_group`: the ranks that hold different sequences, `dp_replicate` x `dp_shard` x `ep` (the
  batch is split over them; the loss denominators are summed over them).

The step code never asks which dimensions are on: it asks for a group or a mesh, and gets
None where the dimension is 1. The choice of order follows torchtitan's ParallelDims.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

ORDER = ("dp_replicate", "dp_shard", "ep", "cp", "tp")


@dataclass
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    mesh: object = field(default=None, repr=False)  # the DeviceMesh, once built
    flat: dict = field(default_factory=dict, repr=False)  # its flattened views

    @classmethod
    def from_config(cls, cfg, world_size: int) -> ParallelDims:
        """The degrees of `cfg` (a tidal.config.ParallelConfig) for `world_size` ranks; raises
        a ValueError naming the keys and their product when they do not fit."""
        return cls(**cfg.degrees(world_size))

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.ep

    @property
    def dp_size(self) -> int:
        """How many different shards of the batch the ranks hold (ep ranks are data ranks)."""
        return self.dp_replicate * self.dp_shard * self.ep

    @property
    def fsdp(self) -> bool:
        """Whether parameters are FSDP2-sharded (or replicated, HSDP) over a data dimension."""
        return self.dp_replicate * self.dp_shard * self.ep * self.cp > 1

    def dp_index(self, rank: int) -> int:
        """Which shard of the batch global rank `rank` trains on (its data-parallel coordinate):
        the tp and cp ranks of one data-parallel position get the same sequences (ep ranks hold
        different ones)."""
        return rank // (self.cp * self.tp)

    def build(self, device_type: str) -> ParallelDims:
        """Build the mesh over the initialized default group (a collective: every rank calls it);
        a no-op for one rank."""
        if self.world_size == 1 or self.mesh is not None:
            return self
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != self.world_size:
            raise ValueError(f"train.parallel multiplies to {self.world_size} ranks but the trainer group has "
                             f"{dist.get_world_size()}")
        mesh = init_device_mesh(device_type, tuple(getattr(self, d) for d in ORDER), mesh_dim_names=ORDER)
        # flattened views, kept here (slicing a flattened name from the root is being deprecated)
        self.flat = {"fsdp": mesh["dp_shard", "ep", "cp"]._flatten("fsdp"),  # FSDP's shard dimension
                     "dp": mesh["dp_replicate", "dp_shard", "ep"]._flatten("dp")}  # the batch's dimension
        self.mesh = mesh
        return self

    @property
    def fsdp_mesh(self):
        """FSDP2's mesh: 1-D (dp_shard x ep x cp) or, with replicas, 2-D (dp_replicate, dp_shard x
        ep x cp); None when there is no data dimension."""
        if self.mesh is None or not self.fsdp:
            return None
        if self.dp_replicate > 1:
            return self.mesh["dp_replicate", "fsdp"]
        return self.flat["fsdp"]

    @property
    def ep_mesh(self):
        return None if self.mesh is None or self.ep == 1 else self.mesh["ep"]

    @property
    def expert_fsdp_mesh(self):
        """Where FSDP2 shards each ep rank's experts: `dp_shard` (of size 1 when ep is the only
        data dimension: FSDP then only manages them), 2-D (`dp_replicate`, `dp_shard`) for HSDP.
        The experts' gradients need no sum over ep: each expert lives on one ep rank and the
        tokens of every ep rank reach it (the all-to-all's backward brings theirs back)."""
        if self.mesh is None or self.ep == 1:
            return None
        if self.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]

    @property
    def tp_mesh(self):
        return None if self.mesh is None or self.tp == 1 else self.mesh["tp"]

    @property
    def cp_mesh(self):
        return None if self.mesh is None or self.cp == 1 else self.mesh["cp"]

    @property
    def dp_group(self):
        """The process group over which batch totals and per-rank metric sums are all-reduced;
        None: the default group (one rank, or every rank is a data-parallel rank)."""
        if self.mesh is None or self.dp_size == self.world_size:
            return None
        return self.flat["dp"].get_group()
