"""Trainer: gradients independent of the micro-batch split (docs/architecture.md invariant), KL
reference only when needed, checkpoints that restore exactly."""

from __future__ import annotations

import random

import pytest
import torch

from tidal.algorithms import AGGREGATIONS
from tidal.config import AlgorithmConfig, LoraConfig, TrainConfig
from tidal.trainer.trainer import TrainBatch, Trainer, micro_batches

# Two computations of one gradient (micro-batch splits, shards summed, a hand-written loss): the same
# sums in another order. Measured here: ≤ 1.8e-7 on gradients up to 1.1, at most 4.2% of this bound
# (≥ 24x margin for another CPU's kernels and thread count); a wrong denominator or a dropped token
# changes gradients by whole percents, far over rtol=1e-4.
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}


def _batch(n=8, seed=0, with_old=True) -> TrainBatch:
    rng = random.Random(seed)
    tokens, masks, behav, old = [], [], [], []
    for _ in range(n):
        p, r = rng.randint(3, 9), rng.randint(1, 7)
        tokens.append([rng.randrange(10, 200) for _ in range(p + r)])
        masks.append([False] * p + [True] * r)
        behav.append([0.0] * p + [rng.uniform(-6, -4) for _ in range(r)])
        # per target position (len - 1): perturbed old log-probs make some ratios clip
        old.append([rng.uniform(-6.5, -4.5) for _ in range(p + r - 1)])
    # per-token advantages (target-aligned), varying within a sequence as GAE/REINFORCE++ give
    adv = [[rng.uniform(-1.5, 1.5) if m else 0.0 for m in mk[1:]] for mk in masks]
    return TrainBatch(tokens, masks, adv, behav, old if with_old else None)


def _grads(model_dir, budget, agg, kl=0.0, with_old=True, batch=None):
    torch.manual_seed(0)
    algo = AlgorithmConfig(loss_agg=agg, kl_coef=kl)
    tr = Trainer(str(model_dir), TrainConfig(micro_batch_tokens=budget), algo, pad_token_id=0)
    b = batch or _batch(with_old=with_old)
    n_micro = len(micro_batches([len(t) for t in b.tokens], budget))
    metrics = tr.forward_backward(b)
    return {n: p.grad.clone() for n, p in tr.model.named_parameters()}, n_micro, metrics


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_gradients_do_not_depend_on_micro_batch_split(tiny_model_dir, agg):
    whole, n1, m1 = _grads(tiny_model_dir, 10_000, agg)
    split, n4, m4 = _grads(tiny_model_dir, 24, agg)
    assert n1 == 1 and n4 >= 4
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], **GRAD_TOL)
    assert m4["loss"] == pytest.approx(m1["loss"], rel=1e-4, abs=1e-7)  # as GRAD_TOL; measured ≤ 3.3% of it
    assert m1["clip_frac"] > 0  # the perturbed old log-probs do exercise the clip


def test_split_invariance_with_kl_term(tiny_model_dir):
    whole, _, m = _grads(tiny_model_dir, 10_000, "token-mean", kl=0.1)
    split, _, _ = _grads(tiny_model_dir, 24, "token-mean", kl=0.1)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], **GRAD_TOL)
    assert m["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any step (measured 0.0)


def test_reference_model_only_with_kl(tiny_model_dir):
    assert Trainer(str(tiny_model_dir), TrainConfig(), AlgorithmConfig(kl_coef=0.0)).ref_model is None
    assert Trainer(str(tiny_model_dir), TrainConfig(), AlgorithmConfig(kl_coef=0.05)).ref_model is not None


def test_on_policy_gradient_is_minus_advantage_times_grad_logp(tiny_model_dir):
    """ratio 1, no clip: ∇loss = −Σ A·∇log π / tokens (token-mean)."""
    b = _batch(n=3, with_old=False)
    tr = Trainer(str(tiny_model_dir), TrainConfig(), AlgorithmConfig(), pad_token_id=0)
    tr.forward_backward(b)
    got = {n: p.grad.clone() for n, p in tr.model.named_parameters()}
    tr.model.zero_grad()
    total = sum(sum(m[1:]) for m in b.loss_mask)
    obj = 0.0
    for toks, mask, a in zip(b.tokens, b.loss_mask, b.advantages):
        logits = tr.model(torch.tensor([toks])).logits[0, :-1].log_softmax(-1)
        lp = logits.gather(-1, torch.tensor(toks[1:])[:, None]).squeeze(-1)
        obj = obj - (torch.tensor(a) * lp * torch.tensor(mask[1:], dtype=torch.float32)).sum() / total
    obj.backward()
    for n, p in tr.model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, **GRAD_TOL)


