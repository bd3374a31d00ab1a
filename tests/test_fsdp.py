"""Data-parallel Trainer: 2 gloo ranks with FSDP2, each on its balanced shard of a global
batch under the global denominators, give the single-process gradients, metrics and
updated weights of the whole batch (policy and critic), with uneven micro-batch counts
across ranks and a rank with an empty shard; checkpoints move between 1 and 2 ranks; shared
prompts (`train.share_prompts`) sharded.

One spawn of 2 processes does all the distributed work (spawn cannot return values:
rank 0 saves what it gathered to a file); the single-process references are computed
in the test process."""

from __future__ import annotations

import os
import random
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

from tidal.config import AlgorithmConfig, TrainConfig
from tidal.models import resolve_model_dir
from tidal.trainer.distributed import balanced_shards
from tidal.trainer.trainer import TrainBatch, Trainer, micro_batches

WORLD = 2
BUDGET = 40  # micro_batch_tokens: rank 0's shard (28 + 4 tokens) needs 2 micro-batches, rank 1's 6 rows need 1
LENGTHS = [6, 28, 5, 4, 6, 5, 4, 5]
# 2 ranks vs 1 process: the same quantities summed in a different order (sharded micro-batches,
# all-reduce). Measured here: gradients (|g| ≤ 0.16) differ by ≤ 2.3e-8, log-probs/values (|x| ≤ 20)
# by ≤ 3.8e-6 (2.6% of this bound), metrics by ≤ 0.8% of theirs: ≥ 25x margin for another CPU's
# kernels, while a wrong denominator or a dropped micro-batch moves them by whole percents.
TOL = {"rtol": 1e-5, "atol": 1e-6}
# A: token-mean with a critic (gae); B: seq-mean-token-sum with a KL term in the loss (a sharded reference)
CASES = {"A": {"loss_agg": "token-mean", "advantage": "gae"},
         "B": {"loss_agg": "seq-mean-token-sum", "kl_coef": 0.1, "entropy_coef": 0.01}}


