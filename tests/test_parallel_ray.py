"""`tidal train` (the default task) on Ray with 2 trainer ranks at (tp 2) and at (cp 2): the
controller sends both ranks of the group the same sequences, the engines get the gathered
weights, and every step's numbers equal those of one local process (two mini-batches a step:
a PPO anchor `logprobs` call across ranks too)."""

from __future__ import annotations

import pytest
from test_placement import _train, config, metrics, ray_local, same_training  # noqa: F401 - ray_local: a fixture


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("shape", ["train.parallel.tp=2", "train.parallel.cp=2"])
def test_default_job_on_two_ranks_of_a_mesh_trains_as_one_process(tmp_path, ray_local, shape):  # noqa: F811
    common = ("train.mini_batches=2", "train.steps=2")
    _train(config(tmp_path, *common, name="local"))
    ctl = _train(config(tmp_path, "placement.mode=ray", "placement.trainer_ranks=2", shape, *common))
    assert ctl.trainer.world_size == 2 and ctl.trainer.version == 4 and ctl.trainer.dp_index == [0, 0]
    for a, b in zip(metrics(tmp_path / "local"), metrics(tmp_path / "run"), strict=True):
        # as tests/test_placement.py's 2 FSDP ranks: sums in another order over 4 optimizer steps;
        # a rank with the wrong shard or a missing reduction moves loss and grad_norm by percents
        same_training(a, b, tol=1e-4)
