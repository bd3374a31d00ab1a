"""LoRA (`train.lora`, peft): adapters train and nothing else; the reference is the base with the
adapters off (no second copy); engines receive merged weights under the base model's names;
checkpoints hold the adapter, resume from it, and load as a model directory anywhere."""

from __future__ import annotations

import json

import pytest
import test_fsdp as fsdp
import torch
from test_trainer import GRAD_TOL, _batch

from tidal.config import AlgorithmConfig, LoraConfig, TrainConfig
from tidal.engines.torch_engine import TorchEngine
from tidal.models import load_model, resolve_model_dir
from tidal.trainer.trainer import Trainer, micro_batches


def _trainer(model_dir, rank=4, kl=0.0, budget=10_000, lr=1e-2, seed=0):
    torch.manual_seed(seed)
    return Trainer(str(model_dir), TrainConfig(micro_batch_tokens=budget, lr=lr, warmup_steps=0,
                                               lora=LoraConfig(rank=rank)), AlgorithmConfig(kl_coef=kl), pad_token_id=0)


def _flat(rows: list[list[float]]) -> list[float]:
    return [x for r in rows for x in r]


def _steps(tr, n=2):
    for s in range(n):
        tr.forward_backward(_batch(seed=s))
        tr.optim_step()


def test_adapters_train_alone_and_start_as_the_base(tiny_model_dir):
    tr = _trainer(tiny_model_dir)
    trainable = [n for n, p in tr.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert {id(p) for g in tr.optimizer.param_groups for p in g["params"]} == \
        {id(p) for p in tr.model.parameters() if p.requires_grad}
    plain = Trainer(str(tiny_model_dir), TrainConfig(), AlgorithmConfig(), pad_token_id=0)
    b = _batch()
    # B starts at zero: the adapted model adds an exact 0 to every projection (same kernels, same bits)
    for got, want in zip(tr.logprobs(b), plain.logprobs(b)):
        assert got == want
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if not p.requires_grad}
    _steps(tr)
    for n, p in tr.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, before[n]), f"{n} is frozen but changed"
    assert tr.logprobs(b) != plain.logprobs(b)


def test_reference_is_the_base_with_adapters_off(tiny_model_dir):
    tr = _trainer(tiny_model_dir, kl=0.1)
    assert tr.ref_model is None  # no second copy of the weights
    _steps(tr)
    b = _batch(seed=5)
    base = Trainer(str(tiny_model_dir), TrainConfig(), AlgorithmConfig(), pad_token_id=0)
    want = _flat(base.logprobs(b))
    # the base's computation, adapters skipped: float32 rounding of the same ops at most (measured 0)
    assert _flat(tr.ref_logprobs(b)) == pytest.approx(want, abs=1e-6)
    assert _flat(tr.logprobs(b)) != pytest.approx(want, abs=1e-3)  # ... while the policy has moved
    m = tr.forward_backward(b)
    assert m["kl"] > 0


def test_split_invariance_with_adapters(tiny_model_dir):
    def grads(budget):
        tr = _trainer(tiny_model_dir, kl=0.05, budget=budget)
        b = _batch()
        n = len(micro_batches([len(t) for t in b.tokens], budget))
        tr.forward_backward(b)
        # B is zero at the start, so only B has a gradient worth comparing on step 1: take both
        return {k: p.grad.clone() for k, p in tr.model.named_parameters() if p.grad is not None}, n
    whole, n1 = grads(10_000)
    split, n4 = grads(24)
    assert n1 == 1 and n4 >= 4 and whole
    assert any(float(g.abs().max()) > 0 for g in whole.values())
    for k in whole:
        torch.testing.assert_close(split[k], whole[k], **GRAD_TOL)


def test_merged_weights_are_the_adapted_model_under_base_names(tiny_model_dir):
    tr = _trainer(tiny_model_dir)
    _steps(tr)
    merged = tr.named_weights()
    plain = load_model(tiny_model_dir)
    assert set(merged) == {n for n, _ in plain.named_parameters()}
    plain.load_state_dict(merged, strict=False)
    ids = torch.tensor([_batch().tokens[0]])
    with torch.no_grad():
        want = tr.model(input_ids=ids).logits
        got = plain(input_ids=ids).logits
    # W + s·BA in one matmul against W·x + s·B(A·x): the same sums regrouped; 1e-4 is ~100x the
    # float32 rounding of a 64-wide dot product, and an unmerged adapter moves logits by > 1e-2
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, load_model(tiny_model_dir)(input_ids=ids).logits, atol=1e-2)
    # the torch engine takes them as any weight update (its check: same names, nothing missing)
    engine = TorchEngine(load_model(tiny_model_dir), pad_token_id=0)
    try:
        engine.update_weights(1, merged)
        assert engine.version == 1
        for n, p in engine.model.named_parameters():
            assert torch.equal(p, merged[n])
    finally:
        engine.close()


