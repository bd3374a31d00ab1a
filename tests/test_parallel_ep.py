"""Golden runs of expert parallelism (train.parallel.ep) against one process, on a tiny MoE.

The model is a tiny random Qwen3-MoE (2 layers, 8 experts, top-2, hidden 64), built and saved
here with a fixed seed. As tests/test_parallel.py does for the other dimensions, each mesh shape
runs in gloo processes on CPU over the same GRPO-shaped batch (a KL term against an
expert-parallel reference, an entropy bonus), each rank on its data shard (ep ranks are data
ranks) under the global denominators, in the padded layout, with `train.packing` and with
`train.share_prompts`; the loss, the entropy, the gradient (experts gathered over ep), its norm
and the weights after one optimizer step must equal one process's on the whole batch, where HF's
own experts module runs. A run whose combine puts the experts' outputs back on the wrong rows
must not match (the positive control; tests/test_expert_parallel.py checks the exchange alone).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp
from test_parallel import ALGO, BUDGET, LAYOUTS, _batch, _free_port, _run, _update_gap

from tidal.config import AlgorithmConfig, ParallelConfig, TrainConfig
from tidal.trainer.distributed import balanced_shards
from tidal.trainer.trainer import Trainer


def build_tiny_moe(path, vocab_size: int = 256, **ids) -> None:
    """A tiny random Qwen3-MoE saved at `path`: 2 layers, 8 experts, top-2, hidden 64 (~160k
    parameters). The router's weights are drawn wider than HF's default (std 0.5, not 0.02) so
    that top-k choices are decided by margins far above float noise: the parallel runs sum in
    another order, and a near-tie could otherwise flip an expert between runs. `ids`: special
    token ids for the config (pad_token_id, eos_token_id) when a tokenizer goes with it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                         tie_word_embeddings=False, **ids)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)


def _trainer(model_dir, layout: str, parallel: dict | None = None) -> Trainer:
    train = TrainConfig(micro_batch_tokens=BUDGET, warmup_steps=0, parallel=ParallelConfig(**(parallel or {})),
                        logprob_chunk_tokens=16, **LAYOUTS[layout])
    return Trainer(str(model_dir), train, AlgorithmConfig(**ALGO), pad_token_id=0)


def _wrong_combine(y, r, hidden_states, top_k_weights, group):
    """The combine without undoing the regrouping by local expert: outputs go back to the wrong rows."""
    from tidal.trainer.parallel import expert

    y = expert.all_to_all(y, r.send, r.recv, group)
    y = y * top_k_weights.reshape(-1)[r.order, None]
    return torch.zeros_like(hidden_states).index_add(0, r.token, y)


def _worker(rank, world, port, tmp, model_dir, parallel, layouts, mutant):
    from tidal.trainer.distributed import destroy, init_distributed
    from tidal.trainer.parallel import expert

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"
    init_distributed(rank, world, "127.0.0.1", port, timeout_s=120)
    try:
        batch = _batch()
        out = {}
        for layout in (*layouts, *(["mutant"] if mutant else [])):
            if layout == "mutant":
                original, expert.combine = expert.combine, _wrong_combine
            try:
                tr = _trainer(model_dir, "plain" if layout == "mutant" else layout, parallel)
                assert isinstance(tr.model.model.layers[0].mlp.experts, expert.ExpertParallel)
                shard = balanced_shards([len(t) for t in batch.tokens], tr.dims.dp_size)[tr.dims.dp_index(rank)]
                out[layout] = _run(tr, batch, shard)
            finally:
                if layout == "mutant":
                    expert.combine = original
        if rank == 0:
            torch.save(out, tmp / "rank0.pt")
    finally:
        destroy()


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-moe")
    build_tiny_moe(path)
    return path


@pytest.fixture(scope="module")
def reference(tiny_moe):
    """One process, the whole batch, each layout (HF's experts module)."""
    out = {}
    for layout in LAYOUTS:
        torch.manual_seed(0)
        out[layout] = _run(_trainer(tiny_moe, layout), _batch(), list(range(len(_batch()))))
    return out