@pytest.mark.parametrize("packing", [False, True])
def test_output_head_runs_at_policy_tokens_only(tiny_model_dir, packing):
    """The update computes logits at the policy tokens alone (prompt and padding are skipped),
    and its metrics are those of the full logits at those tokens."""
    b = _batch(n=6)
    tr = Trainer(str(tiny_model_dir), TrainConfig(packing=packing), AlgorithmConfig(entropy_coef=0.01), pad_token_id=0)
    rows = []
    hook = tr.model.get_output_embeddings().register_forward_hook(lambda _m, _a, out: rows.append(out.shape[:-1]))
    m = tr.forward_backward(b)
    hook.remove()
    policy_tokens = sum(sum(mk[1:]) for mk in b.loss_mask)
    assert [tuple(r) for r in rows] == [(policy_tokens,)]  # one micro-batch, one head call on [N, H]
    ent, diff = 0.0, 0.0
    with torch.no_grad():
        for toks, mask, behav in zip(b.tokens, b.loss_mask, b.behaviour_logprobs):
            logp = tr.model(torch.tensor([toks])).logits[0, :-1].log_softmax(-1)
            at = torch.tensor(mask[1:])
            ent += float(-(logp.exp() * logp).sum(-1)[at].sum())
            lp = logp.gather(-1, torch.tensor(toks[1:])[:, None]).squeeze(-1)
            diff += float((lp - torch.tensor(behav[1:])).abs()[at].sum())
    # a per-token mean of the same values summed in another order: rel 1e-5 is ~100x float32 rounding
    assert m["entropy"] == pytest.approx(ent / policy_tokens, rel=1e-5)
    assert m["logprob_abs_diff"] == pytest.approx(diff / policy_tokens, rel=1e-5)


@pytest.mark.parametrize("lora", [0, 4])
def test_activation_checkpointing_recomputes_blocks_for_the_same_gradient(tiny_model_dir, lora):
    def run(ckpt: bool):
        torch.manual_seed(0)
        tr = Trainer(str(tiny_model_dir), TrainConfig(activation_checkpointing=ckpt, lora=LoraConfig(rank=lora)),
                     AlgorithmConfig(), pad_token_id=0)
        # count the runs of a block's MLP (module hooks do not fire in torch's recompute: wrap forward)
        mlp = next(m for n, m in tr.model.named_modules() if n.endswith("layers.0.mlp"))
        calls, forward = [], mlp.forward
        mlp.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
        tr.forward_backward(_batch())
        return {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}, len(calls)
    plain, n_plain = run(False)
    ckpt, n_ckpt = run(True)
    assert (n_plain, n_ckpt) == (1, 2)  # one micro-batch: the block runs again in backward
    assert plain and plain.keys() == ckpt.keys()
    for name in plain:  # the recomputation repeats the same ops on the same inputs
        torch.testing.assert_close(ckpt[name], plain[name], **GRAD_TOL)


def test_micro_batches_respect_budget_and_name_the_key():
    lengths = [5, 9, 3, 12, 7, 7]
    parts = micro_batches(lengths, 20)
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert all(len(p) * max(lengths[i] for i in p) <= 20 for p in parts)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        micro_batches([30], 20)


