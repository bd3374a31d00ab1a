"""The reward model: `tidal train-rm`'s pairs and training, the dynamic-batching pool, and
the reward function over it. The model is trained here, in seconds, from the randomly
initialised tiny model (conftest's `tiny_model_dir`): a real reward model, small."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest
import torch

from tidal.envs.arithmetic import ArithmeticConfig, make_problems
from tidal.recipes.train_rm import REJECTED_KINDS, make_pairs, pair_texts, train_reward_model
from tidal.rewards.arithmetic import score as arithmetic_score
from tidal.rewards.rm import RewardModelError, RewardModelPool, RewardModelReward, render

# Batched and one-by-one forward passes differ only by float summation order (other matmul
# shapes; padding positions are masked and come after the scored token): fp32 logits of
# magnitude ~1 agree to ~1e-6. 1e-4 is that with a wide margin and still far below the
# gaps between different texts' scores that the tests rely on.
BATCH_TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def rm_dir(one_thread, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm") / "model"
    train_reward_model(out, init=tiny_model_dir, pairs=64, steps=4, batch_size=8, heldout_pairs=16, seed=0,
                       log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def pool(rm_dir):
    with RewardModelPool(rm_dir, max_batch_size=8, max_wait_ms=20) as p:
        yield p


def texts_for(tokenizer, n: int) -> list[str]:
    rows = make_problems(ArithmeticConfig(), "train", n, seed=3)
    return [render(tokenizer, f"<answer>{int(r['answer']) + i % 3}</answer>", prompt_messages=r["prompt"])
            for i, r in enumerate(rows)]


# -- the preference pairs -------------------------------------------------------------------
def test_pairs_are_right_over_wrong_by_the_tasks_own_verifier():
    pairs = make_pairs("train", 400, seed=0)
    assert {p["kind"] for p in pairs} == set(REJECTED_KINDS)
    for p in pairs:
        assert arithmetic_score(p["chosen"], p["answer"])["correct"] == 1.0, p
        assert arithmetic_score(p["rejected"], p["answer"])["correct"] == 0.0, p
    worked = [p for p in pairs if p["kind"] == "worked_wrong"]
    assert all("=" in p["chosen"] and "=" in p["rejected"] for p in worked)  # same form, only the number differs


def test_train_and_held_out_pairs_share_no_problem():
    train = {p["prompt"][0]["content"] for p in make_pairs("train", 2000, seed=0)}
    held = {p["prompt"][0]["content"] for p in make_pairs("test", 300, seed=0)}
    assert train and held and not train & held


def test_pair_texts_end_both_or_neither(tokenizer):
    import random

    pairs = make_pairs("train", 50, seed=1)
    c, r = pair_texts(tokenizer, pairs, random.Random(0))
    ends = [(x.endswith(tokenizer.eos_token), y.endswith(tokenizer.eos_token)) for x, y in zip(c, r)]
    assert all(a == b for a, b in ends) and any(a for a, _ in ends) and not all(a for a, _ in ends)
    assert all(x.startswith("<|im_start|>user\n") and "<|im_start|>assistant\n" in x for x in c)


# -- training ---------------------------------------------------------------------------------
def test_trained_directory_is_a_plain_hf_reward_model(rm_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(rm_dir))
    tok = AutoTokenizer.from_pretrained(str(rm_dir))
    assert type(model).__name__ == "Qwen2ForSequenceClassification" and model.config.num_labels == 1
    assert model.config.pad_token_id == tok.pad_token_id is not None
    meta = json.loads((rm_dir / "tidal_rm.json").read_text())
    assert meta["steps"] == 4 and meta["history"][-1]["step"] == 4
    assert 0.0 <= meta["heldout"]["accuracy"] <= 1.0 and meta["heldout"]["n"] == 16
    assert set(meta["heldout"]["by_kind"]) == set(REJECTED_KINDS)


def test_training_is_deterministic_from_the_seed(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    kw = {"init": tiny_model_dir, "pairs": 32, "steps": 2, "batch_size": 4, "heldout_pairs": 8, "log": lambda m: None}
    train_reward_model(tmp_path / "a", seed=5, **kw)
    train_reward_model(tmp_path / "b", seed=5, **kw)
    a, b = (load_file(tmp_path / x / "model.safetensors") for x in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a)
    meta = [json.loads((tmp_path / x / "tidal_rm.json").read_text()) for x in "ab"]
    assert meta[0]["heldout"] == meta[1]["heldout"] and meta[0]["history"][-1]["loss"] == meta[1]["history"][-1]["loss"]


def test_bradley_terry_training_raises_held_out_pairwise_accuracy(tiny_model_dir, tmp_path):
    # A random 2-layer model learns at least to put the right form, and the hasty student's
    # answers, below the right answer within 20 short steps (measured: 0.41 -> 0.78 on these
    # 64 held-out pairs, problems it never saw).
    s = train_reward_model(tmp_path / "rm", init=tiny_model_dir, pairs=200, steps=20, batch_size=8, lr=3e-3,
                           heldout_pairs=64, eval_every=1000, seed=0, log=lambda m: None)
    assert s["history"][-1]["loss"] < 0.69  # below log 2, the loss of a model that cannot tell
    assert s["heldout"]["accuracy"] > s["heldout_at_init"] + 0.1, s["heldout"]


def test_bad_training_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="pairs, steps"):
        train_reward_model(tmp_path / "x", steps=0)


# -- the pool ---------------------------------------------------------------------------------
def test_batched_scores_equal_one_by_one_and_order_is_kept(pool):
    texts = texts_for(pool.tokenizer, 20)
    single = [pool.forward([t])[0] for t in texts]
    assert len({round(s, 3) for s in single}) > 5  # the texts score differently: order matters
    batched = asyncio.run(pool.score(texts))
    assert batched == pytest.approx(single, abs=BATCH_TOL)
    assert pool.score_sync(list(reversed(texts)), timeout_s=30) == pytest.approx(single[::-1], abs=BATCH_TOL)


def test_concurrent_callers_share_forward_passes(pool):
    texts = texts_for(pool.tokenizer, 32)
    single = [pool.forward([t])[0] for t in texts]
    pool.reset_stats()

    async def main():
        return await asyncio.gather(*(pool.score([t]) for t in texts))

    got = asyncio.run(main())
    assert [g[0] for g in got] == pytest.approx(single, abs=BATCH_TOL)
    st = pool.stats()
    assert st["requests"] == 32 and st["texts"] == 32
    assert max(int(k) for k in st["batch_size_histogram"]) > 1, st
    assert max(int(k) for k in st["batch_size_histogram"]) <= pool.max_batch_size
    assert st["forward_passes"] < 32


def test_a_request_larger_than_a_batch_is_split(pool):
    texts = texts_for(pool.tokenizer, 19)
    pool.reset_stats()
    got = pool.score_sync(texts, timeout_s=30)
    assert got == pytest.approx([pool.forward([t])[0] for t in texts], abs=BATCH_TOL)
    hist = pool.stats()["batch_size_histogram"]
    assert max(int(k) for k in hist) <= 8 and hist.get("8", 0) >= 2


def test_long_texts_are_cut_from_the_left_and_counted(pool):
    long = "x " * 400 + texts_for(pool.tokenizer, 1)[0]
    ids = pool.tokenizer(long, add_special_tokens=False)["input_ids"]
    assert len(ids) > pool.max_length
    pool.reset_stats()
    s = pool.score_sync([long], timeout_s=30)[0]
    assert pool.stats()["truncated"] == 1
    with torch.inference_mode():  # the model on the last max_length tokens: the end, where the answer is
        end = pool.model(input_ids=torch.tensor([ids[-pool.max_length:]])).logits[0, 0].item()
        start = pool.model(input_ids=torch.tensor([ids[: pool.max_length]])).logits[0, 0].item()
    assert s == pytest.approx(end, abs=BATCH_TOL) and abs(s - start) > BATCH_TOL


def test_a_failing_forward_pass_names_the_model_and_fails_every_caller(rm_dir):
    with RewardModelPool(rm_dir, max_batch_size=4, max_wait_ms=1) as p:
        p.device = "meta"  # inputs on another device than the weights: a real failure of the forward pass
        with pytest.raises(RewardModelError, match=r"reward model `.*` failed on a batch"):
            p.score_sync(["a", "b"], timeout_s=30)
        p.device = "cpu"
        assert len(p.score_sync(["a"], timeout_s=30)) == 1  # the worker survives
    with pytest.raises(RewardModelError, match="closed"):
        p.score_sync(["a"])


def test_bad_inputs_are_refused(pool, tmp_path):
    with pytest.raises(TypeError, match="list of strings"):
        pool.submit("one string")
    with pytest.raises(RewardModelError, match="not a Hugging Face model directory"):
        RewardModelPool(tmp_path)


# -- the reward function ------------------------------------------------------------------------
def test_reward_scores_prompt_plus_completion(rm_dir, pool):
    fn = RewardModelReward(path=str(rm_dir), max_wait_ms=1)
    row = make_problems(ArithmeticConfig(), "train", 1, seed=0)[0]
    prompt = pool.tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    expected = pool.forward([prompt + "<answer>12</answer>"])[0]

    async def main():
        a = await fn("<answer>12</answer>", prompt=prompt, prompt_messages=row["prompt"], answer=row["answer"])
        b = await fn("<answer>12</answer>", prompt_messages=row["prompt"])
        return a, b

    a, b = asyncio.run(main())
    assert set(a) == {"rm"} and a["rm"] == pytest.approx(expected, abs=BATCH_TOL)
    assert b["rm"] == pytest.approx(a["rm"], abs=BATCH_TOL)
    with pytest.raises(ValueError, match="needs `prompt`"):
        asyncio.run(fn("<answer>12</answer>"))
    fn.close()


def test_reward_loads_lazily_and_pickles_without_its_model(rm_dir):
    fn = RewardModelReward(path=str(rm_dir), transform="sigmoid", part="pref")
    assert fn.pool is None
    out = asyncio.run(fn("<answer>3</answer>", prompt="<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"))
    assert set(out) == {"pref"} and 0.0 < out["pref"] < 1.0
    clone = pickle.loads(pickle.dumps(fn))
    assert clone.pool is None and clone.__tidal_name__ == fn.__tidal_name__
    again = asyncio.run(clone("<answer>3</answer>", prompt="<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"))
    assert again["pref"] == pytest.approx(out["pref"], abs=BATCH_TOL)
    fn.close()
    clone.close()


def test_reward_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="not a reward model directory"):
        RewardModelReward(path=str(tmp_path))
    with pytest.raises(ValueError, match="transform"):
        RewardModelReward(path=str(tmp_path), transform="tanh")


# -- as a Ray actor ------------------------------------------------------------------------------
@pytest.mark.slow  # starts a Ray instance (several seconds)
def test_reward_model_actor_serves_rewards_of_other_processes(rm_dir, pool):
    import logging
    import os

    import ray

    from tidal.rewards.rm import RewardModelActor
    from tidal.runtime.placement import keep_on_loopback

    keep_on_loopback()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(_node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    try:
        actor = ray.remote(RewardModelActor).options(name="tidal-rm-test", num_cpus=1, max_concurrency=64).remote(
            str(rm_dir), max_batch_size=8, max_wait_ms=50, num_cpus=1)
        assert ray.get(actor.ready.remote(), timeout=60)
        fn = RewardModelReward(path=str(rm_dir), actor="tidal-rm-test")
        rows = make_problems(ArithmeticConfig(), "train", 16, seed=4)
        prompts = [pool.tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
                   for r in rows]

        async def main():
            return await asyncio.gather(*(fn(f"<answer>{r['answer']}</answer>", prompt=p) for r, p in zip(rows, prompts)))

        got = asyncio.run(main())
        expected = [pool.forward([p + f"<answer>{r['answer']}</answer>"])[0] for r, p in zip(rows, prompts)]
        assert [g["rm"] for g in got] == pytest.approx(expected, abs=BATCH_TOL)
        assert fn.pool is None  # scored by the actor, not a model of this process
        hist = ray.get(actor.stats.remote(), timeout=30)["batch_size_histogram"]
        assert max(int(k) for k in hist) > 1, hist
    finally:
        ray.shutdown()
