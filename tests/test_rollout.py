"""Rollout: episodes carry exactly the tokens the policy saw and produced, across turns; the
prefix policy on templates that re-render history; budgets, overrides and close() on every path.

Three real chat templates, as a tokenizer-only directory each (the tiny model's tokenizer with
another template): the tiny model's own ChatML template; a Qwen2.5-style template that renders
tools into the system prompt and tool results as `<tool_response>` blocks (prefix-preserving
when turns render as generated); a Qwen3-style template that strips `<think>` reasoning from
assistant turns before the last user message (not prefix-preserving)."""

from __future__ import annotations

import asyncio
import shutil
from typing import ClassVar

import pytest
import torch

from tidal.config import AlgorithmConfig
from tidal.engines.torch_engine import TorchEngine
from tidal.envs.base import SamplingOverride, StepResult
from tidal.models import load_model, load_tokenizer
from tidal.rewards.contract import RewardOutcome
from tidal.runtime.batch import build_batch, token_rewards
from tidal.runtime.rollout import BatchingClient, Rollout, group_specs
from tidal.trainer.trainer import pad_rows
from tidal.types import GenerationResult, SamplingParams, Status

QWEN25_STYLE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Signatures within <tools></tools>:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "Call a function with <tool_call>\n{\"name\": <name>, \"arguments\": <json>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for tc in m.tool_calls | default([]) %}\n<tool_call>\n"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments }}}\n</tool_call>{%- endfor %}"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3_STYLE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user %}"
    "<|im_start|>assistant\n{{ m.content.split('</think>')[-1].lstrip('\\n') }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer_dir(src, dst, template):
    dst.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / f, dst / f)
    (dst / "chat_template.jinja").write_text(template)
    return load_tokenizer(dst)


@pytest.fixture(scope="module")
def qwen25_tok(tiny_model_dir, tmp_path_factory):
    return _tokenizer_dir(tiny_model_dir, tmp_path_factory.mktemp("q25") / "tok", QWEN25_STYLE)


@pytest.fixture(scope="module")
def qwen3_tok(tiny_model_dir, tmp_path_factory):
    return _tokenizer_dir(tiny_model_dir, tmp_path_factory.mktemp("q3") / "tok", QWEN3_STYLE)


class ScriptedTurns:
    """A policy that answers turn t of every episode with `turns[t]` then <|im_end|>; it records
    every request (its prompt and sampling), so a test sees the context the policy was given."""

    def __init__(self, tokenizer, turns: list[str], version: int = 0):
        self.tok, self.turns, self.version = tokenizer, turns, version
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.requests = []

    async def generate(self, requests):
        out = []
        for r in requests:
            self.requests.append(r)
            turn = int(r.request_id.rsplit("/", 1)[1])
            ids = self.tok(self.turns[turn], add_special_tokens=False)["input_ids"] + [self.end]
            ids = ids[: r.params.max_new_tokens]
            reason = "stop" if ids[-1] == self.end else "length"
            out.append(GenerationResult(r.request_id, ids, [-0.5] * len(ids), reason, self.version))
        return out


class Conversation:
    """Replies to each turn with `replies[t]` (messages), ends after the last; records its
    calls and whether it was closed."""

    name = "conversation"
    closed: ClassVar[list] = []

    def __init__(self, row, seed=0, replies=(), rewards=(), fail_at=None, hang_at=None):
        self.row, self.seed, self.replies, self.rewards = row, seed, list(replies), list(rewards)
        self.fail_at, self.hang_at, self.turn, self.actions = fail_at, hang_at, 0, []
        self.sampling = None

    async def reset(self):
        return [{"role": "user", "content": self.row["prompt"]}]

    async def step(self, action):
        self.actions.append(action)
        t, self.turn = self.turn, self.turn + 1
        if t == self.fail_at:
            raise KeyError("no such file")
        if t == self.hang_at:
            await asyncio.sleep(60)
        reward = self.rewards[t] if t < len(self.rewards) else 0.0
        if t < len(self.replies):
            return StepResult(messages=self.replies[t], done=False, reward=reward)
        return StepResult(done=True, reward=reward)

    async def close(self):
        Conversation.closed.append(self)


