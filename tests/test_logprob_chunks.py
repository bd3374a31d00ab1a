"""The chunked output head (tidal/trainer/parallel/logprob.py) equals the full-logits path:
log-probs, entropy and their gradients into the hidden states and the head's weight, at any
chunk size, with a temperature and banned vocabulary entries. In float64, where the only
difference is the order of float32 sums inside each chunk's softmax."""

from __future__ import annotations

import pytest
import torch

from tidal.algorithms import entropy_from_logits, token_logprobs
from tidal.trainer.parallel.logprob import head_logprobs


def _problem(n=37, h=16, v=50):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    return hidden, weight, torch.randint(0, v, (n,), generator=g), torch.randn(2, n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_equals_full_logits(chunk, temperature):
    hidden, weight, targets, (a, b) = _problem()
    banned = torch.tensor([3, 7])
    logp, ent = head_logprobs(hidden, weight, targets, temperature, chunk=chunk, banned=banned)
    logits = (hidden @ weight.t()).index_fill(-1, banned, -1e9)
    want_logp, want_ent = token_logprobs(logits, targets, temperature), entropy_from_logits(logits, temperature)
    # the head computes its softmax in float32 (as token_logprobs does): float32 rounding of
    # values ~|10|, measured ≤ 2e-6 absolute; a wrong chunk boundary or a dropped term is off by ≥ 0.1
    torch.testing.assert_close(logp.double(), want_logp.double(), rtol=0, atol=1e-4)
    torch.testing.assert_close(ent.double(), want_ent.double(), rtol=0, atol=1e-4)
    got = torch.autograd.grad((logp * a).sum() + (ent * b).sum(), [hidden, weight])
    want = torch.autograd.grad((want_logp * a).sum() + (want_ent * b).sum(), [hidden, weight])
    for g, w in zip(got, want):  # measured ≤ 6e-5 on gradients up to ~20 (float32 softmax)
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-3)
    assert float(got[1][banned].abs().max()) == 0.0  # a pinned logit gets no gradient


def test_entropy_gradient_is_optional():
    """A detached entropy (no entropy in the loss) leaves the log-prob gradient alone."""
    hidden, weight, targets, (a, _) = _problem()
    logp, ent = head_logprobs(hidden, weight, targets, chunk=8)
    got = torch.autograd.grad((logp * a).sum() + 0 * ent.detach().sum(), [hidden])[0]
    want = torch.autograd.grad((token_logprobs(hidden @ weight.t(), targets) * a).sum(), [hidden])[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chunked_head_peak_memory_on_a_gpu():
    """At Qwen's 151,936-token vocabulary and 8192 tokens the full-logits path holds several
    tokens x vocabulary float32 tensors (4.6 GiB each); the chunked head holds two chunk x
    vocabulary ones. Its peak is bounded by the chunk, and it gives the same log-probs."""
    n, h, v = 8192, 1024, 151_936
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g, requires_grad=True)
    weight = (0.02 * torch.randn(v, h, device="cuda", generator=g)).requires_grad_(True)
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)

    def peak(fn) -> tuple[float, torch.Tensor]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        logp, ent = fn()
        (logp.sum() + 0.01 * ent.sum()).backward()
        torch.cuda.synchronize()
        hidden.grad = weight.grad = None
        return (torch.cuda.max_memory_allocated() - base) / 2**30, logp.detach()

    def full():
        logits = hidden @ weight.t()
        return token_logprobs(logits, targets), entropy_from_logits(logits)

    full_gib, want = peak(full)
    chunk_gib, got = peak(lambda: head_logprobs(hidden, weight, targets, chunk=512))
    logits_gib = n * v * 4 / 2**30
    # two [512, V] float32 tensors (0.3 GiB each) plus the weight's float32 gradient (0.6 GiB) and
    # its accumulator: well under one [N, V] tensor, where the full path holds several
    assert chunk_gib < logits_gib < full_gib / 2, (chunk_gib, logits_gib, full_gib)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)  # float32, TF32 matmuls may differ slightly
