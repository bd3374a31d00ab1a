"""The torch engine: sampling contract, batching, weight updates, and log-prob agreement
with the trainer's forward pass (docs/architecture.md, "Invariants": token in, token out; versions; mismatch)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from tidal.config import AlgorithmConfig, TrainConfig
from tidal.engines.torch_batch import Call, Rows, Waiting, calls_of
from tidal.engines.torch_engine import EngineClosed, TorchEngine
from tidal.models import load_model, stop_token_ids
from tidal.trainer.trainer import TrainBatch, Trainer
from tidal.types import GenerationRequest, SamplingParams

PROMPTS = ["What is 12 + 34?", "What is 99 - 7?", "Hi", "What is 5 + 5? Answer quickly please."]
# fp32, same weights, two computations of one log-prob: engine (KV cache, left padding, a batch) vs the
# trainer's full pass, or the engine batched vs alone / with vs without its prefix cache. Measured
# here ≤ 9.5e-7 (100x under the bound, for another CPU's kernels and batch shapes); a wrong position,
# a stale cache row or the wrong weights moves a log-prob by 0.1 and more.
LOGPROB_TOLERANCE = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _ids(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)


def _requests(tokenizer, params, prompts=PROMPTS):
    return [GenerationRequest(str(i), tokenizer(_ids(tokenizer, p), add_special_tokens=False)["input_ids"],
                              SamplingParams(**{**params.__dict__, "seed": 100 + i}))
            for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tokenizer):
    return TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id, max_batch_size=64)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_match_trainer(tiny_model_dir, tokenizer, engine, temperature):
    params = SamplingParams(max_new_tokens=12, temperature=temperature)
    results = engine.generate_sync(_requests(tokenizer, params))
    trainer = Trainer(str(tiny_model_dir), TrainConfig(), AlgorithmConfig(), temperature=temperature,
                      pad_token_id=tokenizer.pad_token_id)
    reqs = _requests(tokenizer, params)
    tokens = [r.prompt_ids + res.token_ids for r, res in zip(reqs, results)]
    trainer_lp = trainer.logprobs(TrainBatch(tokens, [[True] * len(t) for t in tokens], [0.0] * 4, [[]] * 4))
    worst = 0.0
    for r, res, lp in zip(reqs, results, trainer_lp):
        got = torch.tensor(lp[len(r.prompt_ids) - 1:])  # position t scores token t+1
        worst = max(worst, float((got - torch.tensor(res.logprobs)).abs().max()))
    assert worst < LOGPROB_TOLERANCE


def test_request_samples_the_same_alone_or_in_a_batch(tokenizer, engine):
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    batch = engine.generate_sync(_requests(tokenizer, params))
    for i, req in enumerate(_requests(tokenizer, params)):
        alone = engine.generate_sync([req])[0]
        assert alone.token_ids == batch[i].token_ids
        # batch vs alone: other matmul shapes; measured ≤ 4.8e-7 (21x margin)
        assert alone.logprobs == pytest.approx(batch[i].logprobs, abs=1e-5)


def test_results_follow_request_order_and_seed(tokenizer, engine):
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    reqs = _requests(tokenizer, params)
    out = engine.generate_sync(reqs[::-1])
    assert [r.request_id for r in out] == [r.request_id for r in reqs[::-1]]
    other_seed = [GenerationRequest(r.request_id, r.prompt_ids, SamplingParams(max_new_tokens=10, seed=999 + i))
                  for i, r in enumerate(reqs)]
    assert [r.token_ids for r in engine.generate_sync(other_seed)] != [r.token_ids for r in out[::-1]]


def test_greedy_is_argmax_and_length_limits(tiny_model_dir, tokenizer, engine):
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    res = engine.generate_sync(_requests(tokenizer, params))
    model = load_model(tiny_model_dir)
    for req, r in zip(_requests(tokenizer, params), res):
        # no stop tokens: every request runs to its own limit
        assert len(r.token_ids) == 5 and r.finish_reason == "length"
        ids = torch.tensor([req.prompt_ids + r.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(req.prompt_ids) - 1 : -1]
        assert logits.argmax(-1).tolist() == r.token_ids


def test_stop_token_ends_the_request(tokenizer, engine):
    probe = engine.generate_sync(_requests(tokenizer, SamplingParams(max_new_tokens=8, temperature=0.0)))
    stop = probe[0].token_ids[2]  # the third greedy token becomes a stop token
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop,))
    r = engine.generate_sync(_requests(tokenizer, params)[:1])[0]
    first = probe[0].token_ids.index(stop)
    assert r.token_ids == probe[0].token_ids[: first + 1]
    assert r.finish_reason == "stop"


def test_update_weights_changes_outputs_and_version(tiny_model_dir, tokenizer):
    engine = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = engine.generate_sync(_requests(tokenizer, params))
    new = {n: p.detach() + 0.05 * torch.randn_like(p) for n, p in load_model(tiny_model_dir).named_parameters()}
    engine.update_weights(7, new)
    after = engine.generate_sync(_requests(tokenizer, params))
    assert engine.version == 7 and all(r.version == 7 for r in after)
    assert [r.logprobs for r in after] != [r.logprobs for r in before]
    with pytest.raises(ValueError, match="unknown"):
        engine.update_weights(8, {**new, "not.a.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights(8, dict(list(new.items())[1:]))


def test_pause_blocks_until_resume(tokenizer, engine):
    reqs = _requests(tokenizer, SamplingParams(max_new_tokens=2))[:1]

    async def run():
        engine.pause()
        task = asyncio.create_task(engine.generate(reqs))
        await asyncio.sleep(0.2)
        assert not task.done()
        engine.resume()
        return await asyncio.wait_for(task, 30)

    assert len(asyncio.run(run())) == 1


def test_stop_token_ids_of_chat_tokenizer(tokenizer):
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(tokenizer)


def test_continuous_batching_new_requests_join_and_match_alone(tiny_model_dir, tokenizer, monkeypatch):
    """More requests than max_batch_size, with different lengths: rows that finish leave,
    waiting requests join the running batch (prefilled up to a batch at a time, then merged in
    as rows leave), and every request's tokens and log-probs equal those it gets alone."""
    prompts = [f"What is {a} + {b}?" + " please" * (a % 3) for a, b in zip(range(10, 40, 3), range(50, 20, -3))]
    reqs = [GenerationRequest(str(i), tokenizer(_ids(tokenizer, p), add_special_tokens=False)["input_ids"],
                              SamplingParams(max_new_tokens=2 + (i * 5) % 11, temperature=1.0, seed=7 + i))
            for i, p in enumerate(prompts)]
    eng = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id, max_batch_size=4)
    prefills, joins, batch = [], [], []
    prefill = eng._prefill
    eng._prefill = lambda seqs: prefills.append(len(seqs)) or prefill(seqs)
    merge, decode = Rows.merge, Rows.decode
    monkeypatch.setattr(Rows, "merge", lambda self, new: joins.append(len(new)) or merge(self, new))
    monkeypatch.setattr(Rows, "decode", lambda self, *a: batch.append(len(self)) or decode(self, *a))
    together = eng.generate_sync(reqs)
    assert max(prefills) <= 4 and sum(prefills) == len(reqs)  # each request prefilled once, a batch at most
    assert len(joins) > 3 and max(batch) <= 4  # joined in several waves, never past the limit
    alone = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    for r, got in zip(reqs, together):
        ref = alone.generate_sync([r])[0]
        assert got.request_id == r.request_id and got.token_ids == ref.token_ids
        assert len(got.token_ids) == r.params.max_new_tokens or got.finish_reason == "stop"
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs),
                                   atol=LOGPROB_TOLERANCE, rtol=0)


