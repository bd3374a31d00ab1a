"""Agents written against the OpenAI client, trained unchanged (task.env=openai_agent): the
recorded tokens are the engine's, token for token with their log-probs and versions; an
agent that rewrites its history yields segments under the prefix policy and nothing it did
not generate is trained; a crashing, hanging or over-budget agent ends its episode typed.

The agents are functions of this module (tests/ is on sys.path: `test_openai_agent:name`)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tidal.config import GatewayConfig, RewardConfig, RewardSpec, load_config
from tidal.engines.router import Router
from tidal.engines.scripted import ScriptedEngine
from tidal.engines.torch_engine import TorchEngine
from tidal.envs.openai_agent import OpenAIAgentEnv
from tidal.envs.tool_arith import make_rows
from tidal.models import TOOL_MODEL_DIR, load_model, stop_token_ids
from tidal.rewards.pool import build_scorer
from tidal.runtime.controller import Controller
from tidal.runtime.gateway_http import start_gateway
from tidal.runtime.rollout import Rollout, group_specs
from tidal.types import SamplingParams, Status

REPO = Path(__file__).resolve().parent.parent
AGENT = str(REPO / "examples" / "agents" / "react_calculator.py") + ":solve"


# -- agents -------------------------------------------------------------------------------------
def rewriting_agent(row, client):
    """Asks, then rewrites its own reply in the history before asking again (as an agent that
    summarizes would): the second call does not continue the first one's tokens."""
    q = [{"role": "user", "content": row["prompt"][-1]["content"]}]
    first = client.chat.completions.create(model="m", messages=q).choices[0].message.content
    edited = [*q, {"role": "assistant", "content": "(summary) " + first[:3]}, {"role": "user", "content": "Again."}]
    return client.chat.completions.create(model="m", messages=edited).choices[0].message.content


def crashing_agent(row, client):
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    raise KeyError("tool_registry")


async def hanging_agent(row, client):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    await asyncio.sleep(3600)


def sleeping_agent(row, client):
    time.sleep(3)  # a sync agent stuck in a call of its own: the episode times out, the run goes on
    return "late"


def silent_agent(row, client):
    return "an answer without asking the policy"


def looping_agent(row, client):
    while True:  # never stops asking: the session's turn budget refuses the 3rd call
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "more"}])


def odd_agent(row, client):
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return ["not", "a", "reward"]


async def scoring_agent(row, client):
    r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return {"agent_says": 0.25, "length": len(r.choices[0].message.content) / 100}


# -- fixtures ---------------------------------------------------------------------------------
class Tap:
    """An engine seen through: every request and result it served, by request id."""

    def __init__(self, engine):
        self.engine, self.seen = engine, []

    @property
    def version(self):
        return self.engine.version

    async def generate(self, requests):
        results = await self.engine.generate(requests)
        self.seen += list(zip(requests, results))
        return results

    def update_weights(self, version, tensors):
        self.engine.update_weights(version, tensors)

    def pause(self):
        self.engine.pause()

    def resume(self):
        self.engine.resume()


@pytest.fixture(scope="module")
def tapped(tool_tokenizer):
    torch.set_num_threads(2)
    tap = Tap(TorchEngine(load_model(TOOL_MODEL_DIR, "float32", "cpu"), tool_tokenizer.pad_token_id, 64,
                          tokenizer=tool_tokenizer))
    server = start_gateway(Router([tap]), tool_tokenizer, TOOL_MODEL_DIR, GatewayConfig())
    yield server, tap
    server.close()


def run_agents(server, tokenizer, agent: str, rows, samples=2, timeout_s=60.0, max_turns=4, policy="split",
               reward=None):
    params = SamplingParams(max_new_tokens=40, stop_token_ids=stop_token_ids(tokenizer))
    scorer = build_scorer([RewardSpec(fn=reward)], RewardConfig(isolation="inline")) if reward else None
    rollout = Rollout(tokenizer, params, max_turns=max_turns, timeout_s=timeout_s, prefix_policy=policy,
                      scorer=scorer, gateway=server)
    specs = group_specs(rows, lambda row, seed: OpenAIAgentEnv(row, seed, agent=agent), samples, seed=0, step=1)
    return asyncio.run(rollout.run(specs, engine=None, step=1))


