"""Context parallelism with activation checkpointing: the backward pass recomputes each block's
attention, which must find the micro-batch's spans and length (tidal/trainer/parallel/context.py
keeps them after the forward). cp 2 with `train.activation_checkpointing` against one process
without it, on the golden batch of tests/test_parallel.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from test_parallel import TOL, _batch, _free_port, _run

from tidal.config import AlgorithmConfig, ParallelConfig, TrainConfig
from tidal.models import resolve_model_dir
from tidal.trainer.trainer import Trainer


def _trainer(parallel: dict | None, checkpointing: bool) -> Trainer:
    train = TrainConfig(micro_batch_tokens=40, warmup_steps=0, parallel=ParallelConfig(**(parallel or {})),
                        logprob_chunk_tokens=16, activation_checkpointing=checkpointing)
    return Trainer(str(resolve_model_dir("default")), train, AlgorithmConfig(entropy_coef=0.01), pad_token_id=0)


def _worker(rank, world, port, tmp):
    from tidal.trainer.distributed import destroy, init_distributed

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    init_distributed(rank, world, "127.0.0.1", port, timeout_s=120)
    try:
        batch = _batch()
        out = _run(_trainer({"cp": 2}, True), batch, list(range(len(batch))))  # cp ranks share the batch
        if rank == 0:
            torch.save(out, tmp / "rank0.pt")
    finally:
        destroy()


@pytest.mark.slow  # two gloo processes, one step
@pytest.mark.timeout(600)
def test_cp2_with_activation_checkpointing_matches_one_process(tmp_path):
    torch.manual_seed(0)
    ref = _run(_trainer(None, False), _batch(), list(range(len(_batch()))))
    mp.spawn(_worker, args=(2, _free_port(), tmp_path), nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    # the tolerances of tests/test_parallel.py: the same sums in another order (recomputation
    # repeats the forward's arithmetic exactly, so it adds no difference of its own)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    for n, w in ref["grads"].items():
        torch.testing.assert_close(got["grads"][n], w, **TOL, msg=lambda m, n=n: f"grad {n}: {m}")
