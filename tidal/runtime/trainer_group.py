"""The trainer ranks seen as one Trainer by the controller.

A batch is split by tokens (balanced) across the data-parallel positions of the trainer's
mesh (train.parallel: the ranks of one tensor-parallel group get the same shard), each rank
runs the call on its shard with the global loss denominators, and rank 0's answer (the trainer returns
global metrics on every rank) comes back. With one rank the batch goes whole, exactly as
in a single process. Per-position results (`logprobs`, `values`) are put back in batch
order. Every call is bounded by `timeout_s` and fails with the role, call and step.
"""

from __future__ import annotations

from tidal.runtime.handles import Handle, gather
from tidal.trainer.trainer import TrainBatch


def balanced_shards(lengths: list[int], n: int) -> list[list[int]]:
    """n shards of sequence indices with balanced token counts (longest first to the
    lightest shard); indices sorted inside a shard."""
    from tidal.trainer.distributed import balanced_shards as split

    return split(lengths, n)


class TrainerGroup:
    def __init__(self, ranks: list[Handle], timeout_s: float = 600.0, dp_index: list[int] | None = None):
        self.ranks = ranks
        # each rank's data-parallel position (tidal.trainer.parallel.ParallelDims.dp_index); default: its own
        self.dp_index = list(range(len(ranks))) if dp_index is None else dp_index
        self.timeout_s = timeout_s
        self.step: int | None = None  # the controller's step, for error messages
        self._version = 0

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def local(self):
        """The Trainer itself when it lives in this process (placement.mode=local)."""
        return None if self.ranks[0].remote else self.ranks[0].target.trainer

    @property
    def version(self) -> int:
        return self._version

    def _all(self, call: str, *args, **kwargs) -> list:
        return gather([h.submit(call, *args, **kwargs) for h in self.ranks], step=self.step, timeout_s=self.timeout_s)

    def _sharded(self, call: str, batch: TrainBatch, **kwargs) -> tuple[list[list[int]], list]:
        """(the sequence indices each rank got, each rank's answer)."""
        if self.world_size == 1:
            return [list(range(len(batch)))], [self.ranks[0].call(call, batch, step=self.step, timeout_s=self.timeout_s,
                                                                  **kwargs)]
        shards = balanced_shards([len(t) for t in batch.tokens], max(self.dp_index) + 1)
        subs = [h.submit(call, batch.select(shards[d]), **kwargs) for h, d in zip(self.ranks, self.dp_index)]
        parts = gather(subs, step=self.step, timeout_s=self.timeout_s)
        first = {d: r for r, d in reversed(list(enumerate(self.dp_index)))}  # one answer per shard
        return shards, [parts[first[d]] for d in range(len(shards))]

    def _per_position(self, call: str, batch: TrainBatch) -> list[list[float]]:
        shards, parts = self._sharded(call, batch)
        out: list[list[float]] = [[] for _ in range(len(batch))]
        for idx, values in zip(shards, parts):
            for i, v in zip(idx, values):
                out[i] = v
        return out

    # -- the Trainer's surface -----------------------------------------------------------------
    def forward_backward(self, batch: TrainBatch, kl_coef: float | None = None) -> dict[str, float]:
        totals = batch.totals() if self.world_size > 1 else None
        return self._sharded("forward_backward", batch, kl_coef=kl_coef, totals=totals)[1][0]  # global metrics

    def optim_step(self) -> dict[str, float]:
        out = self._all("optim_step")[0]
        self._version += 1
        return out

    def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        return self._per_position("logprobs", batch)

    def ref_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        return self._per_position("ref_logprobs", batch)

    def values(self, batch: TrainBatch) -> list[list[float]]:
        return self._per_position("values", batch)

    def save(self, path: str) -> None:
        self._all("save", str(path))

    def load(self, path: str) -> None:
        self._version = self._all("load", str(path))[0]

    def named_weights(self):
        """Full weights, in this process: local mode only (ray mode pushes them rank to engine)."""
        if self.local is None:
            raise RuntimeError("named_weights: the trainer runs in Ray actors; weights move through tidal.weightsync")
        return self.local.named_weights()