def run(rollout, specs, engine, step=1):
    return asyncio.run(rollout.run(specs, engine, step=step))


def env_factory(**kw):
    return lambda row, seed: Conversation(row, seed, **kw)


def test_multi_turn_tokens_masks_and_versions(tiny_model_dir, tokenizer):
    engine = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    engine.update_weights(3, dict(engine.model.named_parameters()))
    # every token stops generation: each policy turn is one token, so both turns happen
    params = SamplingParams(max_new_tokens=4, stop_token_ids=tuple(range(len(tokenizer))))
    rollout = Rollout(tokenizer, params, max_turns=4)
    make = env_factory(replies=[[{"role": "user", "content": "And plus one?"}]], rewards=[0.25, 1.0])
    eps = run(rollout, group_specs([{"prompt": "What is 1 + 1?"}], make, samples=3, seed=0, step=5), engine, 5)
    assert len(eps) == 3 and len({e.episode_id for e in eps}) == 3 and len({e.group_id for e in eps}) == 1
    for ep in eps:
        assert ep.status is Status.OK and ep.reward == 1.25 and ep.metrics["turns"] == 2
        assert [t.reward for t in ep.turns] == [0.25, 1.0] and ep.segments == [0]
        policy = [i for i, m in enumerate(ep.loss_mask) if m]
        assert len(policy) == 2 and policy[0] == ep.prompt_len
        t1, t2 = ep.tokens[policy[0]], ep.tokens[policy[1]]
        assert [ep.turns[0].start, ep.turns[1].start] == policy and ep.turns[0].obs_end == policy[1]
        prompt = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "What is 1 + 1?"}],
                                                         add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)["input_ids"]
        between = tokenizer.decode(ep.tokens[policy[0] + 1 : policy[1]])
        assert ep.tokens[: ep.prompt_len] == prompt
        # the policy's turn is closed as the template closes it, then the follow-up turn
        closing = "" if t1 == tokenizer.convert_tokens_to_ids("<|im_end|>") else "<|im_end|>"
        assert between == closing + "\n<|im_start|>user\nAnd plus one?<|im_end|>\n<|im_start|>assistant\n"
        assert ep.tokens[-1] == t2 and ep.tokens[ep.prompt_len] == t1
        assert [v for v, m in zip(ep.versions, ep.loss_mask) if m] == [3, 3]
        assert all(v == -1 for v, m in zip(ep.versions, ep.loss_mask) if not m)
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if m)


def _check_exact(ep, engine, tok, turns):
    """Every policy span decodes to what was scripted and is on the mask; the engine's context
    for each turn is exactly the episode's tokens before that turn (within its segment)."""
    mine = [r for r in engine.requests if r.session_id == ep.episode_id]
    assert len(mine) == len(ep.turns)
    seg_of = lambda i: max(s for s in ep.segments if s <= i)
    for t, req in zip(ep.turns, mine):
        assert tok.decode(ep.tokens[t.start:t.end], skip_special_tokens=True) == turns[t.index]
        assert req.prompt_ids == ep.tokens[seg_of(t.start):t.start]
        assert all(not ep.loss_mask[i] for i in range(t.end, t.obs_end))  # observations masked