def _staged(tiny_model_dir, tokenizer):
    """An engine of 4 rows after two scheduler steps: call A (4 requests, the first ends after one
    token) decodes; call B's 4 requests arrived then, so one row was free: all 4 were prefilled,
    one joined and 3 wait prefilled. Returns (engine, waiting, rows, A, B)."""
    eng = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id, max_batch_size=4)
    a = Call([GenerationRequest(f"a{i}", r.prompt_ids, SamplingParams(max_new_tokens=1 if i == 0 else 12, seed=i))
              for i, r in enumerate(_requests(tokenizer, SamplingParams()))])
    b = Call([GenerationRequest(f"b{i}", r.prompt_ids, SamplingParams(max_new_tokens=12, seed=50 + i))
              for i, r in enumerate(_requests(tokenizer, SamplingParams()))])
    waiting = Waiting(a.seqs())
    with torch.inference_mode():
        rows = eng._step(waiting, None)
        assert len(rows) == 3 and a.out[0] is not None  # a0 has finished
        waiting.extend(b.seqs())
        rows = eng._step(waiting, rows)
    assert len(rows) == 4 and not waiting and len(waiting.ready) == 3
    assert {s.call for s in waiting.ready.seqs} == {b}
    return eng, waiting, rows, a, b


def _drain(eng, waiting, rows):
    with torch.inference_mode():
        while rows is not None or not waiting.empty:
            rows = eng._step(waiting, rows)


