"""Expert parallelism's dispatch and combine (tidal/trainer/parallel/expert.py) against HF's dense
experts module in one process, over 2 gloo ranks.

Each rank holds its own tokens (7 and 4: uneven) and routes them as given; the expert-parallel
module's output, the gradients of the hidden states and of the routing weights on each rank,
and the experts' weight gradients (whole, gathered over ep) must equal those of HF's
`Qwen3MoeExperts` run on all the tokens at once. Routings: random (uneven splits in both
directions), every token to rank 0's experts (rank 1 receives nothing; its experts' gradients
are zeros), and rank 1 with no tokens at all. A combine that forgets to undo the regrouping by
expert must NOT match (the positive control).
"""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

E, K, H = 8, 2, 16
TOKENS = (7, 4)


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Held(nn.Module):
    """What the expert-parallel module takes from HF's experts module, in plain torch, so the gloo
    processes need not import transformers (seconds each): the parent's dense module's weights."""

    def __init__(self, state: dict):
        super().__init__()
        self.num_experts, self.act_fn = E, F.silu  # Qwen3-MoE's hidden_act
        self.gate_up_proj, self.down_proj = (nn.Parameter(state[n].clone()) for n in ("gate_up_proj", "down_proj"))


def _experts():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    m = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=8, num_experts=E, num_experts_per_tok=K))
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.5)
        m.down_proj.normal_(0, 0.5)
    return m


def _inputs(case: str, tokens=TOKENS):
    """Per rank: hidden states [T, H], top-k expert ids [T, K], routing weights [T, K], and the
    output's cotangent [T, H]."""
    g = torch.Generator().manual_seed(1)
    out = []
    for r, t in enumerate(tokens):
        if case == "empty_rank" and r == 1:
            t = 0
        x = torch.randn(t, H, generator=g)
        if case == "to_rank0":  # experts 0-3 live on rank 0
            idx = torch.stack([torch.randperm(E // 2, generator=g)[:K] for _ in range(t)]) if t else torch.zeros(0, K)
        else:
            idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.zeros(0, K)
        w = torch.rand(t, K, generator=g)
        out.append((x, idx.long(), w, torch.randn(t, H, generator=g)))
    return out


CASES = ("random", "to_rank0", "empty_rank")


def _grads(module, x, idx, w, cot):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = module(x, idx, w)
    (y * cot).sum().backward()
    return y.detach(), x.grad, w.grad


def _wrong_combine(y, r, hidden_states, top_k_weights, group):
    """The combine without undoing the regrouping by local expert: outputs go back to the wrong rows."""
    from tidal.trainer.parallel import expert

    y = expert.all_to_all(y, r.send, r.recv, group)
    y = y * top_k_weights.reshape(-1)[r.order, None]
    return torch.zeros_like(hidden_states).index_add(0, r.token, y)


def _worker(rank, port, tmp, state):
    from torch.distributed.device_mesh import init_device_mesh

    from tidal.trainer.distributed import destroy, full_tensor, init_distributed
    from tidal.trainer.parallel import expert

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"
    init_distributed(rank, 2, "127.0.0.1", port, timeout_s=120)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        out = {}
        for case in (*CASES, "mutant"):
            if case == "mutant":
                original, expert.combine = expert.combine, _wrong_combine
            try:
                ep = expert.ExpertParallel(_Held(state), mesh)
                y, gx, gw = _grads(ep, *_inputs("random" if case == "mutant" else case)[rank])
            finally:
                if case == "mutant":
                    expert.combine = original
            out[case] = {"y": y, "gx": gx, "gw": gw,
                         "weights": {n: full_tensor(p.grad) for n, p in ep.named_parameters()}}
        torch.save(out, tmp / f"rank{rank}.pt")
    finally:
        destroy()


@pytest.mark.slow  # 22-34 s on this shared machine: transformers' Qwen3-MoE import, 2 spawns, DTensor's first use
@pytest.mark.timeout(300)
def test_dispatch_and_combine_match_the_dense_experts(tmp_path):
    dense = _experts()
    assert dense.act_fn(torch.tensor(1.0)) == F.silu(torch.tensor(1.0))  # what _Held stands in for
    mp.spawn(_worker, args=(_free_port(), tmp_path, {n: p.detach() for n, p in dense.named_parameters()}),
             nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for case in (*CASES, "mutant"):
        parts = _inputs("random" if case == "mutant" else case)
        dense = _experts()
        x, idx, w, cot = (torch.cat(t) for t in zip(*parts))
        y, gx, gw = _grads(dense, x, idx, w, cot)
        ref = {n: p.grad for n, p in dense.named_parameters()}
        bounds = [0, len(parts[0][0]), len(x)]
        # The same products and sums, the per-token sums in another order (index_add over received
        # rows): float32 rounding only, ~1e-6 on values of ~10.
        tol = {"rtol": 1e-5, "atol": 1e-5}
        if case == "mutant":
            wrong = max(float((got[r][case]["y"] - y[bounds[r]:bounds[r + 1]]).abs().max()) for r in range(2))
            assert wrong > 0.1, wrong  # outputs landed on other tokens: far off
            continue
        for r in range(2):
            s = slice(bounds[r], bounds[r + 1])
            torch.testing.assert_close(got[r][case]["y"], y[s], **tol, msg=lambda m, c=case, r=r: f"{c} rank {r} y: {m}")
            torch.testing.assert_close(got[r][case]["gx"], gx[s], **tol)
            torch.testing.assert_close(got[r][case]["gw"], gw[s], **tol)
            for n, g in ref.items():  # every rank gathers the whole gradient
                torch.testing.assert_close(got[r][case]["weights"][n], g, **tol, msg=lambda m, n=n, c=case: f"{c} {n}: {m}")
        if case == "to_rank0":  # rank 1's experts received nothing: zero gradients, present all the same
            assert float(ref["down_proj"][E // 2:].abs().max()) == 0.0
            assert float(ref["down_proj"][:E // 2].abs().max()) > 0.0


def test_models_expert_parallelism_cannot_split_are_refused_by_name():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tidal.config import TrainConfig, load_config
    from tidal.models import load_model
    from tidal.trainer.parallel.expert import check_ep

    with pytest.raises(ValueError, match=r"ep=2: the default model \(Qwen2ForCausalLM\) has no mixture-of-experts"):
        check_ep(load_model("default"), 2, "the default model")
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                             head_dim=8, num_experts=8, num_experts_per_tok=2))
    assert [attr for _, attr, _ in check_ep(moe, 4)] == ["experts", "experts"]  # one per MoE layer
    with pytest.raises(ValueError, match=r"ep=3 does not divide the model's num_experts=8"):
        check_ep(moe, 3)
    with pytest.raises(ValueError, match=r"ep=2 with train.lora"):
        TrainConfig(parallel={"ep": 2}, lora={"rank": 4})
    with pytest.raises(ValueError, match=r"ep=2 with tp=2"):  # in the whole config, before anything loads
        load_config(None, ["placement.mode=ray", "placement.trainer_ranks=4", "train.parallel.ep=2",
                           "train.parallel.tp=2"])