@pytest.mark.parametrize("which", ["tiny", "qwen25"])
def test_prefix_preserving_templates_keep_one_segment_with_tools(which, tokenizer, qwen25_tok):
    tok = tokenizer if which == "tiny" else qwen25_tok
    turns = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>',
             "Let me check.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"391+1\"}}\n</tool_call>",
             "<answer>392</answer>"]
    replies = [[{"role": "tool", "tool_call_id": "c0", "name": "calculator", "content": "391"}],
               [{"role": "tool", "tool_call_id": "c1", "name": "calculator", "content": "392"}]]

    class WithTools(Conversation):
        tools: ClassVar[list] = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate.",
                                                   "parameters": {"type": "object", "properties": {
                                                       "expression": {"type": "string"}}, "required": ["expression"]}}}]

    engine = ScriptedTurns(tok, turns)
    rollout = Rollout(tok, SamplingParams(max_new_tokens=400), max_turns=4)
    ep = run(rollout, group_specs([{"prompt": "17*23+1?"}], lambda r, s: WithTools(r, s, replies=replies), 1, 0, 1),
             engine)[0]
    assert ep.status is Status.OK and len(ep.turns) == 3
    assert ep.segments == [0] and ep.metrics["rollout/prefix_breaks"] == 0
    _check_exact(ep, engine, tok, turns)
    # the whole episode is the template's own rendering of the conversation, as generated
    history = [{"role": "user", "content": "17*23+1?"}]
    for t, reply in zip(turns, replies + [[]]):
        history += [{"role": "assistant", "content": t}] + reply
    rendered = tok.apply_chat_template(history, tools=WithTools.tools if which == "qwen25" else None, tokenize=False)
    assert rendered.startswith(tok.decode(ep.tokens, skip_special_tokens=False))
    if which == "qwen25":  # the tools reached the prompt through the template
        assert '"name": "calculator"' in tok.decode(ep.tokens[: ep.prompt_len])