def test_rows_waiting_prefilled_join_as_rows_leave_and_match_alone(tiny_model_dir, tokenizer):
    eng, waiting, rows, a, b = _staged(tiny_model_dir, tokenizer)
    assert b in calls_of(waiting, None)  # in flight: a failure or close() fails B too
    before = eng.prefill_tokens
    _drain(eng, waiting, rows)
    assert eng.prefill_tokens == before  # B's waiting rows joined without another prefill
    alone = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    for call in (a, b):
        assert call.future.done()
        for r, got in zip(call.requests, call.future.result()):
            ref = alone.generate_sync([r])[0]
            assert got.token_ids == ref.token_ids
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs),
                                       atol=LOGPROB_TOLERANCE, rtol=0)


def test_a_cancelled_call_s_rows_waiting_prefilled_never_decode(tiny_model_dir, tokenizer):
    eng, waiting, rows, a, b = _staged(tiny_model_dir, tokenizer)
    b.future.cancel()  # its caller is gone
    waiting_b = list(waiting.ready.seqs)
    # Rows sampled from here: A's to their ends, and B's joined row once more (then it leaves).
    expected = sum(s.request.params.max_new_tokens - len(s.tokens) for s in rows.seqs if s.call is a) + 1
    before = eng.sampled_tokens
    _drain(eng, waiting, rows)
    assert eng.sampled_tokens - before == expected  # B's waiting rows never joined
    assert all(s.tokens == [] for s in waiting_b)
    assert [len(r.token_ids) for r in a.future.result()] == [1, 12, 12, 12]


# -- one scheduler per engine: requests of concurrent calls share the running batch ---------------
STEP_DELAY_S = 0.003  # per forward pass: a second call surely arrives while the first decodes


def _slow(engine: TorchEngine) -> TorchEngine:
    engine.model.register_forward_pre_hook(lambda *_: time.sleep(STEP_DELAY_S))
    return engine


def _in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _wait_steps(engine, n, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while engine.decode_steps < n:
        assert time.monotonic() < deadline, "the engine made no progress"
        time.sleep(0.001)


def test_two_overlapping_calls_decode_in_one_batch(tiny_model_dir, tokenizer):
    """Call B starts while call A decodes. With the scheduler its requests join A's running
    batch: fewer decode steps than the two calls one after the other, and every request's
    tokens are those it gets alone."""
    params = SamplingParams(max_new_tokens=30, temperature=1.0)
    a = _requests(tokenizer, params)
    b = [GenerationRequest(f"b{r.request_id}", r.prompt_ids, SamplingParams(max_new_tokens=30, seed=900 + i))
         for i, r in enumerate(_requests(tokenizer, params))]
    ref = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    want_a, want_b = ref.generate_sync(a), ref.generate_sync(b)
    one_after_the_other = ref.decode_steps  # 30 + 30: no stop tokens, each call runs to its limit

    eng = _slow(TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id))
    ta, box_a = _in_thread(eng.generate_sync, a)
    _wait_steps(eng, 3)
    tb, box_b = _in_thread(eng.generate_sync, b)
    ta.join(60)
    tb.join(60)
    assert "error" not in box_a and "error" not in box_b
    for got, want in ((box_a["out"], want_a), (box_b["out"], want_b)):
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs),
                                       atol=LOGPROB_TOLERANCE, rtol=0)
    assert eng.sampled_tokens == ref.sampled_tokens == 8 * 30
    assert eng.decode_steps < one_after_the_other - 10  # B joined within A's first 20 steps


