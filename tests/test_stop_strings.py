"""Stop strings in the torch engine (docs/engines.md, stop strings): generation ends with the
token that completes a stop string in the generated text, that token is kept, the finish
reason is "stop"; a stop string in the prompt ends nothing. The reference is a whole-text
search: the first k at which decode(generated[:k]) contains a stop string."""

from __future__ import annotations

import random

import pytest
from engine_checks import first_stop_end

from tidal.config import EngineConfig
from tidal.engines.factory import build_engine
from tidal.engines.stop_strings import StopStringMatcher
from tidal.engines.torch_engine import TorchEngine
from tidal.models import load_model
from tidal.types import GenerationRequest, SamplingParams

HOT = 1.5  # the random tiny model at a high temperature: varied text, many different substrings


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tokenizer):
    return TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id, tokenizer=tokenizer)


def _prompt(tokenizer, text: str) -> list[int]:
    return tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=False), add_special_tokens=False)["input_ids"]


def _free_runs(engine, tokenizer, n: int, max_new_tokens: int = 40):
    reqs = [GenerationRequest(f"f{i}", _prompt(tokenizer, f"Say something, {i}."),
                              SamplingParams(max_new_tokens=max_new_tokens, temperature=HOT, seed=500 + i))
            for i in range(n)]
    return reqs, engine.generate_sync(reqs)


def _with_stop(req: GenerationRequest, stop: tuple[str, ...]) -> GenerationRequest:
    p = req.params
    return GenerationRequest(req.request_id, req.prompt_ids, SamplingParams(
        max_new_tokens=p.max_new_tokens, temperature=p.temperature, seed=p.seed, stop=stop))