@pytest.mark.parametrize("policy", ["split", "continue"])
def test_reasoning_stripping_template_breaks_the_prefix(policy, qwen3_tok):
    tok = qwen3_tok
    turns = ["<think>2 and 2</think>4", "<think>4 and 1</think>5"]
    engine = ScriptedTurns(tok, turns)
    rollout = Rollout(tok, SamplingParams(max_new_tokens=400), max_turns=3, prefix_policy=policy)
    make = env_factory(replies=[[{"role": "user", "content": "And plus one?"}]], rewards=[0.0, 1.0])
    specs = group_specs([{"prompt": "2+2?"}], make, 2, 0, 1)
    eps = run(rollout, specs, engine)
    ep = eps[0]
    assert ep.status is Status.OK and ep.metrics["rollout/prefix_breaks"] == 1 and len(ep.segments) == 2
    _check_exact(ep, engine, tok, turns)
    seg2 = ep.segments[1]
    # the second segment is the template's own rendering (reasoning stripped), all masked
    second_ctx = tok.decode(ep.tokens[seg2:ep.turns[1].start], skip_special_tokens=False)
    assert "2 and 2" not in second_ctx and "<|im_start|>assistant\n4<|im_end|>" in second_ctx
    assert not any(ep.loss_mask[seg2:ep.turns[1].start])
    first_trained = any(ep.loss_mask[ep.turns[0].start:ep.turns[0].end])
    assert first_trained == (policy == "split")  # continue: the turn seen in another context stays untrained
    assert all(ep.loss_mask[ep.turns[1].start:ep.turns[1].end])
    # training: one sequence per segment with trained tokens, the episode's advantage on each
    other = eps[1]
    other.reward = 0.0  # a group with different rewards: non-zero advantages
    batch, _ = build_batch(eps, AlgorithmConfig(), trainer=None, kl_coef=0.0)
    assert len(batch) == (4 if policy == "split" else 2)
    assert batch.tokens[0] == (ep.tokens[:seg2] if policy == "split" else ep.tokens[seg2:])
    adv = {round(a, 5) for r in range(len(batch) // 2) for a, m in zip(batch.advantages[r], batch.loss_mask[r][1:]) if m}
    assert len(adv) == 1 and adv.pop() > 0  # the better episode's one advantage on every trained token


def test_token_budget_cuts_turns_and_truncates(tokenizer):
    engine = ScriptedTurns(tokenizer, ["a" * 40] * 5)
    rollout = Rollout(tokenizer, SamplingParams(max_new_tokens=30), max_turns=5, max_total_tokens=60)
    make = env_factory(replies=[[{"role": "user", "content": "more"}]] * 4)
    ep = run(rollout, group_specs([{"prompt": "go"}], make, 1, 0, 1), engine)[0]
    assert ep.status is Status.TRUNCATED and ep.metrics["rollout/out_of_tokens"] == 1
    assert len(ep.tokens) <= 60
    assert engine.requests[0].params.max_new_tokens == min(30, 60 - ep.prompt_len)


def test_step_result_changes_sampling_of_the_next_turn(tokenizer):
    class Override(Conversation):
        async def step(self, action):
            out = await super().step(action)
            out.sampling = SamplingOverride(stop=("</tool_call>",), max_new_tokens=7)
            return out

    engine = ScriptedTurns(tokenizer, ["x", "y", "z"])
    rollout = Rollout(tokenizer, SamplingParams(max_new_tokens=20), max_turns=3)
    envs = []
    make = lambda r, s: envs.append(Override(r, s, replies=[[{"role": "user", "content": "go on"}]] * 3)) or envs[-1]
    ep = run(rollout, group_specs([{"prompt": "hi"}], make, 1, 0, 1), engine)[0]
    assert ep.status is Status.TRUNCATED and ep.metrics["rollout/out_of_turns"] == 1  # it wanted a 4th turn
    p = [r.params for r in engine.requests]
    assert p[0].stop == () and p[0].max_new_tokens == 20
    assert p[1].stop == ("</tool_call>",) and p[1].max_new_tokens == 7 and p[2].stop == ("</tool_call>",)
    assert [a.last_turn for a in envs[0].actions] == [False, False, True]
    assert len({q.seed for q in p}) == 3  # every turn has its own sampling seed


def test_env_sees_text_finish_reason_and_tokens(tokenizer):
    engine = ScriptedTurns(tokenizer, ["hello there"])
    envs = []

    def make(row, seed):
        envs.append(Conversation(row, seed))
        return envs[-1]

    ep = run(Rollout(tokenizer, SamplingParams(max_new_tokens=3)), group_specs([{"prompt": "hi"}], make, 1, 0, 1),
             engine)[0]
    (action,) = envs[0].actions
    assert action.finish_reason == "length" and ep.status is Status.TRUNCATED and action.last_turn  # max_turns=1
    assert list(action.token_ids) == ep.tokens[ep.turns[0].start:ep.turns[0].end]
    assert action.text == tokenizer.decode(action.token_ids, skip_special_tokens=True)
    assert ep.seed == envs[0].seed  # the episode records its env seed


class Scorer:
    """A scorer over a plain function (the reward pool's contract, in process)."""

    def __init__(self, fn, per_group=False):
        self.fn, self.per_group, self.calls = fn, per_group, []

    async def score(self, inputs):
        self.calls.append([i.episode_id for i in inputs])
        return [self.fn(i) for i in inputs]

    async def close(self):
        pass


def test_close_is_called_on_every_path(tokenizer):
    class EngineDown:
        async def generate(self, requests):
            raise RuntimeError("replica gone")

    cases = {
        "done": (env_factory(), None, Status.OK),
        "out of turns": (env_factory(replies=[[{"role": "user", "content": "again"}]] * 3), None, Status.TRUNCATED),
        "step raised": (env_factory(fail_at=0), None, Status.ENV_ERROR),
        "timeout": (env_factory(hang_at=0), None, Status.TIMEOUT),
        "engine error": (env_factory(), EngineDown(), Status.ENGINE_ERROR),
        "reward error": (env_factory(), "bad reward", Status.REWARD_ERROR),
        "reward timeout": (env_factory(), "slow reward", Status.TIMEOUT),
    }
    for name, (make, engine, want) in cases.items():
        Conversation.closed = []
        scorer = None
        if engine == "bad reward":
            scorer = Scorer(lambda i: RewardOutcome("reward_error", error="reward function `f` raised KeyError('x')"))
        elif engine == "slow reward":
            scorer = Scorer(lambda i: RewardOutcome("timeout", error="reward function `f` did not return"))
        if isinstance(engine, str) or engine is None:
            engine = ScriptedTurns(tokenizer, ["a", "b", "c"])
        rollout = Rollout(tokenizer, SamplingParams(max_new_tokens=4), max_turns=2, timeout_s=1.0, scorer=scorer)
        ep = run(rollout, group_specs([{"prompt": "p"}], make, 2, 0, 1), engine)[0]
        assert ep.status is want, (name, ep.status, ep.error)
        assert len(Conversation.closed) == 2, name  # both episodes' environments were closed
        if not want.trainable:
            assert ep.reward != ep.reward and "episode s1-p0-e0" in ep.error  # NaN, and named


def test_env_reset_failure_is_typed_and_closed():
    class Broken:
        name = "broken"
        closed = False

        async def reset(self):
            raise RuntimeError("no such task")

        async def step(self, action):
            raise AssertionError("unreachable")

        async def close(self):
            Broken.closed = True

    rollout = Rollout(tokenizer=None, params=SamplingParams())
    ep = run(rollout, group_specs([{"prompt": "x"}], lambda row, seed: Broken(), 1, 0, 2), None, 2)[0]
    assert ep.status is Status.ENV_ERROR and "env `broken` reset raised RuntimeError(no such task)" in ep.error
    assert "episode s2-p0-e0" in ep.error and ep.reward != ep.reward and Broken.closed


def test_rewards_see_the_episode_and_combine_with_turn_rewards(tokenizer):
    seen = []

    def fn(inp):
        seen.append(inp)
        return RewardOutcome("ok", 0.5, {"correct": 1.0, "format": -0.5})

    engine = ScriptedTurns(tokenizer, ["first", "second"])
    rollout = Rollout(tokenizer, SamplingParams(max_new_tokens=8), max_turns=2, scorer=Scorer(fn))
    make = env_factory(replies=[[{"role": "user", "content": "more"}]], rewards=[0.25])
    row = {"prompt": "q", "answer": "42"}
    ep = run(rollout, group_specs([row], make, 1, 0, 1), engine)[0]
    assert ep.status is Status.OK and ep.reward == 0.75 and ep.outcome_reward == 0.5
    assert ep.metrics["correct"] == 1.0 and ep.reward_parts == {"correct": 1.0, "format": -0.5}
    (inp,) = seen
    assert inp.completion == "second" and inp.columns == {"answer": "42"}
    assert inp.prompt_messages == [{"role": "user", "content": "q"}] and "<|im_start|>user\nq" in inp.prompt
    assert [m["role"] for m in inp.messages] == ["user", "assistant", "user", "assistant"]
    assert [t["text"] for t in inp.turns] == ["first", "second"] and inp.turns[0]["reward"] == 0.25
    assert inp.completion_ids == [t for tr in ep.turns for t in ep.tokens[tr.start:tr.end]]


def test_batched_rewards_score_each_group_once_and_survivors_only(tokenizer):
    scorer = Scorer(lambda i: RewardOutcome("ok", 1.0, {}), per_group=True)
    engine = ScriptedTurns(tokenizer, ["a"])
    fail_first = lambda row, seed: Conversation(row, seed, fail_at=0 if row["prompt"] == "bad" and seed % 2 else None)
    specs = group_specs([{"prompt": "ok"}, {"prompt": "bad"}], fail_first, 4, 0, 1)
    eps = run(Rollout(tokenizer, SamplingParams(max_new_tokens=4), scorer=scorer), specs, engine)
    assert sorted(len(c) for c in scorer.calls) == sorted([4, sum(e.status.trainable for e in eps[4:])])
    assert all(len({x.split("-e")[0] for x in call}) == 1 for call in scorer.calls)  # one group per call
    assert all(e.reward == 1.0 for e in eps if e.status.trainable)


def test_turn_rewards_sit_on_their_turns_last_tokens(tokenizer):
    engine = ScriptedTurns(tokenizer, ["one", "two"])
    make = env_factory(replies=[[{"role": "user", "content": "next"}]], rewards=[0.25, 0.5])
    scorer = Scorer(lambda i: RewardOutcome("ok", 1.0, {"correct": 1.0}))
    ep = run(Rollout(tokenizer, SamplingParams(max_new_tokens=8), max_turns=2, scorer=scorer),
             group_specs([{"prompt": "q"}], make, 1, 0, 1), engine)[0]
    mask = pad_rows([ep.loss_mask[1:]], False, torch.bool)
    r = token_rewards([ep], mask)[0]
    t0, t1 = ep.turns
    assert r[t0.end - 2] == 0.25 and r[t1.end - 2] == 0.5 + 1.0  # last turn: its reward and the outcome
    assert float(r.sum()) == ep.reward == 1.75


def test_batching_client_sends_concurrent_requests_together(tiny_model_dir, tokenizer):
    engine = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    rollout = Rollout(tokenizer, SamplingParams(max_new_tokens=3), max_turns=1)
    from tidal.envs.single_turn import SingleTurnEnv

    specs = group_specs([{"prompt": f"What is {i} + 1?"} for i in range(5)], SingleTurnEnv, samples=4, seed=0, step=1)

    async def go():
        client = BatchingClient(engine)
        eps = await asyncio.gather(*(rollout.run_episode(s, client, 1) for s in specs))
        return eps, client.batches

    eps, batches = asyncio.run(go())
    assert batches == [20] and all(e.status in (Status.TRUNCATED, Status.OK) for e in eps)


def test_a_groups_shared_prompt_is_rendered_once_per_run(tiny_model_dir, tokenizer, qwen25_tok):
    """The samples of a group open with the same messages: the run renders and tokenizes them
    once, and each episode still gets the template's tokens for its own prompt (its own list:
    its turns append to it), tools included. Another run renders them again."""
    engine = TorchEngine(load_model(tiny_model_dir), qwen25_tok.pad_token_id)

    class WithTools(Conversation):
        tools: ClassVar[list] = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate.",
                                                   "parameters": {"type": "object", "properties": {}}}}]

    rendered = []
    original = qwen25_tok.apply_chat_template

    def counting(messages, *a, **kw):
        rendered.append(messages[0]["content"])
        return original(messages, *a, **kw)

    rows = [{"prompt": "What is 2 + 2?"}, {"prompt": "What is 3 + 5?"}]
    rollout = Rollout(qwen25_tok, SamplingParams(max_new_tokens=3), max_turns=1)
    qwen25_tok.apply_chat_template = counting
    try:
        eps = run(rollout, group_specs(rows, lambda r, s: WithTools(r, s), samples=4, seed=0, step=1), engine)
        assert sorted(rendered) == sorted(r["prompt"] for r in rows)  # one render per distinct prompt
        run(rollout, group_specs(rows[:1], lambda r, s: WithTools(r, s), samples=2, seed=0, step=2), engine)
        assert len(rendered) == 3  # a new run renders again
    finally:
        del qwen25_tok.apply_chat_template  # the class's method again
    for ep, row in zip(eps, [r for r in rows for _ in range(4)]):
        want = original([{"role": "user", "content": row["prompt"]}], tools=WithTools.tools,
                        add_generation_prompt=True, tokenize=False)
        assert ep.tokens[: ep.prompt_len] == qwen25_tok(want, add_special_tokens=False)["input_ids"]
        assert '"name": "calculator"' in qwen25_tok.decode(ep.tokens[: ep.prompt_len])
    assert len({id(ep.tokens) for ep in eps}) == len(eps)