def _batch(lengths=LENGTHS, seed=0) -> TrainBatch:
    rng = random.Random(seed)
    tokens, masks, behav, old = [], [], [], []
    for n in lengths:
        p = max(2, n // 2)
        tokens.append([rng.randrange(10, 200) for _ in range(n)])
        masks.append([False] * p + [True] * (n - p))
        behav.append([0.0] * p + [rng.uniform(-6, -4) for _ in range(n - p)])
        old.append([rng.uniform(-6.5, -4.5) for _ in range(n - 1)])
    adv = [[rng.uniform(-1.5, 1.5) if m else 0.0 for m in mk[1:]] for mk in masks]
    returns = [[rng.uniform(-1, 1) if m else 0.0 for m in mk[1:]] for mk in masks]
    old_values = [[rng.uniform(-0.3, 0.3) for _ in mk[1:]] for mk in masks]
    return TrainBatch(tokens, masks, adv, behav, old, returns, old_values)


def _grouped_batch(seed=1) -> TrainBatch:
    """GRPO-shaped, for train.share_prompts: 3 prompts × 3 samples (siblings land on both ranks)."""
    rng = random.Random(seed)
    tokens, masks, behav = [], [], []
    for _ in range(3):
        prompt = [rng.randrange(10, 200) for _ in range(rng.randint(3, 6))]
        for _ in range(3):
            r = rng.randint(2, 9)
            tokens.append(prompt + [rng.randrange(10, 200) for _ in range(r)])
            masks.append([False] * len(prompt) + [True] * r)
            behav.append([0.0] * len(prompt) + [rng.uniform(-6, -4) for _ in range(r)])
    adv = [[rng.uniform(-1.5, 1.5) if m else 0.0 for m in mk[1:]] for mk in masks]
    return TrainBatch(tokens, masks, adv, behav)


def _shared_trainer(share: bool) -> Trainer:
    return Trainer(str(resolve_model_dir("default")), TrainConfig(micro_batch_tokens=BUDGET, share_prompts=share),
                   AlgorithmConfig(**CASES["B"]), pad_token_id=0)


def _trainer(case: str) -> Trainer:
    return Trainer(str(resolve_model_dir("default")), TrainConfig(micro_batch_tokens=BUDGET),
                   AlgorithmConfig(**CASES[case]), pad_token_id=0)


def _grads(model) -> dict[str, torch.Tensor]:
    from tidal.trainer.distributed import full_tensor

    return {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}


def _optim_state(tr: Trainer) -> dict:
    from tidal.trainer.distributed import optimizer_state

    return optimizer_state(tr.model, tr.optimizer).get("state", {})  # empty off rank 0


def _worker(rank, port, tmp):
    from tidal.trainer.distributed import destroy, init_distributed

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"  # ranks on loopback
    init_distributed(rank, WORLD, "127.0.0.1", port, timeout_s=60)
    try:
        out = {}
        batch = _batch()
        shard = batch.select(balanced_shards(LENGTHS, WORLD)[rank])
        for case in CASES:
            tr = _trainer(case)
            out[case, "logprobs"] = tr.logprobs(shard)  # no-grad passes, padded to the same count
            out[case, "metrics"] = tr.forward_backward(shard, totals=batch.totals())
            out[case, "grads"] = _grads(tr.model)
            if tr.ref_model is not None:
                out[case, "ref_logprobs"] = tr.ref_logprobs(shard)
            if tr.critic is not None:
                out[case, "values"] = tr.values(shard)
                out[case, "critic_grads"] = _grads(tr.critic.model)
            out[case, "step"] = tr.optim_step()
            out[case, "weights"] = tr.named_weights()
            if case == "A":
                tr.save(tmp / "ck2")
            else:  # a one-sequence batch: rank 1's shard is empty; the totals are all-reduced
                # A fresh trainer: the same weights on both sides (after optim_step they differ by
                # float rounding, which the gradient comparison's tolerance is not meant to absorb).
                fresh = _trainer(case)
                one = _batch(lengths=[9])
                out[case, "one_metrics"] = fresh.forward_backward(one.select(balanced_shards([9], WORLD)[rank]))
                out[case, "one_grads"] = _grads(fresh.model)
        # mixed precision, sharded: FSDP2 casts each group's parameters to bfloat16 for compute
        mixed = Trainer(str(resolve_model_dir("default")), TrainConfig(micro_batch_tokens=BUDGET, mixed_precision=True),
                        AlgorithmConfig(**CASES["B"]), pad_token_id=0)
        mixed.forward_backward(shard, totals=batch.totals())
        out["M", "grads"] = _grads(mixed.model)
        out["M", "dtypes"] = {p.dtype for p in mixed.model.parameters()} | {p.grad.dtype for p in
                                                                             mixed.model.parameters()}
        # train.share_prompts, sharded: each rank lays out the groups of its own shard
        grouped = _grouped_batch()
        shared = _shared_trainer(True)
        shared.forward_backward(grouped.select(balanced_shards([len(t) for t in grouped.tokens], WORLD)[rank]),
                                totals=grouped.totals())
        out["S", "grads"] = _grads(shared.model)
        resumed = _trainer("A")
        resumed.load(tmp / "ck1")  # saved by one process
        out["from1", "weights"] = resumed.named_weights()
        out["from1", "optim"] = _optim_state(resumed)
        out["from1", "critic_weights"] = {n: w.clone() for n, w in _grads_free_weights(resumed.critic.model).items()}
        if rank == 0:
            out["shard"] = shard
            torch.save(out, tmp / "rank0.pt")
    finally:
        destroy()


def _grads_free_weights(model) -> dict[str, torch.Tensor]:
    from tidal.trainer.distributed import full_tensor

    return {n: full_tensor(p.detach()) for n, p in model.named_parameters()}


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _close(got: dict, want: dict, what: str, **tol):
    assert got.keys() == want.keys(), what
    for n, w in want.items():
        torch.testing.assert_close(got[n], w, **(tol or TOL), msg=lambda m, n=n: f"{what} {n}: {m}")


def test_balanced_shards():
    assert balanced_shards([5, 9, 3, 12, 7, 7], 2) == [[2, 3, 5], [0, 1, 4]]  # 22 and 21 tokens
    assert balanced_shards([4, 4, 4], 2) == [[0, 2], [1]]  # ties: lowest index first, to the lowest shard
    assert balanced_shards([0, 0, 5], 3) == [[2], [0], [1]]  # every shard gets one when there are enough
    assert balanced_shards([3], 2) == [[0], []]
    assert balanced_shards([], 2) == [[], []]
    parts = balanced_shards(LENGTHS, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(LENGTHS)))
    assert all(p == sorted(p) and p for p in parts)
    with pytest.raises(ValueError):
        balanced_shards([1], 0)