def test_checkpoint_restores_model_optimizer_and_rng(tiny_model_dir, tmp_path):
    tr = Trainer(str(tiny_model_dir), TrainConfig(), AlgorithmConfig(), pad_token_id=0)
    tr.forward_backward(_batch())
    tr.optim_step()
    tr.save(tmp_path / "ck")
    expected_next = torch.rand(3)
    tr.forward_backward(_batch(seed=1))
    tr.optim_step()
    after_two = {n: p.detach().clone() for n, p in tr.model.named_parameters()}

    tr2 = Trainer(str(tiny_model_dir), TrainConfig(), AlgorithmConfig(), pad_token_id=0)
    tr2.load(tmp_path / "ck")
    assert tr2.version == 1
    torch.testing.assert_close(torch.rand(3), expected_next, rtol=0, atol=0)  # RNG state restored: exactly
    tr2.forward_backward(_batch(seed=1))
    tr2.optim_step()
    for n, p in tr2.model.named_parameters():  # the same code on the same inputs and machine: bit-exact
        torch.testing.assert_close(p.detach(), after_two[n], rtol=0, atol=0)


def test_lr_schedule_warmup_then_constant_or_cosine():
    from tidal.trainer.trainer import lr_factor

    const = lr_factor(TrainConfig(steps=10, warmup_steps=4))
    assert [const(s) for s in (0, 1, 3, 9)] == [0.25, 0.5, 1.0, 1.0]
    cos = lr_factor(TrainConfig(steps=10, warmup_steps=0, lr_schedule="cosine", min_lr_ratio=0.1))
    # a few float ops on exact values (approx's default rel=1e-6)
    assert cos(0) == pytest.approx(1.0) and cos(5) == pytest.approx(0.55) and cos(10) == pytest.approx(0.1)
    two_updates = lr_factor(TrainConfig(steps=10, warmup_steps=0, lr_schedule="cosine", mini_batches=2))
    assert two_updates(10) == pytest.approx(0.55)  # the schedule counts optimizer steps


OPTIONS = {
    "gspo": dict(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean"),
    "cispo": dict(policy_loss="cispo", clip_low=1.0, clip_high=0.28),
    "dual-clip+entropy": dict(dual_clip=3.0, entropy_coef=0.01, loss_agg="seq-mean-token-sum"),
    "token-is+token-rejection": dict(is_level="token", is_cap=2.0, rejection="token", reject_low=0.5, reject_high=2.0),
    "seq-is+geometric-rejection": dict(is_level="sequence", is_cap=1.0, rejection="geometric", reject_low=0.7,
                                       reject_high=1.5, loss_agg="seq-mean-token-sum-norm"),
    "behaviour-anchor": dict(anchor="behaviour"),
}


def _option_grads(model_dir, budget, opts, batch=None, totals=None):
    torch.manual_seed(0)
    tr = Trainer(str(model_dir), TrainConfig(micro_batch_tokens=budget), AlgorithmConfig(**opts), pad_token_id=0,
                 norm_len=7)
    metrics = tr.forward_backward(batch or _batch(), totals=totals)
    return {n: p.grad.clone() for n, p in tr.model.named_parameters()}, metrics


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_split_invariance_of_every_loss_option(tiny_model_dir, option):
    """The invariant holds for every policy loss, correction and bonus, not just plain PPO."""
    whole, m = _option_grads(tiny_model_dir, 10_000, OPTIONS[option])
    split, _ = _option_grads(tiny_model_dir, 24, OPTIONS[option])
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], **GRAD_TOL)
    if "is_level" in OPTIONS[option]:
        # the batch's behaviour log-probs are not the model's: the correction is exercised
        assert m["is_truncated_frac"] > 0 and m["is_weight"] != pytest.approx(1.0)
        assert 0 < m["rejected_frac"] < 1