# shape: (train.parallel, layouts, whether its run also checks the broken combine)
SHAPES = {
    "ep2": ({"ep": 2}, tuple(LAYOUTS), True),
    "dp_shard2_ep2": ({"dp_shard": 2, "ep": 2}, tuple(LAYOUTS), False),
    "dp_replicate2_ep2": ({"dp_replicate": 2, "ep": 2}, ("plain",), False),  # HSDP x EP: the experts' 3-D mesh
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_expert_parallel_matches_one_process(shape, tiny_moe, reference, tmp_path):
    parallel, layouts, mutant = SHAPES[shape]
    world = ParallelConfig(**parallel).fixed
    mp.spawn(_worker, args=(world, _free_port(), tmp_path, tiny_moe, parallel, layouts, mutant), nprocs=world,
             join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    start = {n: w.detach().clone() for n, w in _trainer(tiny_moe, "plain").model.named_parameters()}
    for layout in layouts:
        g, ref = got[layout], reference[layout]
        worst = max(float((g["grads"][n] - w).abs().max()) for n, w in ref["grads"].items())
        print(f"{shape} {layout}: loss {abs(g['loss'] / ref['loss'] - 1):.1e} grad_norm "
              f"{abs(g['grad_norm'] / ref['grad_norm'] - 1):.1e} (relative), grads {worst:.1e} (absolute), update gap "
              f"{_update_gap(g['weights'], ref['weights'], start):.1e}")  # the margins the comments quote (-s)
        # As tests/test_parallel.py: the same sums in another order (sharded micro-batches, FSDP's
        # reduce-scatters, each expert's tokens gathered from both ep ranks and summed back per token).
        # Measured (printed with -s) over both shapes and three layouts: losses within 7.7e-7 and grad
        # norms (~1.9) within 1.9e-7 relative, gradient entries within 5.2e-8 absolute: 13x, 50x and
        # 20x under these bounds, the ones every other dimension meets. The wrong combine moves a
        # gradient by 3x its largest entry (below).
        assert g["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6), layout
        assert g["entropy"] == pytest.approx(ref["entropy"], rel=1e-5), layout
        assert g["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), layout
        assert g["grads"].keys() == ref["grads"].keys()
        for n, w in ref["grads"].items():
            torch.testing.assert_close(g["grads"][n], w, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=n, lo=layout: f"{lo} grad {n}: {m}")
        # Adam turns summation-order noise where |g| ~ eps into update changes of up to 2·lr: compare the
        # whole update in norm, as tests/test_parallel.py does (a skipped or doubled step gives >= 0.3);
        # measured <= 3.0e-5.
        assert _update_gap(g["weights"], ref["weights"], start) < 3e-2, layout
    if mutant:  # the positive control: outputs combined onto the wrong rows are far off
        m, ref = got["mutant"], reference["plain"]
        worst = max(float((m["grads"][n] - w).abs().max() / (w.abs().max() + 1e-12)) for n, w in ref["grads"].items())
        norm = abs(m["grad_norm"] / ref["grad_norm"] - 1)
        print(f"{shape} wrong combine: grad_norm {norm:.1e} (relative), worst gradient {worst:.1e} of its largest entry")
        # (the loss cannot show it: at the start of a step the policy ratio is 1 and the loss's value is
        # the advantages' mean whatever the log-probs.) 100x and 1000x the allowances above.
        assert norm > 1e-3 and worst > 1e-2, (norm, worst)


def _resume_worker(rank, port, tmp, model_dir):
    from test_parallel_resume import _step

    from tidal.trainer.distributed import barrier, destroy, init_distributed

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"
    init_distributed(rank, 2, "127.0.0.1", port, timeout_s=120)
    try:
        batch = _batch()
        ep = _trainer(model_dir, "packing", {"ep": 2})
        _step(ep, batch, rank)
        ep.save(tmp / "ck")
        saved = ep.named_weights()
        _step(ep, batch, rank)  # uninterrupted
        went_on = ep.named_weights()
        barrier()
        fsdp = _trainer(model_dir, "packing", {"dp_shard": 2})  # another mesh of 2: no ep
        fsdp.load(tmp / "ck")
        assert fsdp.version == 1
        _step(fsdp, batch, rank)
        resumed = fsdp.named_weights()  # a collective
        # ... and back: the dp_shard 2 run's checkpoint (FSDP shards only) resumes at ep 2
        fsdp.save(tmp / "ck_dp")
        _step(fsdp, batch, rank)
        fsdp_next = fsdp.named_weights()
        back = _trainer(model_dir, "packing", {"ep": 2})
        back.load(tmp / "ck_dp")
        assert back.version == 2
        loaded = back.named_weights()
        _step(back, batch, rank)
        back_next = back.named_weights()
        if rank == 0:
            torch.save({"saved": saved, "went_on": went_on, "dp_shard": resumed, "loaded_at_ep2": loaded,
                        "fsdp_next": fsdp_next, "ep2_next": back_next}, tmp / "rank0.pt")
    finally:
        destroy()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_across_ep_meshes_and_in_one_process(tiny_moe, tmp_path):
    """A checkpoint saved at ep 2 (each rank its shards, the experts split over ep) resumes at
    dp_shard 2 and in one process; the next step matches the run that went on at ep 2. The HF
    `model/` directory the engines and `tidal eval` read holds the whole experts. And back: a
    dp_shard 2 checkpoint resumes at ep 2, its next step matching dp_shard 2's."""
    from test_parallel_resume import _step

    from tidal.models import load_model

    mp.spawn(_resume_worker, args=(_free_port(), tmp_path, tiny_moe), nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert sorted(p.name for p in (tmp_path / "ck" / "shards").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    hf = dict(load_model(tmp_path / "ck" / "model").named_parameters())
    for n, w in got["saved"].items():  # whole tensors, bit for bit: gathered, not recomputed
        assert torch.equal(hf[n], w), n
    assert got["saved"]["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8  # every expert, not one rank's
    one = _trainer(tiny_moe, "packing")
    one.load(tmp_path / "ck")
    start = {n: w.clone() for n, w in one.named_weights().items()}
    for n, w in start.items():
        assert torch.equal(w, got["saved"][n]), n
    _step(one, _batch())
    went_on = got["went_on"]
    step = sum(float((went_on[n] - start[n]).double().square().sum()) for n in start) ** 0.5
    assert step > 0
    for n, w in got["dp_shard"].items():  # the dp_shard checkpoint read into ep shards: bit for bit
        assert torch.equal(got["loaded_at_ep2"][n], w), n
    back = sum(float((got["ep2_next"][n] - got["fsdp_next"][n]).double().square().sum()) for n in start) ** 0.5
    back_step = sum(float((got["fsdp_next"][n] - got["dp_shard"][n]).double().square().sum()) for n in start) ** 0.5
    print(f"dp_shard 2 -> ep 2: |Δ − Δ_ref| / |Δ_ref| = {back / back_step:.1e}")
    assert back / back_step < 1e-2  # the optimizer state came along (as below)
    for name, weights in (("dp_shard 2", got["dp_shard"]), ("one process", one.named_weights())):
        # As tests/test_parallel_resume.py: the second step's update in norm, |Δ − Δ_ref| / |Δ_ref|
        # (Adam amplifies float noise where its moments are ~eps); a resume without the optimizer
        # state or with a wrong step count gives >= 0.3 (tests/test_fsdp.py).
        gap = sum(float((weights[n] - went_on[n]).double().square().sum()) for n in start) ** 0.5
        print(f"resumed at {name}: |Δ − Δ_ref| / |Δ_ref| = {gap / step:.1e}")
        assert gap / step < 1e-2, f"{name}: {gap / step:.2e}"