def check_tokens_are_the_engines(ep, tap):
    """Every trained span is one engine result, with its log-probs and versions, generated in
    exactly the context the episode holds before it; nothing else is trained."""
    served = {tuple(req.prompt_ids) + tuple(res.token_ids): (req, res) for req, res in tap.seen
              if req.session_id == ep.episode_id}
    trained = 0
    for t in ep.turns:
        seg = max(s for s in ep.segments if s <= t.start)
        key = tuple(ep.tokens[seg:t.end])
        if not ep.loss_mask[t.start]:
            continue
        _, res = served[key]  # the engine was given ep.tokens[seg:t.start] and produced the span
        assert ep.logprobs[t.start:t.end] == res.logprobs
        assert ep.versions[t.start:t.end] == res.versions_per_token()
        trained += t.end - t.start
    assert sum(ep.loss_mask) == trained  # no trained token outside the engine's results


# -- tests -------------------------------------------------------------------------------------
def test_an_unchanged_openai_agent_runs_as_episodes(tapped, tool_tokenizer):
    server, tap = tapped
    rows = make_rows("train", 4, seed=0)
    eps = run_agents(server, tool_tokenizer, AGENT, rows, reward="tidal.envs.tool_arith:score")
    assert {e.status for e in eps} <= {Status.OK, Status.TRUNCATED}, [e.error for e in eps]
    assert all(e.metrics["rollout/prefix_breaks"] == 0 for e in eps)  # the agent appends what it got: one prefix
    assert any(len(e.turns) > 1 for e in eps), "no agent used the calculator"  # tool loops happened
    for e in eps:
        check_tokens_are_the_engines(e, tap)
        assert "correct" in e.reward_parts and e.metrics["gateway/calls"] == len(e.turns)
    with_calls = [t for e in eps for t in e.turns if t.tool_calls]
    assert with_calls and all(c.name == "calculator" for t in with_calls for c in t.tool_calls if c.status == "ok")


def test_an_agent_that_rewrites_its_history_gets_segments(tapped, tool_tokenizer):
    server, tap = tapped
    rows = make_rows("train", 2, seed=1)
    for policy in ("split", "continue"):
        eps = run_agents(server, tool_tokenizer, "test_openai_agent:rewriting_agent", rows, samples=1, policy=policy)
        for e in eps:
            assert e.status.trainable, e.error
            assert e.metrics["rollout/prefix_breaks"] == 1 and len(e.segments) == 2 and len(e.turns) == 2
            check_tokens_are_the_engines(e, tap)
            trained_turns = [t for t in e.turns if e.loss_mask[t.start]]
            assert len(trained_turns) == (2 if policy == "split" else 1)
            # the edited reply sits in the second segment as masked context
            second = e.segments[1]
            ctx = tool_tokenizer.decode([t for t, m in zip(e.tokens[second:], e.loss_mask[second:]) if not m])
            assert "(summary)" in ctx


@pytest.mark.parametrize("agent, status, words", [
    ("crashing_agent", Status.ENV_ERROR, ["test_openai_agent:crashing_agent", "KeyError", "after 1 calls"]),
    ("hanging_agent", Status.TIMEOUT, ["episode_timeout_s"]),
    ("sleeping_agent", Status.TIMEOUT, ["episode_timeout_s"]),
    ("silent_agent", Status.ENV_ERROR, ["made no call through the gateway"]),
    ("odd_agent", Status.ENV_ERROR, ["returned list"]),
    ("looping_agent", Status.TRUNCATED, []),
])
def test_a_failing_agent_ends_its_episode_typed(tapped, tool_tokenizer, agent, status, words):
    server, _ = tapped
    t0 = time.monotonic()
    # the hung agents get 1.5 s; the others room for their calls on a loaded machine
    timeout_s = 1.5 if status is Status.TIMEOUT else 60.0
    (ep,) = run_agents(server, tool_tokenizer, f"test_openai_agent:{agent}", make_rows("train", 1, seed=2), samples=1,
                       timeout_s=timeout_s, max_turns=2)
    assert ep.status is status, ep.error
    for w in words:
        assert w in ep.error
    if not status.trainable:
        assert ep.reward != ep.reward and ep.episode_id in ep.error  # NaN, never 0; the episode named
    else:
        assert ep.metrics["rollout/out_of_turns"] == 1.0 and len(ep.turns) == 2
    assert time.monotonic() - t0 < 30  # nothing waits for a hung agent
    assert not server.gateway.sessions  # every session was closed