def test_data_parallel_shards_with_global_totals_sum_to_the_whole_batch(tiny_model_dir):
    """What a data-parallel rank does: its shard's share with the global denominators.
    The shards' gradients add up to the whole batch's (the gloo version of this runs in
    tests/test_aggregation_dp.py on the pure functions)."""
    b = _batch()
    for agg in AGGREGATIONS:
        opts = dict(loss_agg=agg)
        whole, _ = _option_grads(tiny_model_dir, 10_000, opts, batch=b)
        shards = [b.select([0, 1, 2]), b.select([3, 4, 5, 6, 7])]
        parts = [_option_grads(tiny_model_dir, 10_000, opts, batch=s, totals=b.totals())[0] for s in shards]
        for name in whole:
            torch.testing.assert_close(parts[0][name] + parts[1][name], whole[name], **GRAD_TOL)


def test_critic_starts_at_zero_and_fits_returns(tiny_model_dir, tmp_path):
    tr = Trainer(str(tiny_model_dir), TrainConfig(warmup_steps=0), AlgorithmConfig(advantage="gae"), pad_token_id=0)
    b = _batch(with_old=False)
    values = tr.values(b)
    assert [len(v) for v in values] == [len(t) - 1 for t in b.tokens]
    assert all(v == 0.0 for row in values for v in row)  # zero-initialized head
    b.old_values = values
    b.returns = [[1.0 if m else 0.0 for m in mk[1:]] for mk in b.loss_mask]
    losses = []
    for _ in range(15):
        losses.append(tr.forward_backward(b)["value_loss"])
        tr.optim_step()
        b.old_values = tr.values(b)  # fresh anchor each round, as each PPO batch has
    assert losses[0] == pytest.approx(0.5)  # ½(0 − 1)² on every token: exact up to float32 rounding of the mean
    assert losses[-1] < 0.1 * losses[0]
    tr.save(tmp_path / "ck")
    tr2 = Trainer(str(tiny_model_dir), TrainConfig(warmup_steps=0), AlgorithmConfig(advantage="gae"), pad_token_id=0)
    tr2.load(tmp_path / "ck")
    assert tr2.values(b) == tr.values(b)


@pytest.mark.parametrize("attention", ["auto", "sdpa"])
def test_mixed_precision_computes_in_bfloat16_over_float32_weights(tiny_model_dir, attention):
    """train.mixed_precision: the forward runs in bfloat16 (autocast), parameters, gradients and
    the optimizer's state stay float32, and the gradient is the float32 one up to bfloat16's
    rounding, with the attention CPU mixed precision picks (eager) and with torch's fused one."""
    def run(mixed):
        torch.manual_seed(0)
        tr = Trainer(str(tiny_model_dir), TrainConfig(mixed_precision=mixed, warmup_steps=0,
                                                      attention=attention if mixed else "auto"),
                     AlgorithmConfig(), pad_token_id=0)
        logits, _ = tr._forward(tr.model, _batch().tokens[:2])
        metrics = tr.forward_backward(_batch())
        grads = {n: p.grad.clone() for n, p in tr.model.named_parameters()}
        tr.optim_step()
        return tr, logits.dtype, grads, metrics

    full, full_dtype, want, m32 = run(False)
    mixed, mixed_dtype, got, m16 = run(True)
    assert (full_dtype, mixed_dtype) == (torch.float32, torch.bfloat16)
    expected = "eager" if attention == "auto" else attention  # auto: eager under CPU mixed precision
    assert (full.model.config._attn_implementation, mixed.model.config._attn_implementation) == ("sdpa", expected)
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    assert all(v.dtype == torch.float32 for st in mixed.optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.is_floating_point())
    flat = lambda g: torch.cat([t.flatten() for t in g.values()])
    # bfloat16 keeps 8 bits of mantissa (relative rounding 2^-8 per op). Measured here: cosine
    # 1 - 7e-7 with the float32 gradient, norm ratio 1.0004; the bounds (1 - 1e-3, 1%) leave
    # >1000x and 25x for other kernels. A broken cast or a lost master copy lands far outside.
    cos = torch.nn.functional.cosine_similarity(flat(got), flat(want), dim=0)
    assert cos > 0.999, float(cos)
    assert abs(flat(got).norm() / flat(want).norm() - 1) < 0.01
    assert m16["loss"] == pytest.approx(m32["loss"], rel=0.05, abs=1e-3)  # the same loss, bfloat16-rounded
    assert not torch.equal(flat(got), flat(want))  # it did compute in bfloat16