def test_slow_episode_ends_timeout_and_others_finish(tokenizer):
    engine = ScriptedTurns(tokenizer, ["a"])
    rollout = Rollout(tokenizer, SamplingParams(max_new_tokens=2), timeout_s=1.0)
    make = lambda row, seed: Conversation(row, seed, hang_at=0 if row["prompt"] == "stuck" else None, rewards=[1.0])
    stuck, fine = run(rollout, group_specs([{"prompt": "stuck"}, {"prompt": "fine"}], make, 1, 0, 1), engine)
    assert stuck.status is Status.TIMEOUT and "episode_timeout_s=1" in stuck.error
    assert fine.status in (Status.OK, Status.TRUNCATED) and fine.reward == 1.0


def test_out_of_turns_is_truncated_without_trailing_tokens(tokenizer):
    engine = ScriptedTurns(tokenizer, ["a", "b"])
    make = env_factory(replies=[[{"role": "user", "content": "again"}]], rewards=[0.25])
    ep = run(Rollout(tokenizer, SamplingParams(max_new_tokens=4), max_turns=1),
             group_specs([{"prompt": "Hi"}], make, 1, 0, 1), engine)[0]
    assert ep.status is Status.TRUNCATED and ep.reward == 0.25 and ep.metrics["rollout/out_of_turns"] == 1
    assert ep.loss_mask[-1] and len(ep.tokens) == ep.turns[0].end
