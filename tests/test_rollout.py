"""Rollout: episodes carry exactly the tokens the policy saw and produced, across turns."""

from __future__ import annotations

import asyncio

from tidal.engines.torch_engine import TorchEngine
from tidal.envs.base import StepResult
from tidal.models import load_model
from tidal.runtime.rollout import BatchingClient, Rollout, group_specs
from tidal.types import SamplingParams, Status


class TwoTurnEnv:
    """Asks, then replies once with a follow-up, then ends with reward 1."""

    name = "two_turn"

    def __init__(self, row):
        self.row, self.turn = row, 0

    async def reset(self):
        return [{"role": "user", "content": self.row["prompt"]}]

    async def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return StepResult(messages=[{"role": "user", "content": "And plus one?"}], done=False,
                              reward=0.25, reward_parts={"first": 0.25})
        return StepResult(reward=1.0, reward_parts={"second": 1.0}, metrics={"correct": 1.0})


def test_multi_turn_tokens_masks_and_versions(tiny_model_dir, tokenizer):
    engine = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    engine.update_weights(3, dict(engine.model.named_parameters()))
    # every token stops generation: each policy turn is one token, so both turns happen
    params = SamplingParams(max_new_tokens=4, stop_token_ids=tuple(range(len(tokenizer))))
    rollout = Rollout(tokenizer, params, max_turns=4)
    specs = group_specs([{"prompt": "What is 1 + 1?"}], TwoTurnEnv, samples=3, seed=0, step=5)
    eps = asyncio.run(rollout.run(specs, engine, step=5))
    assert len(eps) == 3 and len({e.episode_id for e in eps}) == 3 and len({e.group_id for e in eps}) == 1
    for ep in eps:
        assert ep.status is Status.OK and ep.reward == 1.25 and ep.reward_parts == {"first": 0.25, "second": 1.0}
        assert ep.metrics["turns"] == 2
        policy = [i for i, m in enumerate(ep.loss_mask) if m]
        assert len(policy) == 2 and policy[0] == ep.prompt_len
        t1, t2 = ep.tokens[policy[0]], ep.tokens[policy[1]]
        prompt = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "What is 1 + 1?"}],
                                                         add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)["input_ids"]
        between = tokenizer.decode(ep.tokens[policy[0] + 1 : policy[1]])
        # prompt as tokenized once, the policy's own token, the follow-up turn, the policy's token
        assert ep.tokens[: ep.prompt_len] == prompt
        # the policy's turn is closed as the template closes it, then the follow-up turn
        closing = "" if t1 == tokenizer.convert_tokens_to_ids("<|im_end|>") else "<|im_end|>"
        assert between == closing + "\n<|im_start|>user\nAnd plus one?<|im_end|>\n<|im_start|>assistant\n"
        assert ep.tokens[-1] == t2 and ep.tokens[ep.prompt_len] == t1
        assert [v for v, m in zip(ep.versions, ep.loss_mask) if m] == [3, 3]
        assert all(v == -1 for v, m in zip(ep.versions, ep.loss_mask) if not m)
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if m)


def test_batching_client_sends_concurrent_requests_together(tiny_model_dir, tokenizer):
    engine = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    rollout = Rollout(tokenizer, SamplingParams(max_new_tokens=3), max_turns=1)
    from tidal.envs.single_turn import SingleTurnEnv

    specs = group_specs([{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)],
                        lambda row: SingleTurnEnv(row, lambda completion, answer: 0.0), samples=4, seed=0, step=1)

    async def run():
        client = BatchingClient(engine)
        eps = await asyncio.gather(*(rollout.run_episode(s, client, 1) for s in specs))
        return eps, client.batches

    eps, batches = asyncio.run(run())
    assert batches == [20] and all(e.status is Status.TRUNCATED or e.status is Status.OK for e in eps)


def test_env_reset_failure_is_typed():
    class Broken:
        name = "broken"

        async def reset(self):
            raise RuntimeError("no such task")

        async def step(self, action):
            raise AssertionError("unreachable")

    rollout = Rollout(tokenizer=None, params=SamplingParams())
    specs = group_specs([{"prompt": "x"}], lambda row: Broken(), samples=1, seed=0, step=2)
    ep = asyncio.run(rollout.run(specs, engine=None, step=2))[0]
    assert ep.status is Status.ENV_ERROR and "env `broken` reset raised RuntimeError(no such task)" in ep.error
    assert "episode s2-p0-e0" in ep.error and ep.reward != ep.reward  # NaN: never scored as 0


def test_slow_episode_ends_timeout_and_others_finish(tiny_model_dir, tokenizer):
    from tidal.envs.single_turn import SingleTurnEnv

    class Stuck(SingleTurnEnv):
        async def step(self, action):
            if self.row["prompt"] == "stuck":
                await asyncio.sleep(60)
            return await super().step(action)

    engine = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    rollout = Rollout(tokenizer, SamplingParams(max_new_tokens=2), timeout_s=2.0)
    rows = [{"prompt": "stuck", "answer": "1"}, {"prompt": "fine", "answer": "1"}]
    specs = group_specs(rows, lambda row: Stuck(row, lambda completion, answer: 1.0), samples=1, seed=0, step=1)
    stuck, fine = asyncio.run(rollout.run(specs, engine, step=1))
    assert stuck.status is Status.TIMEOUT and "episode_timeout_s=2" in stuck.error
    assert fine.status in (Status.OK, Status.TRUNCATED) and fine.reward == 1.0


def test_out_of_turns_is_truncated_without_trailing_tokens(tiny_model_dir, tokenizer):
    engine = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    params = SamplingParams(max_new_tokens=4, stop_token_ids=tuple(range(len(tokenizer))))
    rollout = Rollout(tokenizer, params, max_turns=1)  # TwoTurnEnv wants a second turn
    ep = asyncio.run(rollout.run(group_specs([{"prompt": "Hi"}], TwoTurnEnv, 1, 0, 1), engine, step=1))[0]
    assert ep.status is Status.TRUNCATED and ep.reward == 0.25
    assert ep.loss_mask[-1] and len(ep.tokens) == ep.prompt_len + 1