def test_mismatch_metrics_show_a_bfloat16_engine_and_the_correction_sees_it(tiny_model_dir):
    """Samples from a float32 and from a bfloat16 torch engine, scored by a float32 trainer: the
    engine/trainer mismatch metrics are float32 rounding for the first and bfloat16's for the
    second, and the token-level IS correction reacts only to the second."""
    from tidal.engines.torch_engine import TorchEngine
    from tidal.models import load_model
    from tidal.types import GenerationRequest, SamplingParams

    prompts = [[random.Random(i).randrange(10, 200) for _ in range(6)] for i in range(8)]
    reqs = [GenerationRequest(str(i), p, SamplingParams(max_new_tokens=12, temperature=1.0, seed=i))
            for i, p in enumerate(prompts)]
    metrics = {}
    for dtype in ("float32", "bfloat16"):
        engine = TorchEngine(load_model(tiny_model_dir, dtype=dtype), pad_token_id=0)
        try:
            results = engine.generate_sync(reqs)
        finally:
            engine.close()
        tokens = [p + r.token_ids for p, r in zip(prompts, results)]
        masks = [[False] * len(p) + [True] * len(r.token_ids) for p, r in zip(prompts, results)]
        behav = [[0.0] * len(p) + list(r.logprobs) for p, r in zip(prompts, results)]
        batch = TrainBatch(tokens, masks, [[0.0] * (len(t) - 1) for t in tokens], behav)
        tr = Trainer(str(tiny_model_dir), TrainConfig(), AlgorithmConfig(is_level="token", is_cap=100.0), pad_token_id=0)
        metrics[dtype] = tr.forward_backward(batch)
    fp32, bf16 = metrics["float32"], metrics["bfloat16"]
    # float32 engine: the same model and ops, batched differently: rounding only. Measured: mean
    # 8.4e-8, KL 2e-14, IS weight 1.0 exactly; the bounds leave >100x for another CPU's kernels.
    assert fp32["logprob_abs_diff"] < 1e-5 and fp32["mismatch_kl"] < 1e-9
    assert fp32["is_weight"] == pytest.approx(1.0, abs=1e-5)
    # bfloat16 weights and compute (an 8-bit mantissa). Measured: mean 6.7e-4 (8,000x float32's), KL
    # 3.8e-7, max 2.6e-3, IS weight 1 - 1.1e-4; each bound sits 5-40x below what bfloat16 gives.
    assert bf16["logprob_abs_diff"] > 100 * fp32["logprob_abs_diff"] and bf16["logprob_abs_diff"] > 1e-4
    assert bf16["mismatch_kl"] > 1e-8 and bf16["logprob_max_abs_diff"] > 5e-4
    assert bf16["is_weight"] != pytest.approx(1.0, abs=1e-5)


def test_mixed_precision_needs_float32_weights():
    from tidal.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"train.mixed_precision keeps float32 master weights: model.dtype"):
        load_config(None, ["train.mixed_precision=true", "model.dtype=bfloat16"])
    cfg = load_config(None, ["train.mixed_precision=true", "engine.dtype=bfloat16"])
    assert cfg.engine_dtype() == "bfloat16" and load_config(None, []).engine_dtype() == "float32"
