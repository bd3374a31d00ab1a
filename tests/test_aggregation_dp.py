"""Loss aggregation across data-parallel ranks: a batch split over 2 gloo processes, each
rank taking its share under the global token/sequence totals (all-reduced counts) and
the gradients summed, gives the single-process full-batch gradient in every aggregation
mode. Loopback only; spawn cannot return values, so rank 0 saves its gradients to a file.

Legend: B sequences, T tokens, F features, V vocab."""

import datetime
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from tidal.algorithms import AGGREGATIONS, aggregate, policy_loss, token_logprobs

WORLD = 2
SHARDS = (slice(0, 3), slice(3, 8))  # uneven on purpose: 3 and 5 sequences
LOSSES = ("ppo", "gspo")


def _problem():
    """A Linear model over random features and a batch of variable-length masked sequences."""
    g = torch.Generator().manual_seed(0)
    B, T, F, V = 8, 7, 6, 5
    model = torch.nn.Linear(F, V, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    feats_BTF = torch.randn(B, T, F, generator=g, dtype=torch.float64)
    targets_BT = torch.randint(0, V, (B, T), generator=g)
    lengths_B = torch.tensor([7, 1, 4, 6, 2, 5, 3, 7])
    mask_BT = torch.arange(T)[None, :] < lengths_B[:, None]
    with torch.no_grad():
        old_logp_BT = token_logprobs(model(feats_BTF), targets_BT) + 0.3 * torch.randn(B, T, generator=g)
    adv_BT = torch.randn(B, 1, generator=g).expand(B, T)
    return model, (feats_BTF, targets_BT, old_logp_BT, adv_BT, mask_BT)


def _share_grads(model, batch, loss_name, mode, total_tokens, total_seqs):
    feats_BTF, targets_BT, old_logp_BT, adv_BT, mask_BT = batch
    model.zero_grad()
    logp_BT = token_logprobs(model(feats_BTF), targets_BT)
    clip = 0.2 if loss_name == "ppo" else 0.1
    loss_BT, _ = policy_loss(loss_name, logp_BT, old_logp_BT, adv_BT, mask_BT, clip, clip)
    aggregate(loss_BT, mask_BT, mode, total_tokens, total_seqs, norm_len=7.0).backward()
    return [p.grad.clone() for p in model.parameters()]


def _worker(rank, port, out_path):
    torch.set_num_threads(1)
    # gloo otherwise binds to whatever the hostname resolves to; keep the ranks on loopback
    os.environ["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        model, batch = _problem()
        shard = tuple(x[SHARDS[rank]] for x in batch)
        mask_BT = shard[-1]
        counts = torch.tensor([mask_BT.sum(), mask_BT.any(-1).sum()], dtype=torch.float64)
        dist.all_reduce(counts)  # global totals: every rank normalizes by the whole batch
        total_tokens, total_seqs = counts.tolist()
        result = {"totals": (total_tokens, total_seqs)}
        for loss_name in LOSSES:
            for mode in AGGREGATIONS:
                grads = _share_grads(model, shard, loss_name, mode, total_tokens, total_seqs)
                for grad in grads:
                    dist.all_reduce(grad)  # SUM
                result[f"{loss_name}/{mode}"] = grads
        if rank == 0:
            torch.save(result, out_path)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_two_gloo_ranks_give_the_full_batch_gradient(tmp_path):
    out_path = tmp_path / "rank0_grads.pt"
    mp.spawn(_worker, args=(_free_port(), str(out_path)), nprocs=WORLD, join=True)
    result = torch.load(out_path)

    model, batch = _problem()
    mask_BT = batch[-1]
    total_tokens, total_seqs = float(mask_BT.sum()), float(mask_BT.any(-1).sum())
    assert result["totals"] == (total_tokens, total_seqs) == (35.0, 8.0)
    for loss_name in LOSSES:
        for mode in AGGREGATIONS:
            full = _share_grads(model, batch, loss_name, mode, total_tokens, total_seqs)
            assert sum(g.abs().sum() for g in full) > 0
            key = f"{loss_name}/{mode}"
            for dp, ref in zip(result[key], full, strict=True):
                # float64 (default rtol=atol=1e-7): shard sums vs whole-batch sums differ in summation order
                # only; measured 2.2e-16, 1e-9 of the bound, while a wrong denominator is off by whole percents
                assert_close(dp, ref, msg=lambda m, key=key: f"{key}: {m}")