def test_what_the_agent_returns_is_its_reward(tapped, tool_tokenizer):
    server, _ = tapped
    (ep,) = run_agents(server, tool_tokenizer, "test_openai_agent:scoring_agent", make_rows("train", 1, seed=3),
                       samples=1)
    assert ep.status.trainable and ep.reward_parts["agent_says"] == 0.25
    # plain pytest.approx in this file (rel 1e-6): hand values (0.1, 1/3, 18/5) against a few float
    # operations on them, which round alike on every CPU; the margin is decimal representation only
    assert ep.reward == pytest.approx(0.25 + ep.reward_parts["length"]) and ep.turns[-1].reward == ep.reward


def test_config_names_a_missing_agent(tmp_path):
    from tidal.config import ConfigError
    from tidal.runtime.tasks import build_task

    cfg = load_config(None, ["task.env=openai_agent", "task.agent=test_openai_agent:nope",
                             "task.env_args={rows_from: tool_arith}"])
    with pytest.raises(ConfigError, match="task.agent.*nope"):
        build_task(cfg.task)
    with pytest.raises(ValueError, match="task.agent"):
        load_config(None, ["task.env=openai_agent"])


def _agent_cfg(tmp_path, *overrides):
    return load_config(str(REPO / "examples" / "openai_agent.yaml"), [
        f"model.path={TOOL_MODEL_DIR}", f"task.agent={AGENT}", f"run.dir={tmp_path / 'run'}",
        "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.steps=3", "run.eval_every=0",
        "run.progress=false", "reward.isolation=inline", *overrides])


def test_an_unchanged_agent_trains_for_several_steps(tmp_path):
    ctl = Controller(_agent_cfg(tmp_path))
    try:
        ctl.train()
    finally:
        ctl.close()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all("grad_norm" in m and m["episodes/ok"] + m["episodes/truncated"] > 0 for m in metrics)
    assert ctl.trainer.version == 3
    rows = pq.read_table(tmp_path / "run" / "episodes" / "step_000003.parquet").to_pylist()
    versions = {v for r in rows for v, m in zip(r["versions"], r["loss_mask"]) if m}
    assert versions == {2}  # step 3 was generated by the weights of step 2, through the gateway
    assert any(c["name"] == "calculator" for r in rows for t in r["turns"] for c in t["tool_calls"])
    assert json.loads((tmp_path / "run" / "gateway.json").read_text())["url"].startswith("http://127.0.0.1:")


@pytest.mark.slow
def test_an_unchanged_agent_trains_in_ray_placement(tmp_path):
    """The agents run on an env worker actor and call the driver's gateway over loopback."""
    ctl = Controller(_agent_cfg(tmp_path, "placement.mode=ray", "placement.env_workers=1", "train.steps=2",
                                "rollout.prompts_per_step=2"))
    try:
        ctl.train()
        served = ctl.roles.envs.served
    finally:
        ctl.close()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all("grad_norm" in m for m in metrics)
    assert sum(served) == 2 * 8  # every episode's agent ran on the env worker
    rows = pq.read_table(tmp_path / "run" / "episodes" / "step_000002.parquet").to_pylist()
    assert {v for r in rows for v, m in zip(r["versions"], r["loss_mask"]) if m} == {1}
    assert all(r["status"] in ("ok", "truncated") for r in rows)


def test_a_scripted_policy_through_the_agent_path_is_exact(tool_tokenizer):
    """With every reply known, the episode is known to the token: the calculator loop of the
    example agent, its tool result and its answer."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 28"}}</tool_call>'
    engine = ScriptedEngine.from_texts(tool_tokenizer, [call, "<answer>9716</answer>"],
                                       stop_token_id=stop_token_ids(tool_tokenizer)[0])
    server = start_gateway(Router([engine]), tool_tokenizer, TOOL_MODEL_DIR, GatewayConfig())
    try:
        row = {"prompt": [{"role": "user", "content": "What is 347 * 28?"}], "answer": "9716"}
        (ep,) = run_agents(server, tool_tokenizer, AGENT, [row], samples=1, reward="tidal.envs.tool_arith:score")
    finally:
        server.close()
    assert ep.status is Status.OK and ep.reward_parts["correct"] == 1.0
    text = tool_tokenizer.decode(ep.tokens)
    assert text.endswith(f"assistant\n{call}<|im_end|>\n<|im_start|>user\n<tool_response>9716</tool_response>"
                         "<|im_end|>\n<|im_start|>assistant\n<answer>9716</answer><|im_end|>")
    assert [t.text for t in ep.turns] == [call, "<answer>9716</answer>"]
    assert ep.turns[0].tool_calls[0].name == "calculator" and ep.turns[0].tool_calls[0].status == "ok"
