"""Tensor parallelism (tp 2, gloo) on the other families tidal's plan covers, each against one
process on the same batch: a tiny Qwen3 (per-head q/k norms, whose weight's gradient is summed
over the tp group; an untied output head) and a tiny Llama (no q/k/v biases). Both are built
here with random weights (transformers' own classes), so what is compared is the plan, not a
checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from test_parallel import TOL, _batch, _free_port, _run

from tidal.config import AlgorithmConfig, ParallelConfig, TrainConfig
from tidal.trainer.trainer import Trainer


def _build(kind: str, out) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=294, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
        with torch.no_grad():  # the norms start at 1: make their weights (and so a lost reduction) matter
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(out / kind)
    return str(out / kind)


def _trainer(path: str, parallel: dict | None = None) -> Trainer:
    train = TrainConfig(micro_batch_tokens=40, warmup_steps=0, parallel=ParallelConfig(**(parallel or {})))
    return Trainer(path, train, AlgorithmConfig(entropy_coef=0.01), pad_token_id=0)


def _worker(rank, port, tmp, paths):
    import os
    import sys

    from tidal.trainer.distributed import destroy, init_distributed

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"
    init_distributed(rank, 2, "127.0.0.1", port, timeout_s=120)
    try:
        batch = _batch()
        out = {kind: _run(_trainer(p, {"tp": 2}), batch, list(range(len(batch)))) for kind, p in paths.items()}
        if rank == 0:
            torch.save(out, tmp / "rank0.pt")
    finally:
        destroy()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_qwen3_and_llama_under_tensor_parallelism_match_one_process(tmp_path):
    paths = {kind: _build(kind, tmp_path) for kind in ("qwen3", "llama")}
    mp.spawn(_worker, args=(_free_port(), tmp_path, paths), nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    for kind, path in paths.items():
        ref = _run(_trainer(path), _batch(), list(range(len(_batch()))))
        g = got[kind]
        assert g["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6), kind
        assert g["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), kind
        for n, w in ref["grads"].items():  # tolerance: as tests/test_parallel.py's golden runs
            torch.testing.assert_close(g["grads"][n], w, **TOL, msg=lambda m, n=n, k=kind: f"{k} grad {n}: {m}")
        if kind == "qwen3":
            assert float(ref["grads"]["model.layers.0.self_attn.q_norm.weight"].abs().max()) > 1e-4