def test_generation_ends_at_the_first_completion_and_keeps_the_token(engine, tokenizer):
    """Each request's stop string is a 3-character piece from the middle of its own free text
    (it spans several tokens of this tokenizer); with it, the request is its free run cut
    right after the token that first completes the string — not earlier, not later."""
    reqs, free = _free_runs(engine, tokenizer, 12)
    stopped_reqs, cuts = [], []
    for req, res in zip(reqs, free):
        text = tokenizer.decode(res.token_ids, skip_special_tokens=True)
        piece = text[len(text) // 2: len(text) // 2 + 3]
        assert len(piece) == 3, text
        stopped_reqs.append(_with_stop(req, (piece,)))
        cuts.append(first_stop_end(tokenizer, res.token_ids, (piece,)))
    got = engine.generate_sync(stopped_reqs)
    for req, res, g, k in zip(stopped_reqs, free, got, cuts):
        assert k is not None  # the piece is in the free text
        assert g.token_ids == res.token_ids[:k], (req.params.stop, g.token_ids, res.token_ids)
        assert g.finish_reason == "stop"
        assert len(g.logprobs) == len(g.token_ids) == len(g.token_versions)
        # not bit-equal: rows that stop leave the batch, so the others run at other matmul shapes; measured
        # ≤ 9.5e-7 (1-2 ulps of |log p| ~ 5; 10% of the 1e-5 once used). 1e-4 leaves 100x for other CPUs'
        # kernels; a log-prob from the wrong position or weights is off by 0.1 and more.
        assert g.logprobs == pytest.approx(res.logprobs[:k], abs=1e-4)
        before = tokenizer.decode(g.token_ids[:-1], skip_special_tokens=True)
        assert not any(s in before for s in req.params.stop)  # not earlier
    assert sum(k < len(r.token_ids) for k, r in zip(cuts, free)) >= len(free) // 2  # most really stopped early


def test_stop_string_in_the_prompt_or_across_its_end_ends_nothing(engine, tokenizer):
    """Only generated text counts: a stop string the prompt contains, or one that begins in
    the prompt and is finished by the first generated token, does not stop the request."""
    reqs, free = _free_runs(engine, tokenizer, 6, max_new_tokens=24)
    checked = 0
    for req, res in zip(reqs, free):
        gen = tokenizer.decode(res.token_ids, skip_special_tokens=True)
        prompt_text = tokenizer.decode(req.prompt_ids, skip_special_tokens=True)
        across = prompt_text[-2:] + gen[:1]  # ends in the first generated token's text
        in_prompt = "Say something"
        stop = (across, in_prompt)
        want = first_stop_end(tokenizer, res.token_ids, stop)
        got = engine.generate_sync([_with_stop(req, stop)])[0]
        if want is None:
            assert got.token_ids == res.token_ids and got.finish_reason == "length"
            checked += 1
        else:  # the string also occurs inside the generation: it stops there, not at token 1
            assert got.token_ids == res.token_ids[:want] and want > 1
    assert checked >= 3


def test_requests_with_and_without_stop_strings_share_a_batch(engine, tokenizer):
    reqs, free = _free_runs(engine, tokenizer, 8)
    texts = [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in free]
    mixed = [_with_stop(r, (t[10:12], "no such text")) if i % 2 else r for i, (r, t) in enumerate(zip(reqs, texts))]
    together = engine.generate_sync(mixed)
    for r, g in zip(mixed, together):
        alone = engine.generate_sync([r])[0]
        assert g.token_ids == alone.token_ids and g.finish_reason == alone.finish_reason
    assert [g.finish_reason for g in together[::2]] == ["length"] * 4
    assert all(g.finish_reason == "stop" for g in together[1::2])


def test_stop_token_and_stop_string_both_end_it(engine, tokenizer):
    reqs, free = _free_runs(engine, tokenizer, 1, max_new_tokens=30)
    toks = free[0].token_ids
    text = tokenizer.decode(toks, skip_special_tokens=True)
    late = text[-3:]
    params = SamplingParams(max_new_tokens=30, temperature=HOT, seed=reqs[0].params.seed,
                            stop_token_ids=(toks[5],), stop=(late,))
    got = engine.generate_sync([GenerationRequest("x", reqs[0].prompt_ids, params)])[0]
    first = min(toks.index(toks[5]) + 1, first_stop_end(tokenizer, toks, (late,)))
    assert got.token_ids == toks[:first] and got.finish_reason == "stop"


def test_matcher_agrees_with_whole_text_search_and_decodes_little(tokenizer):
    """Random token sequences (byte-level pieces, special tokens, cut UTF-8 characters) and
    stop strings of several shapes, incl. ones the pre-check cannot use (ending in a space,
    non-ASCII): the windowed matcher finds the same first completion as a whole-text search."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    matcher = StopStringMatcher(tokenizer)
    steps = 0
    for trial in range(60):
        seq = [rng.randrange(vocab) for _ in range(60)]
        text = tokenizer.decode(seq, skip_special_tokens=True)
        a = rng.randrange(max(1, len(text) - 6))
        stop = (text[a: a + rng.choice([1, 2, 4, 6])], "zz" + "é", "q ")[: 1 + trial % 3]
        stop = tuple(s for s in stop if s)
        want = first_stop_end(tokenizer, seq, stop)
        got = None
        for k in range(1, len(seq) + 1):
            steps += 1
            if matcher.completes(seq[:k], stop):
                got = k
                break
        assert got == want, (stop, seq)
    assert matcher.windows < steps  # the pre-check answered some steps without a decode


def test_stop_strings_without_a_tokenizer_are_a_clear_error(tiny_model_dir, tokenizer, engine):
    bare = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    req = GenerationRequest("needs-text", [5, 6, 7], SamplingParams(max_new_tokens=4, stop=("</tool_call>",)))
    with pytest.raises(ValueError, match=r"request needs-text has stop strings .*no tokenizer.*tokenizer="):
        bare.generate_sync([req])
    with pytest.raises(ValueError, match="request e: stop strings must be non-empty"):
        engine.generate_sync([GenerationRequest("e", [5, 6], SamplingParams(stop=("",)))])
    with pytest.raises(TypeError, match="must be a tuple of strings"):
        engine.generate_sync([GenerationRequest("s", [5, 6], SamplingParams(stop="abc"))])


def test_factory_gives_the_torch_engine_its_tokenizer(tiny_model_dir, tokenizer):
    engine = build_engine("torch", EngineConfig(kind="torch"), tiny_model_dir, dtype="float32", device="cpu",
                          pad_token_id=tokenizer.pad_token_id)
    assert engine.tokenizer is not None
    req = GenerationRequest("t", _prompt(tokenizer, "Hi"), SamplingParams(max_new_tokens=20, temperature=HOT))
    free = engine.generate_sync([req])[0].token_ids
    text = tokenizer.decode(free, skip_special_tokens=True)
    stop = (text[len(text) // 2: len(text) // 2 + 2],)
    res = engine.generate_sync([_with_stop(req, stop)])[0]
    assert res.finish_reason == "stop" and res.token_ids == free[:first_stop_end(tokenizer, free, stop)]


def test_default_model_stop_string_check_holds_for_the_torch_engine():
    """The check the vLLM and SGLang tests run (engine_checks.check_stop_strings), with the
    torch engine on both sides: on the default model's greedy answers the stop strings cut
    at least half of the requests, each right after the completing token."""
    from engine_checks import check_stop_strings, held_out_prompt_ids

    from tidal.models import DEFAULT_MODEL_DIR, load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    engine = TorchEngine(load_model(DEFAULT_MODEL_DIR), tok.pad_token_id, tokenizer=tok)
    check_stop_strings(engine, engine, held_out_prompt_ids(tok), tok)


def test_vllm_gets_stop_strings_with_the_completing_token_kept():
    """The vLLM request fields (no vLLM needed): stop strings go as `stop`, matched in text with
    special tokens skipped, the stop string kept in the output (the slow vLLM test checks that
    vLLM then returns the completing token)."""
    from tidal.engines.vllm_requests import vllm_sampling_fields

    fields = vllm_sampling_fields(SamplingParams(stop=("</tool_call>",), stop_token_ids=(2,)))
    assert fields["stop"] == ["</tool_call>"] and fields["include_stop_str_in_output"] is True
    assert fields["skip_special_tokens"] is True and fields["stop_token_ids"] == [2]
    assert "stop" not in vllm_sampling_fields(SamplingParams())