def test_many_concurrent_async_calls_join_one_batch(tiny_model_dir, tokenizer):
    """40 concurrent single-request calls (more than the default thread pool's workers): all of
    them decode together, as the turns of many episodes do."""
    eng = _slow(TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id))
    reqs = [GenerationRequest(f"r{i}", [5 + i % 7, 17, 30], SamplingParams(max_new_tokens=12, seed=i))
            for i in range(40)]

    async def all_at_once():
        return await asyncio.gather(*(eng.generate([r]) for r in reqs))

    out = asyncio.run(all_at_once())
    assert [o[0].request_id for o in out] == [r.request_id for r in reqs]
    # 480 tokens: with at most 6 calls in flight (the default executor's threads here) a step
    # would sample at most 6 rows, 80 steps or more; together they take far fewer.
    assert eng.sampled_tokens == 40 * 12 and eng.decode_steps < 60
    alone = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id).generate_sync(reqs)
    assert [o[0].token_ids for o in out] == [r.token_ids for r in alone]


def test_from_idle_a_burst_of_calls_is_gathered_into_one_prefill(tiny_model_dir, tokenizer, monkeypatch):
    """Calls arriving 20 ms apart from idle, with a quiet window of 0.5 s: the engine waits for
    the burst and prefills it once. Without the wait the first call prefills alone at once and
    the others join later, one prefill each time (20 ms is many decode steps here)."""
    import tidal.engines.torch_engine as te

    monkeypatch.setattr(te, "_SETTLE_QUIET_S", 0.5)  # far above the 20 ms gaps on a loaded machine
    monkeypatch.setattr(te, "_SETTLE_MAX_S", 10.0)
    eng = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    prefills = []
    real_prefill = eng._prefill
    monkeypatch.setattr(eng, "_prefill", lambda take: prefills.append(len(take)) or real_prefill(take))
    reqs = [GenerationRequest(f"r{i}", [5 + i, 17, 30], SamplingParams(max_new_tokens=8, seed=i)) for i in range(6)]
    threads = []
    for r in reqs:
        t, out = _in_thread(eng.generate_sync, [r])
        threads.append((t, out))
        time.sleep(0.02)
    for t, _ in threads:
        t.join(60)
    assert prefills == [6]
    assert all(len(box["out"][0].token_ids) > 0 for _, box in threads)


def test_a_prefill_that_raises_fails_its_calls_instead_of_leaving_them_waiting(tiny_model_dir, tokenizer):
    """A prefill can fail (out of memory on a GPU, a broken model): the requests it took were in
    neither the queue nor the batch, and their callers waited forever. Now the call fails with
    the prefill's error, and the engine serves the next call."""
    eng = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    real, calls = eng._prefill, []

    def failing_once(seqs):
        calls.append(len(seqs))
        if len(calls) == 1:
            raise RuntimeError("simulated: out of memory in the prefill")
        return real(seqs)

    eng._prefill = failing_once
    reqs = _requests(tokenizer, SamplingParams(max_new_tokens=4))
    t, box = _in_thread(eng.generate_sync, reqs)
    t.join(30)
    assert not t.is_alive(), "the call waits forever"
    assert "out of memory in the prefill" in str(box.get("error"))
    assert [len(r.token_ids) for r in eng.generate_sync(reqs)] == [4] * len(reqs)


def test_a_bad_call_fails_alone_and_close_fails_calls_in_flight(tiny_model_dir, tokenizer):
    eng = _slow(TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id))
    params = SamplingParams(max_new_tokens=25, temperature=1.0)
    good = _requests(tokenizer, params)
    ta, box = _in_thread(eng.generate_sync, good)
    _wait_steps(eng, 2)
    with pytest.raises(ValueError, match="request bad has an empty prompt"):
        eng.generate_sync([GenerationRequest("bad", [], params)])
    ta.join(60)
    want = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id).generate_sync(good)
    assert [r.token_ids for r in box["out"]] == [r.token_ids for r in want]

    tb, box = _in_thread(eng.generate_sync, good)
    _wait_steps(eng, eng.decode_steps + 2)
    eng.close()
    tb.join(30)
    assert not tb.is_alive() and isinstance(box.get("error"), EngineClosed)
    with pytest.raises(EngineClosed, match="generate .* after close"):
        eng.generate_sync(good)


# -- prefix cache across turns ------------------------------------------------------------------
def _turn2(tokenizer, reqs, results, seed0=300):
    """The next turn of each session: prompt + generation + a tool answer of some length."""
    out = []
    for i, (r, res) in enumerate(zip(reqs, results)):
        obs = tokenizer("<|im_start|>tool\n" + "result 42 " * (1 + i % 3) + "<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)["input_ids"]
        out.append(GenerationRequest(f"t2-{i}", r.prompt_ids + res.token_ids + obs,
                                     SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed0 + i),
                                     session_id=r.session_id))
    return out