def test_checkpoint_holds_the_adapter_and_resumes_from_it(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    tr = _trainer(tiny_model_dir)
    _steps(tr)
    tr.save(tmp_path / "ckpt")
    adapter = tmp_path / "ckpt" / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    b = _batch(seed=7)
    want = tr.logprobs(b)
    # resume: a fresh trainer on the base takes the adapter and the optimizer state
    again = _trainer(tiny_model_dir, seed=1)
    again.load(tmp_path / "ckpt")
    assert again.logprobs(b) == want
    _steps(tr, 1), _steps(again, 1)
    assert _flat(again.logprobs(b)) == pytest.approx(_flat(tr.logprobs(b)), abs=1e-6)  # same state and step: measured 0
    # model/ is the merged model; adapter/ alone loads as a model directory too (merged once, cached)
    for path in (tmp_path / "ckpt", adapter):
        assert resolve_model_dir(path).is_dir()
        m = load_model(path)
        engine = TorchEngine(m, pad_token_id=0)
        engine.close()
    merged_dir = resolve_model_dir(adapter)
    assert merged_dir.is_relative_to(tmp_path / "cache") and resolve_model_dir(adapter) == merged_dir
    ids = torch.tensor([b.tokens[0]])
    with torch.no_grad():
        torch.testing.assert_close(load_model(adapter)(input_ids=ids).logits,
                                   load_model(tmp_path / "ckpt")(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_mismatched_checkpoints_and_targets_are_named(tiny_model_dir, tmp_path):
    full = Trainer(str(tiny_model_dir), TrainConfig(), AlgorithmConfig(), pad_token_id=0)
    full.save(tmp_path / "full")
    with pytest.raises(ValueError, match="no adapter"):
        _trainer(tiny_model_dir).load(tmp_path / "full")
    lora8 = _trainer(tiny_model_dir, rank=8)
    lora8.save(tmp_path / "r8")
    with pytest.raises(Exception, match="size mismatch|does not match"):
        _trainer(tiny_model_dir, rank=4).load(tmp_path / "r8")
    with pytest.raises(ValueError, match=r"train.lora.targets.*\['qkv'\]"):
        Trainer(str(tiny_model_dir), TrainConfig(lora=LoraConfig(rank=4, targets=["qkv"])), AlgorithmConfig())


# -- 2 FSDP2 ranks ----------------------------------------------------------------------------
def _fsdp_lora_trainer():
    torch.manual_seed(0)  # peft draws A at random: every rank (and the reference) the same A
    return Trainer(str(resolve_model_dir("default")), TrainConfig(micro_batch_tokens=fsdp.BUDGET, lr=1e-2,
                                                                 warmup_steps=0, lora=LoraConfig(rank=4)),
                   AlgorithmConfig(kl_coef=0.1), pad_token_id=0)


def _lora_grads(model) -> dict[str, torch.Tensor]:
    from tidal.trainer.distributed import full_tensor

    return {n: full_tensor(p.grad).clone() for n, p in model.named_parameters() if p.requires_grad}


def _lora_worker(rank, port, tmp):
    import os
    import sys

    from tidal.trainer.distributed import balanced_shards, destroy, init_distributed

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"  # ranks on loopback
    init_distributed(rank, fsdp.WORLD, "127.0.0.1", port, timeout_s=60)
    try:
        batch = fsdp._batch()
        shard = batch.select(balanced_shards(fsdp.LENGTHS, fsdp.WORLD)[rank])
        tr = _fsdp_lora_trainer()
        out = {"metrics": tr.forward_backward(shard, totals=batch.totals())}
        out["grads"] = _lora_grads(tr.model)
        out["step"] = tr.optim_step()
        out["merged"] = tr.named_weights()
        out["ref_logprobs"], out["logprobs"] = tr.ref_logprobs(shard), tr.logprobs(shard)
        tr.save(tmp / "ck2")
        if rank == 0:
            out["shard"] = shard
            torch.save(out, tmp / "lora_rank0.pt")
    finally:
        destroy()


@pytest.mark.timeout(240)
def test_lora_on_two_fsdp_ranks_matches_one_process(tmp_path):
    """Adapters on 2 sharded ranks: the same adapter gradients, reference (adapters off) and merged
    weights as one process, and a checkpoint written by the 2 ranks resumes in one."""
    import torch.multiprocessing as mp

    batch = fsdp._batch()
    one = _fsdp_lora_trainer()
    metrics = one.forward_backward(batch)
    grads = _lora_grads(one.model)
    mp.spawn(_lora_worker, args=(fsdp._free_port(), tmp_path), nprocs=fsdp.WORLD, join=True)
    got = torch.load(tmp_path / "lora_rank0.pt", weights_only=False)
    fsdp._close(got["grads"], grads, "adapter grad")
    assert any(float(g.abs().max()) > 0 for g in grads.values())
    for k in ("loss", "kl", "entropy"):  # as test_fsdp's TOL
        assert got["metrics"][k] == pytest.approx(metrics[k], rel=1e-5, abs=1e-6), k
    # the merged weights of the 2 ranks' step against one process stepping on the same (gathered)
    # gradients (why not on its own gradients: test_fsdp's _stepped); the step moved them
    for n, p in one.model.named_parameters():
        if p.requires_grad:
            p.grad = got["grads"][n].clone()
    one.optim_step()
    fsdp._close(got["merged"], one.named_weights(), "merged weight", rtol=0, atol=1e-6)
    base = load_model(resolve_model_dir("default"))
    assert any(not torch.allclose(got["merged"][n], p, atol=1e-4) for n, p in base.named_parameters())
    idx = [batch.tokens.index(t) for t in got["shard"].tokens]
    for key, fn in (("ref_logprobs", one.ref_logprobs), ("logprobs", one.logprobs)):
        want = fn(batch)
        for row, i in zip(got[key], idx):
            torch.testing.assert_close(torch.tensor(row), torch.tensor(want[i]), **fsdp.TOL)
    again = _fsdp_lora_trainer()
    again.load(tmp_path / "ck2")
    assert again.version == 1
    fsdp._close(again.named_weights(), got["merged"], "resumed from 2 ranks")
