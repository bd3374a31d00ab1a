"""train.parallel: the mesh's degrees are validated before anything starts (the error names the
keys and their product), the batch goes to the data-parallel positions of the mesh, and a model
tensor parallelism cannot split is refused by name. No processes: pure checks."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from tidal.config import ParallelConfig, load_config
from tidal.models import resolve_model_dir
from tidal.runtime.handles import Handle
from tidal.runtime.trainer_group import TrainerGroup
from tidal.trainer.parallel import ParallelDims
from tidal.trainer.parallel.tensor import check_tp
from tidal.trainer.trainer import TrainBatch


def test_default_is_fsdp_over_every_rank():
    assert ParallelConfig().degrees(4) == {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1, "ep": 1}
    assert ParallelConfig(tp=2).degrees(4)["dp_shard"] == 2  # dp_shard=-1 takes the ranks left
    dims = ParallelDims.from_config(ParallelConfig(dp_replicate=2, tp=2), 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp_size, dims.fsdp) == (2, 2, 2, 4, True)
    assert not ParallelDims.from_config(ParallelConfig(tp=2), 2).fsdp  # tp alone: no data dimension


def test_a_product_that_misses_the_ranks_is_refused_with_the_keys():
    with pytest.raises(ValueError, match=r"dp_shard=2 x dp_replicate=1 x tp=2 .* = 4, but placement.trainer_ranks=2"):
        ParallelConfig(dp_shard=2, tp=2).degrees(2)
    with pytest.raises(ValueError, match=r"tp=3 .* = 3 does not divide placement.trainer_ranks=4"):
        ParallelConfig(tp=3).degrees(4)
    with pytest.raises(ValueError, match=r"ep=2 with tp=2: expert parallelism composes with dp_shard and dp_replicate"):
        ParallelConfig(ep=2, tp=2)
    with pytest.raises(ValueError, match=r"ep=2 with cp=2"):
        ParallelConfig(ep=2, cp=2)
    with pytest.raises(ValueError, match=r"dp_shard=3 x .* ep=2 = 6, but placement.trainer_ranks=4"):
        ParallelConfig(dp_shard=3, ep=2).degrees(4)
    # ... and in the whole config, before anything loads
    with pytest.raises(ValueError, match="placement.trainer_ranks=1"):
        load_config(None, ["train.parallel.tp=2"])
    load_config(None, ["placement.mode=ray", "placement.trainer_ranks=4", "train.parallel.tp=2"])


def test_tensor_parallel_ranks_share_a_data_shard():
    """Rank order is (dp_replicate, dp_shard, ep, cp, tp), tp innermost: a tp group is consecutive ranks."""
    dims = ParallelDims.from_config(ParallelConfig(dp_shard=2, tp=2), 4)
    assert [dims.dp_index(r) for r in range(4)] == [0, 0, 1, 1]
    dims = ParallelDims.from_config(ParallelConfig(dp_replicate=2, dp_shard=2), 4)
    assert [dims.dp_index(r) for r in range(4)] == [0, 1, 2, 3]
    dims = ParallelDims.from_config(ParallelConfig(dp_shard=2, cp=2), 4)  # cp ranks: one sequence, split
    assert [dims.dp_index(r) for r in range(4)] == [0, 0, 1, 1]
    dims = ParallelDims.from_config(ParallelConfig(ep=2), 4)  # ep ranks are data ranks: sequences of their own
    assert (dims.dp_shard, dims.dp_size, [dims.dp_index(r) for r in range(4)]) == (2, 4, [0, 1, 2, 3])


class _Rank:
    """A trainer rank's surface, in process: records the sequences it was sent."""

    def __init__(self):
        self.got = None

    def logprobs(self, batch):
        self.got = batch.tokens
        return [[float(len(t))] for t in batch.tokens]


def test_the_trainer_group_sends_one_shard_per_data_position():
    ranks = [_Rank() for _ in range(4)]
    group = TrainerGroup([Handle(f"trainer rank {i}", r) for i, r in enumerate(ranks)], dp_index=[0, 0, 1, 1])
    lengths = (5, 3, 4, 6)
    batch = TrainBatch([[1] * n for n in lengths], [[True] * n for n in lengths], [[0.0] * (n - 1) for n in lengths],
                       [[0.0] * n for n in lengths])
    out = group.logprobs(batch)
    assert ranks[0].got == ranks[1].got and ranks[2].got == ranks[3].got and ranks[0].got != ranks[2].got
    assert sorted(map(len, ranks[0].got + ranks[2].got)) == sorted(lengths)
    assert out == [[5.0], [3.0], [4.0], [6.0]]  # each sequence's answer once, in batch order


def test_models_tensor_parallelism_cannot_split_are_refused_by_name():
    cfg = AutoConfig.from_pretrained(resolve_model_dir("default"))  # 4 heads, 2 kv heads
    check_tp(cfg, 2)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        check_tp(cfg, 4, "the default model")
    cfg.model_type = "gpt2"
    with pytest.raises(ValueError, match="'gpt2' model; tensor-parallel plans exist for qwen2, qwen3, llama"):
        check_tp(cfg, 2)