@pytest.mark.timeout(240)
def test_two_fsdp_ranks_match_one_process(tmp_path):
    shards = balanced_shards(LENGTHS, WORLD)
    counts = [len(micro_batches([LENGTHS[i] for i in s], BUDGET)) for s in shards]
    assert counts[0] != counts[1], counts  # uneven micro-batch counts: one rank runs dummy passes

    # single process, whole batch; also a checkpoint for the 2 ranks to resume from
    batch = _batch()
    ref = {}
    for case in CASES:
        torch.manual_seed(0)
        tr = _trainer(case)
        ref[case, "logprobs"] = tr.logprobs(batch)
        ref[case, "metrics"] = tr.forward_backward(batch)
        ref[case, "grads"] = _grads(tr.model)
        if tr.ref_model is not None:
            ref[case, "ref_logprobs"] = tr.ref_logprobs(batch)
        if tr.critic is not None:
            ref[case, "values"] = tr.values(batch)
            ref[case, "critic_grads"] = _grads(tr.critic.model)
        ref[case, "step"] = tr.optim_step()
        ref[case, "weights"] = tr.named_weights()
        if case == "A":
            tr.save(tmp_path / "ck1")
            ref[case, "optim"] = _optim_state(tr)
            ref[case, "critic_weights"] = _grads_free_weights(tr.critic.model)
        else:  # on the initial weights, as in the worker
            fresh = _trainer(case)
            ref[case, "one_metrics"] = fresh.forward_backward(_batch(lengths=[9]))
            ref[case, "one_grads"] = _grads(fresh.model)

    mp.spawn(_worker, args=(_free_port(), tmp_path), nprocs=WORLD, join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)

    for case in CASES:
        _close(got[case, "grads"], ref[case, "grads"], f"{case} policy grad")
        assert sum(float(g.abs().sum()) for g in ref[case, "grads"].values()) > 0
        m, r = got[case, "metrics"], ref[case, "metrics"]
        assert m.keys() == r.keys()
        for k in r:  # as TOL (measured ≤ 8.7e-7 against 1.9e-4 allowed)
            assert m[k] == pytest.approx(r[k], rel=1e-5, abs=1e-6), (case, k)
        for k in ("grad_norm", "lr", "skipped_step"):  # grad_norm ~2.6 differs by ≤ 7e-7 (3.7% of rel=1e-5)
            assert got[case, "step"][k] == pytest.approx(ref[case, "step"][k], rel=1e-5), (case, k)
        # The sharded step against the one-process optimizer on the same (gathered) gradients, not
        # on the reference's: Adam's first step is lr·g/(|g| + eps), so a gradient of |g| ~ eps =
        # 1e-8 (thousands here have |g| < 1e-7) turns the gradients' summation-order noise (~1e-9) into
        # an update change of up to 2·lr = 1.2e-4; against the reference weights it measured 3.9e-7,
        # already 40% of 1e-6, and another CPU's kernels could exceed it. On the same gradients the
        # step is elementwise: it differs only by the clip coefficient's rounding and a weight's ulp
        # (1.2e-7 at |w| ≤ 1.6); measured 1.5e-8. A wrong lr, a skipped or doubled step moves weights
        # by ~lr = 6e-5. The gradients themselves are compared above.
        _close(got[case, "weights"], _stepped(case, got), f"{case} updated weight", rtol=0, atol=1e-6)
        rows = got["shard"].tokens
        idx = [batch.tokens.index(t) for t in rows]
        for key in ("logprobs", "ref_logprobs", "values"):
            if (case, key) in ref:
                for row, i in zip(got[case, key], idx):
                    torch.testing.assert_close(torch.tensor(row), torch.tensor(ref[case, key][i]), **TOL)
    assert "kl" in got["B", "metrics"] and "value_loss" in got["A", "metrics"]
    _close(got["A", "critic_grads"], ref["A", "critic_grads"], "critic grad")
    assert "critic_grad_norm" in got["A", "step"]

    # mixed precision on 2 ranks: float32 parameters and gradients (reduced in float32), the
    # gradient within bfloat16's rounding of the float32 one (as the one-process test bounds it:
    # cosine > 1 - 1e-3, norm within 1%)
    assert got["M", "dtypes"] == {torch.float32}
    flat = lambda g: torch.cat([g[n].flatten() for n in sorted(g)])
    mixed, full = flat(got["M", "grads"]), flat(ref["B", "grads"])
    assert torch.nn.functional.cosine_similarity(mixed, full, dim=0) > 0.999
    assert abs(mixed.norm() / full.norm() - 1) < 0.01 and not torch.equal(mixed, full)

    # train.share_prompts on 2 ranks: the one-process padded gradient of the whole grouped batch
    torch.manual_seed(0)
    padded = _shared_trainer(False)
    padded.forward_backward(_grouped_batch())
    # Each tensor within 1e-4 of its largest entry: this batch's summed (seq-mean-token-sum) gradients
    # reach |g| ~ 4, and the shared and padded layouts sum in different orders; measured in one
    # process ≤ 6e-6 of the largest entry (16x margin), where a dropped token or a wrong mask moves
    # gradients by whole percents.
    want = _grads(padded.model)
    for n, w in want.items():
        diff = float((got["S", "grads"][n] - w).abs().max())
        assert diff <= 1e-4 * float(w.abs().max()), (n, diff)
    assert sum(float(w.abs().sum()) for w in want.values()) > 0

    # a rank with nothing to train on still joins every collective; totals default to global ones
    _close(got["B", "one_grads"], ref["B", "one_grads"], "one-sequence grad")
    for k, v in ref["B", "one_metrics"].items():
        assert got["B", "one_metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k

    # checkpoints: 1 process → 2 ranks (in the worker), 2 ranks → 1 process (here)
    _close(got["from1", "weights"], ref["A", "weights"], "resumed on 2 ranks", rtol=0, atol=0)
    _close(got["from1", "critic_weights"], ref["A", "critic_weights"], "critic resumed on 2 ranks", rtol=0, atol=0)
    _compare_optim(got["from1", "optim"], ref["A", "optim"], exact=True)
    one = _trainer("A")
    one.load(tmp_path / "ck2")
    assert one.version == 1
    _close(one.named_weights(), got["A", "weights"], "resumed from 2 ranks", rtol=0, atol=0)
    _compare_optim(_optim_state(one), ref["A", "optim"], exact=False)
    # and it trains on from there like the one-process run
    tr1 = _trainer("A")
    tr1.load(tmp_path / "ck1")
    for t in (one, tr1):
        t.forward_backward(batch)
        t.optim_step()
    # The starting weights and Adam moments differ by float noise (above), which the second step
    # amplifies without bound where m and sqrt(v) are ~eps: element-wise the two runs differed by
    # 4.0e-6 here (40% of the 1e-5 once used), and another CPU could flip such an element's update
    # (~2·lr = 2.4e-4). So compare the whole step's update Δ = w₂ − w₁ in norm: measured
    # |Δ_one − Δ_ref| / |Δ_ref| = 5.6e-5, 180x under the bound; a bound of 1e-2 still lets ~20 fully
    # flipped elements through. A resume without the optimizer state gives 0.40, a wrong step
    # count (bias correction, lr warm-up) 0.31.
    start, w_one, w_ref = ref["A", "weights"], one.named_weights(), tr1.named_weights()
    assert w_one.keys() == w_ref.keys()
    gap = sum(float((w_one[n] - w_ref[n]).double().square().sum()) for n in w_ref) ** 0.5
    step = sum(float((w_ref[n] - start[n]).double().square().sum()) for n in w_ref) ** 0.5
    assert step > 0 and gap / step < 1e-2, f"second step after resume: |Δ_one − Δ_ref| / |Δ_ref| = {gap / step:.2e}"


def _stepped(case: str, got: dict) -> dict[str, torch.Tensor]:
    """A fresh one-process trainer's weights after its optimizer step on the gradients in got."""
    tr = _trainer(case)
    for n, p in tr.model.named_parameters():
        p.grad = got[case, "grads"][n].clone()
    if tr.critic is not None:
        for n, p in tr.critic.model.named_parameters():
            p.grad = got[case, "critic_grads"][n].clone()
    tr.optim_step()
    return tr.named_weights()


def _compare_optim(got: dict, want: dict, exact: bool):
    assert got.keys() == want.keys()
    for name, state in want.items():
        for k, w in state.items():
            # inexact: the 2 ranks' moments (0.1·g, 0.01·g²) carry their gradients' noise; measured ≤ 2.3e-10
            torch.testing.assert_close(got[name][k], w, **({"rtol": 0, "atol": 0} if exact else TOL),
                                       msg=lambda m, name=name, k=k: f"optimizer {name}.{k}: {m}")


def test_checkpoint_with_index_keyed_optimizer_state_still_loads(tmp_path):
    """Checkpoints written before the optimizer state was keyed by parameter name resume in
    one process as before."""
    tr = _trainer("A")
    tr.forward_backward(_batch())
    tr.optim_step()
    tr.save(tmp_path / "ck")
    st = torch.load(tmp_path / "ck" / "trainer_state.pt", weights_only=False)
    st["optimizer"], st["critic"]["optimizer"] = tr.optimizer.state_dict(), tr.critic.optimizer.state_dict()
    torch.save(st, tmp_path / "ck" / "trainer_state.pt")
    again = _trainer("A")
    again.load(tmp_path / "ck")
    _compare_optim(_optim_state(again), _optim_state(tr), exact=True)
