"""Per-request seeded sampling: noise, greedy, top-k/top-p and the returned log-prob."""

import math

import torch
from torch.testing import assert_close

from tidal.engines.sampling import _uniform_noise_numpy, _uniform_noise_torch, mask_top_k_top_p, sample, uniform_noise


def _sample(logits, temperature=1.0, top_k=0, top_p=1.0, seeds=None, positions=None):
    B = logits.shape[0]
    return sample(
        logits,
        torch.full((B,), float(temperature)),
        torch.full((B,), top_k, dtype=torch.long),
        torch.full((B,), float(top_p)),
        torch.arange(B) if seeds is None else seeds,
        torch.zeros(B, dtype=torch.long) if positions is None else positions,
    )


# ---------------------------------------------------------------- uniform_noise


def test_noise_in_open_unit_interval():
    u = uniform_noise(torch.arange(256), torch.arange(256), 4096)
    assert u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01  # std of the mean of 2^20 uniforms is 2.8e-4: 0.01 is ~35σ
    # seed 335, position 0, token 6981 hit the top value, which used to round to exactly 1.0
    assert uniform_noise(torch.tensor([335]), torch.tensor([0]), 8000).max() < 1.0


def test_noise_depends_only_on_seed_position_token():
    seeds, positions = torch.tensor([5, 6, 7, 5]), torch.tensor([0, 3, 9, 4])
    batch = uniform_noise(seeds, positions, 64)
    for i in range(4):
        alone = uniform_noise(seeds[i : i + 1], positions[i : i + 1], 64)
        assert torch.equal(alone[0], batch[i])
    shuffled = uniform_noise(seeds.flip(0), positions.flip(0), 64)
    assert torch.equal(shuffled.flip(0), batch)
    # a smaller vocab sees the same noise for the tokens it has
    assert torch.equal(uniform_noise(seeds, positions, 10), batch[:, :10])
    # same seed, other position differs
    assert not torch.equal(batch[0], batch[3])


def test_cpu_noise_is_the_torch_hash_bit_for_bit():
    # On CPU the noise is computed on numpy's uint64; it must be the same bits as the torch
    # version (which a GPU runs): the same requests sample the same tokens on either device.
    g = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.randint(-2**62, 2**62, (40,), generator=g), torch.tensor([0, -1, 2**63 - 1, -2**63])])
    positions = torch.randint(0, 2**31, (44,), generator=g)
    for vocab in (1, 294, 5000):
        assert torch.equal(_uniform_noise_numpy(seeds, positions, vocab), _uniform_noise_torch(seeds, positions, vocab))
    assert torch.equal(uniform_noise(seeds, positions, 7), _uniform_noise_torch(seeds, positions, 7))


def test_different_seeds_differ():
    u = uniform_noise(torch.arange(50), torch.zeros(50, dtype=torch.long), 32)
    assert len({tuple(row.tolist()) for row in u}) == 50


# ---------------------------------------------------------------- sample


def _logits(B=16, V=50, seed=0):
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 2


def test_temperature_zero_is_argmax():
    logits = _logits()
    tokens, logp = _sample(logits, temperature=0.0)
    assert torch.equal(tokens, logits.argmax(-1))
    assert_close(logp, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1))


def test_top_k_one_is_argmax_whatever_the_seed():
    logits = _logits(B=64)
    for seed in range(5):
        tokens, _ = _sample(logits, temperature=1.5, top_k=1, seeds=torch.arange(64) + 1000 * seed)
        assert torch.equal(tokens, logits.argmax(-1))
    # the noise row of seed 335 whose top value used to be 1.0 (Gumbel +inf beat the mask)
    spiky = torch.zeros(1, 8000)
    spiky[0, 0] = 10.0
    tokens, _ = _sample(spiky, top_k=1, seeds=torch.tensor([335]))
    assert tokens.item() == 0


def test_logprob_is_of_temperature_scaled_distribution():
    logits = _logits(B=32)
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 0, 1.0), (2.0, 5, 1.0), (1.3, 0, 0.8)]:
        tokens, logp = _sample(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        expected = (logits / temperature).log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
        assert_close(logp, expected)


def test_sampling_frequencies_match_probabilities():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    B = 20_000
    tokens, _ = _sample(probs.log().expand(B, 4).contiguous(), seeds=torch.arange(B))
    freqs = torch.bincount(tokens, minlength=4).float() / B
    assert_close(freqs, probs, atol=0.02, rtol=0)  # binomial std ≤ sqrt(.4·.6/20000) = 0.0035: 0.02 is ~5.8σ


def test_sampling_with_temperature_matches_scaled_probabilities():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    B = 20_000
    tokens, _ = _sample(probs.log().expand(B, 4).contiguous(), temperature=0.5, seeds=torch.arange(B) + 7)
    target = probs**2 / (probs**2).sum()  # T=.5 squares the probabilities: .0333, .1333, .3, .5333
    # binomial std ≤ sqrt(.25/20000) = 0.0035: 0.02 is ~5.7σ
    assert_close(torch.bincount(tokens, minlength=4).float() / B, target, atol=0.02, rtol=0)


def test_top_p_half_only_picks_the_top_token():
    B = 2000
    logits = torch.tensor([0.6, 0.3, 0.1]).log().expand(B, 3).contiguous()
    tokens, logp = _sample(logits, top_p=0.5, seeds=torch.arange(B))
    assert (tokens == 0).all()
    assert_close(logp, torch.full((B,), math.log(0.6)))


def test_request_samples_the_same_alone_or_in_a_batch():
    logits = _logits(B=8, V=200) * 4
    temps = torch.tensor([1.0, 0.0, 0.7, 1.0, 2.0, 1.0, 0.5, 1.0])
    top_k = torch.tensor([0, 0, 5, 0, 0, 3, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 1.0, 0.6, 1.0])
    seeds, positions = torch.arange(8) * 11, torch.arange(8) * 3
    batch = sample(logits, temps, top_k, top_p, seeds, positions)
    for i in range(8):
        s = slice(i, i + 1)
        alone = sample(logits[s], temps[s], top_k[s], top_p[s], seeds[s], positions[s])
        assert alone[0].item() == batch[0][i].item()
        assert_close(alone[1], batch[1][s])


# ---------------------------------------------------------------- mask_top_k_top_p


def test_mask_keeps_exactly_k_largest():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))
    ks = torch.tensor([1, 3, 5, 10])
    masked = mask_top_k_top_p(logits, ks, torch.ones(4))
    for row, k in enumerate(ks.tolist()):
        kept = torch.isfinite(masked[row])
        assert kept.sum().item() == k
        assert set(kept.nonzero().flatten().tolist()) == set(logits[row].topk(k).indices.tolist())
        assert_close(masked[row][kept], logits[row][kept])


def test_mask_off_rows_keep_everything_next_to_masked_rows():
    # a very peaked row: float cumsum reaches 1.0 long before its tail
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(2)) * 8
    masked = mask_top_k_top_p(logits, torch.tensor([0, 2, 0]), torch.tensor([1.0, 1.0, 0.9]))
    assert torch.equal(masked[0], logits[0])
    assert torch.isfinite(masked[1]).sum().item() == 2
    assert torch.isfinite(masked[2]).sum().item() >= 1


def test_the_engine_benchmark_runs_with_tidals_openmp_defaults():
    # libgomp reads OMP_WAIT_POLICY once, when torch loads it: benchmarks/engines.py must import
    # tidal (which sets it) before torch. An import sorter once put torch first, silently.
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = "import sys, os; sys.path.insert(0, 'benchmarks'); import engines; print(os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "ACTIVE"