def test_requests_that_share_a_prompt_prefill_it_once(engine, tokenizer):
    """A GRPO group's samples share their prompt: the prompt is computed once per join and its
    keys, values and first logits are copied to each sample's row. Each sample decodes as it
    would alone (its own seed: tokens equal, log-probs to float rounding across batch shapes)."""
    reqs = [GenerationRequest(f"r{i}", r.prompt_ids, SamplingParams(max_new_tokens=10, temperature=1.0, seed=7 + i))
            for i, r in enumerate(_requests(tokenizer, SamplingParams(), PROMPTS * 4))]  # interleaved groups
    before = engine.prefill_tokens
    together = engine.generate_sync(reqs)
    distinct = {tuple(r.prompt_ids) for r in reqs}
    assert len(distinct) == len(PROMPTS)
    assert engine.prefill_tokens - before == sum(len(p) for p in distinct)  # 4x this without sharing
    alone = [engine.generate_sync([r])[0] for r in reqs]
    assert [t.token_ids for t in together] == [a.token_ids for a in alone]
    assert len({tuple(t.token_ids) for t in together}) > len(PROMPTS)  # the samples of a prompt differ
    for t, a in zip(together, alone):
        torch.testing.assert_close(torch.tensor(t.logprobs), torch.tensor(a.logprobs), atol=LOGPROB_TOLERANCE,
                                   rtol=0)


def test_prefix_cache_next_turn_prefills_only_what_is_new(tiny_model_dir, tokenizer):
    """A session's next turn starts from the KV cache its last turn left: only the new tokens
    are prefilled, and the tokens are those a cold engine samples (log-probs to float
    rounding: cached KV vs recomputed, fp32). A prompt that does not extend the cached
    tokens, a request without a session, and every request after a weight update miss."""
    cached = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    cold = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id, prefix_cache_bytes=0)
    first = [GenerationRequest(r.request_id, r.prompt_ids, SamplingParams(max_new_tokens=4 + 3 * i, seed=i),
                               session_id=f"ep{i}")
             for i, r in enumerate(_requests(tokenizer, SamplingParams(), PROMPTS * 2))]
    res1 = cached.generate_sync(first)
    assert [r.token_ids for r in res1] == [r.token_ids for r in cold.generate_sync(first)]
    assert len(cached.prefixes) == len(first) and cold.prefixes.bytes == 0
    second = _turn2(tokenizer, first, res1)
    second[1].prompt_ids[3] += 1  # no longer extends session ep1's tokens: a miss
    second[2].session_id = ""  # no session: a miss (ep2's entry stays)
    before = cached.prefill_tokens
    got, want = cached.generate_sync(second), cold.generate_sync(second)
    assert cached.prefixes.hits == len(second) - 2
    # One join: the two cold rows feed their whole prompts; the warm ones, apart, each feed the
    # longest new part among them (the rest of their prompt comes from the cache).
    warm = [i for i in range(len(second)) if i not in (1, 2)]
    new = max(len(second[i].prompt_ids) - (len(first[i].prompt_ids) + len(res1[i].token_ids) - 1) for i in warm)
    assert cached.prefill_tokens - before == len(second[1].prompt_ids) + len(second[2].prompt_ids) + len(warm) * new
    assert len(warm) * new < 0.7 * sum(len(second[i].prompt_ids) for i in warm)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=LOGPROB_TOLERANCE,
                                   rtol=0)

    cached.update_weights(1, dict(cached.model.named_parameters()))
    assert len(cached.prefixes) == 0  # kept KV came from the old weights
    hits = cached.prefixes.hits
    cached.generate_sync(_turn2(tokenizer, second, got))
    assert cached.prefixes.hits == hits


def test_prefix_cache_stays_within_its_budget(tiny_model_dir, tokenizer):
    probe = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    reqs = [GenerationRequest(f"r{i}", [5 + i, 17, 30, 31, 32], SamplingParams(max_new_tokens=6, seed=i),
                              session_id=f"s{i}") for i in range(12)]
    probe.generate_sync(reqs)
    one = probe.prefixes.bytes // 12  # every entry holds the same number of tokens
    small = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id, prefix_cache_bytes=3 * one + one // 2)
    small.generate_sync(reqs)
    assert len(small.prefixes) == 3 and small.prefixes.bytes <= small.prefixes.max_bytes
